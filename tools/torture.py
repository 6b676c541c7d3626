#!/usr/bin/env python3
"""Torture test: SIGKILL ``dlrm-cxl train`` from outside at random moments, recover, resume.

    python tools/torture.py --trials M [--steps N] [--tier pmem|power-sim|shm] [--preset tiny]
                            [--seed S] [--pool-dir DIR] [--dense-every D] [--threads T]
    python tools/torture.py --quick          # CI: 3 trials, 30 steps, preset tiny, tier pmem

Every process below is a fresh ``python -m dlrm_cxl ...``; every kill is a real ``SIGKILL``
sent by this script (not ``--crash-at``: the trainer does not know when it dies).

What is compared, and why it is an honest check
-----------------------------------------------
1. **Reference digests of every step.** One reference pool is advanced one step at a time
   (``train --steps 0``, ``--steps 1``, ... ``--steps N``; each call reopens the pool and resumes
   it) and the ``state_digest`` after every step ``k`` is recorded as ``ref[k]``. To keep this to
   one interpreter start-up, these calls run one after another in one helper process through
   ``dlrm_cxl.cli.main`` (the function ``python -m dlrm_cxl`` runs). Independently, a fresh
   process runs ``train --steps N`` uninterrupted; its digest must equal ``ref[N]``, so the
   per-step references are themselves checked against an uninterrupted run (and resuming is
   shown to be bit-exact) before any trial counts.
2. **Trials.** On a fresh pool, ``train --steps N`` is started. Once it has printed its banner
   (the pool is open and training is about to run its first step), it is killed with SIGKILL
   after a random delay (``random.Random(seed)``, within about the time the remaining steps
   take). Then ``dlrm-cxl recover --json`` runs -- the same ``checkpointing.recover`` that
   ``train`` runs by itself on a pool that needs recovery. A trial is **bit-exact** when the
   trainer really died of SIGKILL, recovery succeeded, the recovered ``state_digest`` equals
   ``ref[committed_step]`` -- the pool is exactly the state an uninterrupted run has at that step
   (embedding rows, embedding-optimizer rows, dense parameters and dense optimizer state) -- and
   the committed step is not older than the one the previous trial recovered to. Then
   the *same* train command is started again: it continues from the committed step, and the next
   trial kills it. A kill that lands after the run has already finished is not a trial; the
   pool is then discarded and the next trial starts on a fresh pool.
3. **Final.** The train command finally runs to completion; its digest must equal ``ref[N]``.

Prints one line per trial and ``K/M trials bit-exact``. Exit status 0 only when every trial
and the final comparison are bit-exact (1 otherwise, 2 when the reference itself is not
reproducible).

The module also holds :class:`ForkServer` and :class:`Cli`, the process runners the test-suite
uses: a fork server imports the CLI's modules once and runs each command in a forked child (a
real process, killed by a real SIGKILL, writing real files), which saves the ~4 s interpreter
and torch/torchrec start-up of every command. ``DLRM_CXL_TEST_FRESH=1`` makes :class:`Cli` use a
fresh ``python -m dlrm_cxl`` process for every command instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIGEST_RE = re.compile(r"^state_digest ([0-9a-f]{64})\s*$", re.M)

__all__ = ["ForkServer", "Cli", "cli_cmd", "parse_digest", "step_digests", "main"]


# --------------------------------------------------------------------------- process runners


def cli_cmd(*args) -> list[str]:
    """A fresh ``python -m dlrm_cxl ARGS`` command line."""
    return [sys.executable, "-m", "dlrm_cxl", *map(str, args)]


def parse_digest(text: str) -> str | None:
    """The ``state_digest <hex>`` line of a command's output (None when absent)."""
    m = DIGEST_RE.findall(text)
    return m[-1] if m else None


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _serve() -> int:
    """The fork server's loop (``torture.py --fork-server``). One JSON request per stdin line:
    ``{"argv": [...], "stdout": path, "stderr": path, "timeout": s}``; answers ``{"pid": n}`` as
    soon as the child runs and ``{"rc": n}`` when it ended (``-signal`` when killed)."""
    import atexit
    import traceback

    # What makes a fork cheap: everything `python -m dlrm_cxl` imports, imported once.
    from dlrm_cxl import cli
    import checkpointing  # noqa: F401
    import dlrm_cxl.trainer  # noqa: F401

    chan = os.fdopen(os.dup(1), "w", buffering=1)
    chan.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        chan.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: become `python -m dlrm_cxl ARGV`
            rc = 1
            try:
                for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(f, fd)
                    os.close(f)
                nul = os.open(os.devnull, os.O_RDONLY)
                os.dup2(nul, 0)
                os.close(nul)
                os.close(chan.fileno())
                if req.get("timeout"):
                    # A hung command dies of SIGALRM (rc -14): no kill from outside is needed.
                    signal.alarm(max(1, int(req["timeout"])))
                sys.argv = ["dlrm-cxl", *req["argv"]]
                rc = cli.main(req["argv"])
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                traceback.print_exc()
                rc = 1
            finally:
                try:
                    atexit._run_exitfuncs()
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(int(rc) & 0xFF)
        chan.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        chan.write(json.dumps({"rc": rc}) + "\n")
    return 0


class ForkServer:
    """Runs CLI commands in children forked from one warm interpreter. See the module docstring."""

    def __init__(self, start_timeout: float = 300):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--fork-server"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
                                     env=_child_env())
        self._buf = b""
        self._tmp = tempfile.mkdtemp(prefix="dlrm-cxl-forkserver-")
        self._n = 0
        self._lock = threading.Lock()
        self._read(start_timeout)  # {"ready": pid}

    def _read(self, timeout: float) -> dict:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("fork server did not answer in time")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"fork server exited (rc {self.proc.poll()})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run ``dlrm-cxl ARGV`` in a forked child; returncode is ``-9`` for a SIGKILL."""
        argv = [str(a) for a in argv]
        with self._lock:
            self._n += 1
            out = os.path.join(self._tmp, f"{self._n}.out")
            err = os.path.join(self._tmp, f"{self._n}.err")
            req = {"argv": argv, "stdout": out, "stderr": err, "timeout": timeout}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            self._read(60)  # {"pid": n}
            rc = self._read(timeout + 60)["rc"]
            texts = []
            for p in (out, err):
                with open(p, encoding="utf-8", errors="replace") as f:
                    texts.append(f.read())
                os.unlink(p)
        return subprocess.CompletedProcess(["dlrm-cxl", *argv], rc, texts[0], texts[1])

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)


class Cli:
    """``run(argv)`` -> CompletedProcess of ``dlrm-cxl ARGV``: through a :class:`ForkServer`, or a
    fresh ``python -m dlrm_cxl`` process per command (``fresh=True``, or env DLRM_CXL_TEST_FRESH=1)."""

    def __init__(self, fresh: bool | None = None):
        if fresh is None:
            fresh = os.environ.get("DLRM_CXL_TEST_FRESH", "") not in ("", "0")
        self.fresh = fresh
        self.server = None if fresh else ForkServer()

    def run(self, argv, timeout: float = 300) -> subprocess.CompletedProcess:
        if self.server is not None:
            return self.server.run(argv, timeout)
        return subprocess.run(cli_cmd(*argv), capture_output=True, text=True, timeout=timeout, cwd=REPO,
                              env=_child_env())

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


# --------------------------------------------------------------------------- reference digests

_STEPPER = r"""
import contextlib, io, json, sys
from dlrm_cxl.cli import main
argv, n = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for k in range(n + 1):
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = main(argv + ["--steps", str(k), "--json"])
    if rc != 0:
        sys.stderr.write(f"train --steps {k} exited {rc}\n{err.getvalue()}\n")
        sys.exit(1)
    doc = json.loads(buf.getvalue())
    assert doc["end_step"] == k, doc["end_step"]
    out[k] = doc["state_digest"]
print(json.dumps(out))
"""


def step_digests_cmd(train_args: list[str], n: int) -> list[str]:
    """A command that prints {k: digest after step k} for k = 0..n of a pool stepped one by one."""
    return [sys.executable, "-c", _STEPPER, json.dumps([str(a) for a in train_args]), str(n)]


def step_digests(train_args: list[str], n: int, timeout: float = 900) -> dict[int, str]:
    """Run :func:`step_digests_cmd` in a fresh process; ``train_args`` names the pool and flags."""
    proc = subprocess.run(step_digests_cmd(train_args, n), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=_child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"reference stepping failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


# --------------------------------------------------------------------------- the torture


class _Train:
    """A ``train`` process whose stdout is read line by line (to see its banner)."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                     env=_child_env())
        self.lines: list[str] = []
        self.err: list[str] = []
        self.banner = threading.Event()
        self._t = [threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines, True), daemon=True),
                   threading.Thread(target=self._pump, args=(self.proc.stderr, self.err, False), daemon=True)]
        for t in self._t:
            t.start()

    def _pump(self, stream, sink, watch) -> None:
        for line in stream:
            sink.append(line)
            if watch and line.startswith("dlrm-cxl: pool "):
                self.banner.set()

    def wait_banner(self, timeout: float) -> bool:
        """True once the banner is printed; False if the process ended first or time ran out."""
        deadline = time.monotonic() + timeout
        while not self.banner.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return self.banner.is_set()
        return True

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        for t in self._t:
            t.join(timeout=10)
        return rc

    @property
    def stdout(self) -> str:
        return "".join(self.lines)

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def _run(cmd, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=_child_env())


def torture(*, trials: int, steps: int, tier: str, preset: str, seed: int, pool_dir: Path,
            dense_every: int = 1, threads: int = 1, log=print) -> int:
    rnd = random.Random(seed)
    pool_dir.mkdir(parents=True, exist_ok=True)
    ref_pool, uninterrupted_pool, pool = pool_dir / "reference", pool_dir / "uninterrupted", pool_dir / "trial"
    for p in (ref_pool, uninterrupted_pool, pool):
        _remove_pool(p)
    flags = ["--preset", preset, "--tier", tier, "--seed", str(seed), "--dense-every", str(dense_every),
             "--threads", str(threads), "--no-progress"]

    # 1. references: stepped (every k) and uninterrupted, side by side.
    t0 = time.perf_counter()
    stepper = subprocess.Popen(step_digests_cmd(["train", "--pool", str(ref_pool), *flags], steps),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_child_env())
    full = _run(cli_cmd("train", "--pool", uninterrupted_pool, "--steps", steps, *flags, "--json"))
    s_out, s_err = stepper.communicate(timeout=1800)
    if stepper.returncode != 0 or full.returncode != 0:
        log(f"reference runs failed: stepper rc {stepper.returncode}, uninterrupted rc {full.returncode}\n"
            f"{s_err[-3000:]}\n{full.stderr[-3000:]}")
        return 2
    ref = {int(k): v for k, v in json.loads(s_out.strip().splitlines()[-1]).items()}
    full_doc = json.loads(full.stdout)
    log(f"reference: {steps} steps, tier {tier}, preset {preset}, seed {seed}, dense every {dense_every}: "
        f"digest {ref[steps][:16]}... ({time.perf_counter() - t0:.1f} s)")
    if full_doc["state_digest"] != ref[steps]:
        log(f"FAIL: uninterrupted run ends at {full_doc['state_digest']}, the pool stepped one step at a "
            f"time at {ref[steps]}: resuming is not bit-exact, no trial can be judged")
        return 2
    step_s = max(full_doc["seconds"] / max(full_doc["steps_run"], 1), 0.01)

    # 2. trials
    train = cli_cmd("train", "--pool", pool, "--steps", steps, *flags)
    ok = done = 0
    attempts = 0
    committed = 0
    while done < trials:
        attempts += 1
        if attempts > 4 * trials + 4:
            log(f"FAIL: gave up after {attempts - 1} attempts: runs keep finishing before the kill")
            break
        if committed >= steps - 1:
            _remove_pool(pool)  # too little left to kill in: start over on a fresh pool
            committed = 0
        remaining = steps - committed
        delay = rnd.uniform(0.0, min(2.0, 0.7 * remaining * step_s))
        run = _Train(train)
        if not run.wait_banner(300):
            run.proc.kill()
            run.wait(60)
            log(f"FAIL: trainer printed no banner (rc {run.proc.returncode}):\n{run.stderr[-3000:]}")
            return 1
        time.sleep(delay)
        run.proc.send_signal(signal.SIGKILL)  # no-op when it has already exited
        rc = run.wait(300)
        if rc == 0:
            log(f"attempt {attempts}: run finished before the kill (+{delay * 1e3:.0f} ms); not a trial, "
                f"starting over on a fresh pool")
            _remove_pool(pool)
            committed = 0
            continue
        done += 1
        if rc != -signal.SIGKILL:
            log(f"trial {done}/{trials}: FAIL: trainer exited {rc} (expected -9):\n{run.stderr[-3000:]}")
            break
        rec = _run(cli_cmd("recover", "--pool", pool, "--json"))
        if rec.returncode != 0:
            log(f"trial {done}/{trials}: FAIL: recover exited {rec.returncode}: {rec.stderr.strip()[-2000:]}")
            continue
        rep = json.loads(rec.stdout)
        c = rep["committed_step"]
        # bit-exact at the committed step, and no committed step lost (COMMIT only moves forward)
        good = c is not None and rep["state_digest"] == ref.get(c) and c >= committed
        ok += good
        log(f"trial {done}/{trials}: killed +{delay * 1e3:.0f} ms after the banner; recovered to step {c} "
            f"(rolled back {rep['rolled_back_steps']}, {rep['rows_restored']} rows): "
            f"{'bit-exact' if good else 'MISMATCH'} "
            f"({(rep['state_digest'] or '-')[:16]} vs ref {(ref.get(c) or '-')[:16]})")
        committed = c or 0

    # 3. final
    fin = _run(train)
    final = parse_digest(fin.stdout)
    final_ok = fin.returncode == 0 and final == ref[steps]
    log(f"final: train to step {steps}: rc {fin.returncode}, digest {(final or '-')[:16]}... "
        f"{'bit-exact' if final_ok else 'MISMATCH'} (reference {ref[steps][:16]}...)")
    if fin.returncode != 0:
        log(fin.stderr[-3000:])
    log(f"{ok}/{trials} trials bit-exact")
    return 0 if ok == trials and done == trials and final_ok else 1


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--fork-server"]:
        sys.path.insert(0, str(REPO))
        return _serve()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, help="how many kills to survive")
    p.add_argument("--steps", type=int, default=40, help="steps of the run (default 40)")
    p.add_argument("--tier", default="pmem", choices=["pmem", "power-sim", "shm"])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense-every", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of every run (default 1)")
    p.add_argument("--pool-dir", type=Path, help="where the pools go (default: a temporary directory, removed)")
    p.add_argument("--quick", action="store_true", help="CI: 3 trials, 30 steps, preset tiny")
    a = p.parse_args(argv)
    if a.quick:
        a.trials = a.trials or 3
        a.steps = 30
        a.preset = "tiny"
    if not a.trials or a.trials < 1:
        p.error("--trials M (>= 1) or --quick is required")
    if a.steps < 2:
        p.error("--steps must be >= 2")
    keep = a.pool_dir is not None
    root = a.pool_dir or Path(tempfile.mkdtemp(prefix="dlrm-cxl-torture-"))
    try:
        return torture(trials=a.trials, steps=a.steps, tier=a.tier, preset=a.preset, seed=a.seed,
                       pool_dir=Path(root), dense_every=a.dense_every, threads=a.threads,
                       log=lambda s: print(s, flush=True))
    finally:
        if not keep:
            _destroy_under(Path(root))


def _remove_pool(path: Path) -> None:
    """Remove one pool (its shm region too, for the shm tier)."""
    if not path.exists():
        return
    with contextlib.suppress(Exception):
        sys.path.insert(0, str(REPO))
        from memory_pool import destroy_pool

        destroy_pool(path)
    shutil.rmtree(path, ignore_errors=True)


def _destroy_under(root: Path) -> None:
    """Remove the pools (shm regions included) and the directory."""
    with contextlib.suppress(Exception):
        sys.path.insert(0, str(REPO))
        from memory_pool import destroy_pool

        for header in root.glob("*/pool.json"):
            with contextlib.suppress(Exception):
                destroy_pool(header.parent)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
