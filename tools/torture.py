#!/usr/bin/env python3
"""Torture test: SIGKILL ``dlrm-cxl train`` from outside at random moments, recover, resume.

    python tools/torture.py --trials M [--steps N] [--tiers pmem,power-sim,shm] [--preset tiny]
                            [--seed S] [--pool-dir DIR] [--window W] [--threads T] [--dram-cache SIZE]
                            [--min-rolled-back F] [--fresh-left F] [--fresh-processes]
    python tools/torture.py --quick     # CI: power-sim, pmem and shm, 3 trials each, 30 steps, tiny

Every kill is a real ``SIGKILL`` sent by this script to a real trainer process (not
``--crash-at``: the trainer does not know when it dies).

``--trials M`` counts mid-run trials in all, split evenly over the tiers.

Long mode (the acceptance run; about 5 minutes on a quiet 2-core machine)::

    python tools/torture.py --trials 200 --tiers pmem,power-sim,shm

Acceptance: **zero divergences**, and **>= 80 % of the trials rolled back at least one step**
(``--min-rolled-back 0.8``, the default outside ``--quick``; the exit status is 1 below it).

What is compared, and why it is an honest check
-----------------------------------------------
1. **Reference digests of every step.** One reference pool is advanced one step at a time
   (``train --steps 0``, ``--steps 1``, ... ``--steps N``; each call reopens the pool and resumes
   it) and the ``state_digest`` after every step ``k`` is recorded as ``ref[k]`` (all in one
   process, through ``dlrm_cxl.cli.main``). Independently, a *fresh* ``python -m dlrm_cxl``
   process runs ``train --steps N`` uninterrupted; its digest must equal ``ref[N]``, so the
   per-step references are themselves checked against an uninterrupted run (and resuming is
   shown to be bit-exact) before any trial counts (exit 2 otherwise).
2. **Trials.** ``train --steps N`` runs on a trial pool; once it has printed its banner it is
   killed with SIGKILL after a random delay (``random.Random(seed)``, uniform between about two
   step times and 90 % of the time the remaining steps take; the step time is what the trainers'
   own progress bars report). Then ``dlrm-cxl recover --json`` runs -- the same
   ``checkpointing.recover`` that ``train`` runs by itself on a pool that needs recovery. A kill
   is **bit-exact** when the trainer really died of SIGKILL, recovery succeeded, the recovered
   ``state_digest`` equals ``ref[committed_step]`` -- the pool is exactly the state an
   uninterrupted run has at that step (embedding rows, embedding-optimizer rows, dense
   parameters and dense optimizer state) -- and the committed step is not older than the one
   the previous kill of that pool recovered to. Anything else is a **divergence**. Then the
   *same* train command is started again on the pool: it continues from the committed step, and
   the next trial kills it. When fewer than ``--fresh-left`` (25 %) of the steps are left, the
   next trial starts on a fresh pool, so that kills keep landing mid-run.
3. **Final.** On each tier the train command finally runs to completion; its digest must equal
   ``ref[N]`` (a divergence otherwise).

What a trial proves, and how that is counted (so that the test cannot pass vacuously)
--------------------------------------------------------------------------------------
The trainer's progress bar is on for the trials, refreshed at every step (``TQDM_MININTERVAL=0``,
``TQDM_MINITERS=1`` in its environment; nothing else changes), so its stderr says how many steps
it had *completed* when it died (a lower bound: the bar is written right after a step).

* **mid-run trial**: the kill landed while the training loop was running: the trainer had not
  exited, had not printed its summary, and had not completed its last step. Only these count
  towards ``--trials``.
* **after end** (counted separately, not a trial): the trainer had exited before the kill, had
  printed its summary, or had completed all its steps (killed during shutdown). These kills are
  still recovered and checked bit-exact (a mismatch is a divergence), then the pool starts over.
* **before the run's first step** (counted separately, not a trial): the run printed its banner
  but its progress bar never passed the banner's step, and nothing was rolled back: the kill
  landed in a resumed run's start-up or replay, or in its first step's preparation. These kills
  are recovered and checked bit-exact too, and the next kill continues from the recovered step.
* **rolled back**: the steps the kill undid. The trainer was executing step ``reached =
  completed + 1`` when it died (the loop goes from one step straight to the next; when it had not
  completed a step of this run yet, it may still have been preparing the first one, and then
  ``reached = completed``). The steps rolled back are the steps after the recovered
  ``committed_step`` up to ``reached``, together with the ``rolled_back_steps`` of the recovery
  report. A trial "rolled back >= 1 step" when that set is not empty: the trainer had state
  (rows changed in place, an optimizer step) that the recovered pool must not hold, and the
  digest check shows that it does not. On the journaled tiers (emulated pmem, power-sim) the
  rows of an unfinished step never reach durable media, so recovery rolls that step back with 0
  rows restored and, when the previous step's commit was already durable, without a record to
  undo; on shm (a direct tier) it restores the rows from undo records. The summary also counts
  the trials whose recovery report itself named rolled-back steps (``recovery rolled back``) and
  restored rows (``rows restored``), and the distribution of rolled-back step counts.

Output: one line per kill, one summary line per tier, and a final line such as
``torture: 200 trials, 200 bit-exact, 0 diverged, 187 rolled back >= 1 step (93%), 12 after end
(not counted), 9 before the run's first step (not counted)``. Exit status: 0 when there is no divergence, every tier reached its trials, and
the rolled-back fraction is at least ``--min-rolled-back`` (``--quick``: at least one trial rolled
back a step); 1 otherwise; 2 when a reference is not reproducible.

The trainer and recover processes of the trials are forked from one warm interpreter (the
:class:`ForkServer` below: real processes, killed by a real SIGKILL, writing real files, but
without the ~4 s interpreter and torch/torchrec start-up of each); ``--fresh-processes`` makes
each of them a fresh ``python -m dlrm_cxl`` instead. The uninterrupted reference run is always a
fresh process, which also checks that a forked trainer computes what a fresh one does.

The module also holds :class:`ForkServer` and :class:`Cli`, the process runners the test-suite
uses. ``DLRM_CXL_TEST_FRESH=1`` makes :class:`Cli` use a fresh ``python -m dlrm_cxl`` process
for every command.
"""

# (no `from __future__ import annotations`: the test-suite loads this file with importlib without
# registering it in sys.modules, and dataclasses with string annotations need that)
import argparse
import contextlib
import io
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIGEST_RE = re.compile(r"^state_digest ([0-9a-f]{64})\s*$", re.M)
BANNER_RE = re.compile(r"^dlrm-cxl: pool .*\| step (\d+) -> (\d+)\s*$", re.M)
BAR_RE = re.compile(r"(\d+)/(\d+) \[")
BAR_RATE_RE = re.compile(r"([0-9.]+)(step/s|s/step)")
SUMMARY_RE = re.compile(r"^done: step (\d+)", re.M)
TIERS = ("pmem", "power-sim", "shm")
QUICK_TIERS = ("power-sim", "pmem", "shm")
# The trainer's progress bar, refreshed at every step (tqdm reads these when it is imported).
BAR_ENV = {"TQDM_MININTERVAL": "0", "TQDM_MINITERS": "1"}

__all__ = ["ForkServer", "Cli", "cli_cmd", "parse_digest", "step_digests", "main", "TierResult", "torture_tier"]


# --------------------------------------------------------------------------- process runners


def cli_cmd(*args) -> list[str]:
    """A fresh ``python -m dlrm_cxl ARGS`` command line."""
    return [sys.executable, "-m", "dlrm_cxl", *map(str, args)]


def parse_digest(text: str) -> str | None:
    """The ``state_digest <hex>`` line of a command's output (None when absent)."""
    m = DIGEST_RE.findall(text)
    return m[-1] if m else None


def _child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    # The trainer's tqdm bar although stderr is a pipe (dlrm_cxl/progress.py): its per-step
    # counts say how far a killed run got.
    env.setdefault("DLRM_CXL_PROGRESS", "bar")
    env.update(extra or {})
    return env


def _step_digests_here(argv: list[str], n: int) -> dict[int, str]:
    """In this process: ``train ARGV --steps k --json`` for k = 0..n, one after another; the
    state_digest after every step."""
    from dlrm_cxl.cli import main as cli_main

    out = {}
    for k in range(n + 1):
        buf, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            rc = cli_main(list(argv) + ["--steps", str(k), "--json"])
        if rc != 0:
            raise RuntimeError(f"train --steps {k} exited {rc}\n{err.getvalue()}")
        doc = json.loads(buf.getvalue())
        if doc["end_step"] != k:
            raise RuntimeError(f"train --steps {k} ended at step {doc['end_step']}")
        out[k] = doc["state_digest"]
    return out


def _serve() -> int:
    """The fork server's loop (``torture.py --fork-server``). One JSON request per stdin line:
    ``{"argv": [...], "stdout": path, "stderr": path, "timeout": s}`` (``"stepper": n``: print
    :func:`_step_digests_here` of ARGV and n as JSON instead of running the CLI once); answers
    ``{"pid": n}`` as soon as the child runs and ``{"rc": n}`` when it ended (``-signal`` when
    killed)."""
    import atexit
    import traceback

    # What makes a fork cheap: everything `python -m dlrm_cxl` imports, imported once.
    from dlrm_cxl import cli
    import checkpointing  # noqa: F401
    import dlrm_cxl.trainer  # noqa: F401
    with contextlib.suppress(ImportError):
        import tqdm  # noqa: F401  (the trainer's progress bar, with the environment's settings)
    import gc

    # The imports' objects never die: without this, each child's first full collection walks them
    # all (~0.2 s, around step 10 of a tiny run), and many kills would land in that one pause.
    gc.collect()
    gc.freeze()

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
                if req.get("stepper") is not None:
                    digests = _step_digests_here(req["argv"], int(req["stepper"]))
                    print(json.dumps(digests), flush=True)
                    rc = 0
                else:
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


def wait_event(event: threading.Event, proc, timeout: float, *, tick: float) -> bool:
    """True once ``event`` is set; False if ``proc`` ended first or ``timeout`` s passed."""
    deadline = time.monotonic() + timeout
    while not event.wait(tick):
        if proc.poll() is not None or time.monotonic() > deadline:
            return event.is_set()
    return True


class ForkServer:
    """Runs CLI commands in children forked from one warm interpreter. See the module docstring.

    ``env``: extra environment variables of the server (and so of every child)."""

    def __init__(self, start_timeout: float = 300, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--fork-server"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
                                     env=_child_env(env))
        self._buf = b""
        self._tmp = tempfile.mkdtemp(prefix="dlrm-cxl-forkserver-")
        self._n = 0
        self._lock = threading.Lock()
        self._read(start_timeout)  # {"ready": pid}

    def _read(self, timeout: float) -> dict:
        answer = self._answer(timeout)
        if answer is None:
            raise TimeoutError("fork server did not answer in time")
        return answer

    def _poll(self) -> dict | None:
        """The next answer if one is there already, else None (does not wait)."""
        return self._answer(0.0)

    def _answer(self, timeout: float) -> dict | None:
        """The next answer line of the fork server, waiting up to ``timeout`` s (None: none yet)."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            r, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
            if not r:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"fork server exited (rc {self.proc.poll()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _request(self, req: dict) -> tuple[int, str, str]:
        """Send one request (the lock is held); returns (pid, stdout path, stderr path)."""
        self._n += 1
        out = os.path.join(self._tmp, f"{self._n}.out")
        err = os.path.join(self._tmp, f"{self._n}.err")
        req = {**req, "stdout": out, "stderr": err}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._read(60)["pid"]
        return pid, out, err

    @staticmethod
    def _texts(out: str, err: str) -> list[str]:
        texts = []
        for p in (out, err):
            with open(p, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
            os.unlink(p)
        return texts

    def run(self, argv, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run ``dlrm-cxl ARGV`` in a forked child; returncode is ``-9`` for a SIGKILL."""
        argv = [str(a) for a in argv]
        with self._lock:
            _, out, err = self._request({"argv": argv, "timeout": timeout})
            rc = self._read(timeout + 60)["rc"]
            texts = self._texts(out, err)
        return subprocess.CompletedProcess(["dlrm-cxl", *argv], rc, texts[0], texts[1])

    def step_digests(self, train_args, n: int, timeout: float = 900) -> dict[int, str]:
        """:func:`step_digests` in a forked child."""
        argv = [str(a) for a in train_args]
        with self._lock:
            _, out, err = self._request({"argv": argv, "stepper": n, "timeout": timeout})
            rc = self._read(timeout + 60)["rc"]
            texts = self._texts(out, err)
        if rc != 0:
            raise RuntimeError(f"reference stepping failed ({rc}):\n{texts[1][-4000:]}")
        return {int(k): v for k, v in json.loads(texts[0].strip().splitlines()[-1]).items()}

    def spawn(self, argv, timeout: float = 300) -> "_Forked":
        """Start ``dlrm-cxl ARGV`` in a forked child and return at once (see :class:`_Forked`).
        The server runs nothing else until the child has been waited for."""
        return _Forked(self, [str(a) for a in argv], timeout)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)


class _Forked:
    """A trainer forked by a :class:`ForkServer`, running while this script watches and kills it.
    The same interface as :class:`_Train`: wait_banner, kill, wait, returncode, stdout, stderr."""

    def __init__(self, server: ForkServer, argv: list[str], timeout: float):
        self.server = server
        self.argv = argv
        self.timeout = timeout
        server._lock.acquire()
        self._locked = True
        try:
            self.pid, self._out, self._err = server._request({"argv": argv, "timeout": timeout})
            # A pidfd makes the kill safe against pid reuse once the server has reaped the child.
            self._pidfd = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None
        except BaseException:
            self._release()
            raise
        self.returncode: int | None = None
        self.stdout = self.stderr = ""

    def _release(self) -> None:
        if self._locked:
            self._locked = False
            self.server._lock.release()

    def poll(self) -> int | None:
        if self.returncode is None:
            ans = self.server._poll()
            if ans is not None:
                self.returncode = ans["rc"]
        return self.returncode

    def wait_banner(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), open(self._out, encoding="utf-8", errors="replace") as f:
                if "dlrm-cxl: pool " in f.read():
                    return True
            if self.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.002)

    def kill(self) -> None:
        """SIGKILL, unless the child has already ended."""
        if self.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if not self._locked:  # already waited for
            return self.returncode
        try:
            if self.returncode is None:
                self.returncode = self.server._read((timeout or self.timeout) + 60)["rc"]
            self.stdout, self.stderr = self.server._texts(self._out, self._err)
        finally:
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
            self._release()
        return self.returncode


class Cli:
    """``run(argv)`` -> CompletedProcess of ``dlrm-cxl ARGV``: through a :class:`ForkServer`, or a
    fresh ``python -m dlrm_cxl`` process per command (``fresh=True``, or env DLRM_CXL_TEST_FRESH=1).
    ``spawn(argv)``: the same, started in the background (for a kill); ``env``: extra environment."""

    def __init__(self, fresh: bool | None = None, env: dict | None = None):
        if fresh is None:
            fresh = os.environ.get("DLRM_CXL_TEST_FRESH", "") not in ("", "0")
        self.fresh = fresh
        self.env = dict(env or {})
        self.server = None if fresh else ForkServer(env=self.env)

    def run(self, argv, timeout: float = 300) -> subprocess.CompletedProcess:
        if self.server is not None:
            return self.server.run(argv, timeout)
        return subprocess.run(cli_cmd(*argv), capture_output=True, text=True, timeout=timeout, cwd=REPO,
                              env=_child_env(self.env))

    def spawn(self, argv, timeout: float = 300):
        if self.server is not None:
            return self.server.spawn(argv, timeout)
        return _Train(cli_cmd(*argv), env=self.env)

    def step_digests(self, train_args, n: int, timeout: float = 900) -> dict[int, str]:
        if self.server is not None:
            return self.server.step_digests(train_args, n, timeout)
        return step_digests(train_args, n, timeout)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


# --------------------------------------------------------------------------- reference digests

_STEPPER = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
from torture import _step_digests_here
print(json.dumps(_step_digests_here(json.loads(sys.argv[1]), int(sys.argv[2]))))
"""


def step_digests_cmd(train_args: list[str], n: int) -> list[str]:
    """A command that prints {k: digest after step k} for k = 0..n of a pool stepped one by one."""
    return [sys.executable, "-c", _STEPPER, json.dumps([str(a) for a in train_args]), str(n),
            str(Path(__file__).resolve().parent)]


def step_digests(train_args: list[str], n: int, timeout: float = 900) -> dict[int, str]:
    """Run :func:`step_digests_cmd` in a fresh process; ``train_args`` names the pool and flags."""
    proc = subprocess.run(step_digests_cmd(train_args, n), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=_child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"reference stepping failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


# --------------------------------------------------------------------------- the torture


class _Train:
    """A fresh ``train`` process whose stdout is read line by line (to see its banner)."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                     env=_child_env(env))
        self.pid = self.proc.pid
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
        return wait_event(self.banner, self.proc, timeout, tick=0.002)

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)  # no-op when it has already been waited for

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        for t in self._t:
            t.join(timeout=10)
        return rc

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @property
    def stdout(self) -> str:
        return "".join(self.lines)

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def _run(cmd, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=_child_env())


def bar_steps(stderr: str, total: int) -> int | None:
    """Steps completed according to the trainer's progress bar (the last ``n/total [`` on
    stderr); None when it printed none."""
    found = [int(n) for n, t in BAR_RE.findall(stderr) if int(t) == total]
    return found[-1] if found else None


def bar_step_seconds(stderr: str) -> float | None:
    """Seconds per step of the trainer's progress bar (its last rate), None when it printed none."""
    m = BAR_RATE_RE.findall(stderr)
    if not m:
        return None
    v, unit = float(m[-1][0]), m[-1][1]
    return (1.0 / v if v > 0 else None) if unit.endswith("/s") else v


@dataclass
class Kill:
    """One SIGKILL and what came of it."""

    tier: str
    attempt: int
    delay_s: float
    rc: int | None
    start_step: int | None = None       # the run's first step - 1 (its banner)
    completed: int | None = None        # steps completed when it died (progress bar; banner if none)
    reached: int | None = None          # the step it was executing (see the module docstring)
    after_end: bool = False             # exited, printed its summary, or completed every step
    committed: int | None = None        # recovery's committed_step
    rolled_back_steps: list = field(default_factory=list)
    rows_restored: int = 0
    lost_steps: list = field(default_factory=list)  # after the committed step up to reached, or rolled back by recovery
    bit_exact: bool = False
    problem: str = ""

    @property
    def rolled_back(self) -> int:
        return len(self.lost_steps)

    @property
    def before_first_step(self) -> bool:
        """Killed after the run's banner but before it was seen completing a step (its progress
        bar still at the banner's step), with nothing rolled back: a resumed run's start-up, its
        replay, or its first step's preparation. Recovered and checked like any kill, but not a
        mid-run trial (it proves less; with ``--threads 2`` a short resumed run's start-up was
        ~30 % of the kill range, and the rolled-back fraction fell below its bar on runs that were
        all bit-exact)."""
        return (not self.after_end and self.start_step is not None and self.completed == self.start_step
                and not self.lost_steps)


@dataclass
class TierResult:
    tier: str
    trials_wanted: int
    kills: list = field(default_factory=list)
    final_ok: bool | None = None
    reference_failed: bool = False
    gave_up: bool = False
    seconds: float = 0.0

    @property
    def trials(self) -> list:
        return [k for k in self.kills if not k.after_end and not k.before_first_step]

    @property
    def after_end(self) -> list:
        return [k for k in self.kills if k.after_end]

    @property
    def before_first_step(self) -> list:
        return [k for k in self.kills if k.before_first_step]

    @property
    def diverged(self) -> int:
        return sum(not k.bit_exact for k in self.kills) + (self.final_ok is False) + self.reference_failed

    def counts(self) -> dict:
        t = self.trials
        return {"trials": len(t), "bit_exact": sum(k.bit_exact for k in t), "diverged": self.diverged,
                "rolled_back": sum(k.rolled_back >= 1 for k in t),
                "rows_restored": sum(k.rows_restored > 0 for k in t),
                "recovery_rolled_back": sum(bool(k.rolled_back_steps) for k in t),
                "rolled_back_hist": dict(sorted(Counter(k.rolled_back for k in t).items())),
                "after_end": len(self.after_end), "before_first_step": len(self.before_first_step)}


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.0f}%" if b else "-"


def summary_line(label: str, c: dict) -> str:
    return (f"{label}: {c['trials']} trials, {c['bit_exact']} bit-exact, {c['diverged']} diverged, "
            f"{c['rolled_back']} rolled back >= 1 step ({_pct(c['rolled_back'], c['trials'])}), "
            f"{c['after_end']} after end (not counted), {c.get('before_first_step', 0)} before the run's first "
            f"step (not counted)")


def _flags(*, tier: str, preset: str, seed: int, window: int | None, threads: int,
           dram_cache: str | None = None) -> list[str]:
    return ["--preset", preset, "--tier", tier, "--seed", str(seed),
            *(["--window", str(window)] if window is not None else []),
            *(["--dram-cache", dram_cache] if dram_cache else []),
            "--threads", str(threads)]


def start_uninterrupted(pool: Path, steps: int, flags: list[str]) -> subprocess.Popen:
    """The uninterrupted reference: a fresh ``python -m dlrm_cxl train --steps N --json``."""
    _remove_pool(pool)
    pool.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cli_cmd("train", "--pool", pool, "--steps", steps, *flags, "--no-progress", "--json"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_child_env())


def torture_tier(runner: Cli, *, trials: int, steps: int, tier: str, preset: str, seed: int, pool_dir: Path,
                 window: int | None = None, threads: int = 1, fresh_left: float = 0.25, log=print,
                 uninterrupted: subprocess.Popen | None = None, dram_cache: str | None = None) -> TierResult:
    """The torture of one tier (see the module docstring); ``runner`` runs the trials' processes;
    ``uninterrupted``: the reference run of :func:`start_uninterrupted` if already started."""
    res = TierResult(tier, trials)
    t_start = time.perf_counter()
    rnd = random.Random(f"{seed}:{tier}")
    pool_dir.mkdir(parents=True, exist_ok=True)
    ref_pool, uninterrupted_pool, pool = pool_dir / "reference", pool_dir / "uninterrupted", pool_dir / "trial"
    for p in (ref_pool, pool):
        _remove_pool(p)
    flags = _flags(tier=tier, preset=preset, seed=seed, window=window, threads=threads, dram_cache=dram_cache)

    # 1. references: stepped (every k, in the runner) and uninterrupted (a fresh process), side by side.
    t0 = time.perf_counter()
    full_proc = uninterrupted or start_uninterrupted(uninterrupted_pool, steps, flags)
    ref_err = ""
    try:
        ref = runner.step_digests(["train", "--pool", str(ref_pool), *flags, "--no-progress"], steps)
    except RuntimeError as exc:
        ref, ref_err = None, str(exc)
    f_out, f_err = full_proc.communicate(timeout=1800)
    if ref is None or full_proc.returncode != 0:
        log(f"[{tier}] reference runs failed: uninterrupted rc {full_proc.returncode}\n{ref_err[-3000:]}\n"
            f"{f_err[-3000:]}")
        res.reference_failed = True
        return res
    full_doc = json.loads(f_out)
    log(f"[{tier}] reference: {steps} steps, preset {preset}, seed {seed}, window {window or 'from the recovery budget'}: "
        f"digest {ref[steps][:16]}... ({time.perf_counter() - t0:.1f} s)")
    if full_doc["state_digest"] != ref[steps]:
        log(f"[{tier}] FAIL: uninterrupted run ends at {full_doc['state_digest']}, the pool stepped one step "
            f"at a time at {ref[steps]}: resuming is not bit-exact, no trial can be judged")
        res.reference_failed = True
        return res
    step_s = max(full_doc["seconds"] / max(full_doc["steps_run"], 1), 0.002)
    for p in (ref_pool, uninterrupted_pool):
        _remove_pool(p)

    # 2. trials
    t_trials = time.perf_counter()
    train = ["train", "--pool", str(pool), "--steps", str(steps), *flags]
    committed = 0
    attempts = 0
    rates: list[float] = []
    fresh_below = max(1, int(round(fresh_left * steps)))
    while len(res.trials) < trials:
        attempts += 1
        if attempts > 3 * trials + 6:
            log(f"[{tier}] FAIL: gave up after {attempts - 1} kills: too many landed after the end")
            res.gave_up = True
            break
        if steps - committed < fresh_below:
            _remove_pool(pool)  # too little left to kill in: start over on a fresh pool
            committed = 0
        # Uniform over about the time the remaining steps take, from about two steps in (a kill
        # before the run's first step has completed proves less), so that nearly every kill lands
        # inside a step. The step time: what the trainers' own progress bars reported; until there
        # is some, half the uninterrupted run's (it may have shared the CPUs with other references).
        if rates:
            step_s = sorted(rates[-7:])[len(rates[-7:]) // 2]
        hi = (0.9 if rates else 0.5) * (steps - committed) * step_s
        delay = rnd.uniform(min(2 * step_s, hi / 2), hi)
        run = runner.spawn(train, timeout=600)
        try:
            if not run.wait_banner(300):
                run.kill()
                run.wait(60)
                log(f"[{tier}] FAIL: trainer printed no banner (rc {run.returncode}):\n{run.stderr[-3000:]}")
                res.kills.append(Kill(tier, attempts, 0.0, run.returncode, problem="no banner"))
                break
            time.sleep(delay)
            run.kill()
        finally:
            rc = run.wait(300)
        kill = Kill(tier, attempts, delay, rc)
        res.kills.append(kill)
        kill.problem = _judge(kill, run, runner, pool, ref, steps, committed)
        kill.bit_exact = not kill.problem
        rate = bar_step_seconds(run.stderr)
        if rate:
            rates.append(rate)
        what = ("after end (not counted)" if kill.after_end else
                "before the run's first step (not counted)" if kill.before_first_step else
                f"trial {len(res.trials)}/{trials}")
        log(f"[{tier}] {what}: killed +{delay * 1e3:.0f} ms after the banner (~{step_s * 1e3:.1f} ms/step), run "
            f"from step {kill.start_step}, {kill.completed} completed; recovered to step {kill.committed} (report: rolled back "
            f"{kill.rolled_back_steps}, {kill.rows_restored} rows restored); rolled back {kill.rolled_back} "
            f"step(s) {kill.lost_steps}: "
            + ("bit-exact" if kill.bit_exact else f"DIVERGED: {kill.problem}"))
        if kill.committed is None or kill.after_end or not kill.bit_exact:
            _remove_pool(pool)  # start over: nothing left to kill in, or a state not to build on
            committed = 0
        else:
            committed = kill.committed

    # 3. final
    t_final = time.perf_counter()
    fin = runner.run(train + ["--no-progress"], timeout=600)
    final = parse_digest(fin.stdout)
    res.final_ok = fin.returncode == 0 and final == ref[steps]
    res.seconds = time.perf_counter() - t_start
    log(f"[{tier}] final: train to step {steps}: rc {fin.returncode}, digest {(final or '-')[:16]}... "
        f"{'bit-exact' if res.final_ok else 'MISMATCH'} (reference {ref[steps][:16]}...); "
        f"references {t_trials - t_start:.1f} s, {len(res.kills)} kills {t_final - t_trials:.1f} s, "
        f"tier {res.seconds:.1f} s")
    if fin.returncode != 0:
        log(fin.stderr[-3000:])
    _remove_pool(pool)
    return res


def _judge(kill: Kill, run, runner: Cli, pool: Path, ref: dict, steps: int, committed_before: int) -> str:
    """Classify one kill, recover the pool, compare; returns '' when bit-exact, else the problem."""
    m = BANNER_RE.search(run.stdout)
    kill.start_step = int(m.group(1)) if m else None
    bar = bar_steps(run.stderr, steps)
    kill.completed = bar if bar is not None else kill.start_step
    if kill.rc == 0:  # it finished before the kill
        kill.after_end = True
        kill.committed = steps
        d = parse_digest(run.stdout)
        return "" if d == ref[steps] else f"finished run's digest {(d or '-')[:16]} != ref[{steps}]"
    kill.after_end = bool(SUMMARY_RE.search(run.stdout) or parse_digest(run.stdout)
                          or (kill.completed is not None and kill.completed >= steps))
    if kill.rc != -signal.SIGKILL:
        return f"trainer exited {kill.rc} (expected -9): {run.stderr.strip()[-2000:]}"
    rec = runner.run(["recover", "--pool", pool, "--json"], timeout=600)
    if rec.returncode != 0:
        return f"recover exited {rec.returncode}: {rec.stderr.strip()[-2000:]}"
    rep = json.loads(rec.stdout)
    c = kill.committed = rep["committed_step"]
    kill.rolled_back_steps = list(rep["rolled_back_steps"])
    kill.rows_restored = int(rep["rows_restored"])
    done = kill.completed or 0
    start = kill.start_step if kill.start_step is not None else done
    kill.reached = done + 1 if start < done < steps else done
    # (recovery windows: steps rolled back to the window's start and then replayed are not lost)
    replayed = set(k for k in rep.get("replay_steps", []) if c is not None and k <= c)
    kill.lost_steps = sorted((set(kill.rolled_back_steps) - replayed) | set(range((c or 0) + 1, kill.reached + 1)))
    if c is None:
        return "recovery found no committed step"
    if c >= steps:  # every step was committed: the kill came during shutdown
        kill.after_end = True
    if c < committed_before:
        return f"recovered to step {c}, older than the step {committed_before} recovered before (a commit was lost)"
    if kill.start_step is not None and c < kill.start_step:
        return f"recovered to step {c}, older than the step {kill.start_step} the run started from"
    if rep["state_digest"] != ref.get(c):
        return f"digest {(rep['state_digest'] or '-')[:16]} != ref[{c}] {(ref.get(c) or '-')[:16]}"
    return ""


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--fork-server"]:
        sys.path.insert(0, str(REPO))
        return _serve()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, help="mid-run kills to survive, in all (split evenly over the tiers)")
    p.add_argument("--steps", type=int, default=40, help="steps of the run (default 40)")
    p.add_argument("--tiers", help=f"comma-separated tiers (default pmem; --quick: {','.join(QUICK_TIERS)})")
    p.add_argument("--tier", choices=TIERS, help="one tier (the same as --tiers TIER)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=None,
                   help="the trainer's --window (default: none given, the recovery budget chooses)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of every run (default 1)")
    p.add_argument("--dram-cache", default=None, metavar="SIZE",
                   help="the trainer's --dram-cache (tables behind a DRAM cache arena of SIZE; every run, "
                        "the references included)")
    p.add_argument("--pool-dir", type=Path, help="where the pools go (default: a temporary directory, removed)")
    p.add_argument("--min-rolled-back", type=float, default=None,
                   help="fail when fewer than this fraction of the trials rolled back >= 1 step "
                        "(default 0.8; --quick: at least one trial)")
    p.add_argument("--fresh-left", type=float, default=0.25,
                   help="start a fresh pool when fewer than this fraction of the steps is left (default 0.25)")
    p.add_argument("--fresh-processes", action="store_true",
                   help="a fresh `python -m dlrm_cxl` for every trainer and recover (default: forked)")
    p.add_argument("--quick", action="store_true", help="CI: power-sim, pmem, shm; 3 trials each, 30 steps, tiny")
    a = p.parse_args(argv)
    if a.quick:
        a.steps = 30
        a.preset = "tiny"
        a.tiers = a.tiers or ",".join(QUICK_TIERS)
    tiers = [t.strip() for t in (a.tiers or a.tier or "pmem").split(",") if t.strip()]
    bad = [t for t in tiers if t not in TIERS]
    if bad:
        p.error(f"unknown tier(s) {bad}; choose from {', '.join(TIERS)}")
    if a.quick:
        a.trials = a.trials or 3 * len(tiers)
    if not a.trials or a.trials < len(tiers):
        p.error("--trials M (at least one per tier) or --quick is required")
    if a.steps < 4:
        p.error("--steps must be >= 4")
    keep = a.pool_dir is not None
    root = a.pool_dir or Path(tempfile.mkdtemp(prefix="dlrm-cxl-torture-"))
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    results: list[TierResult] = []
    runner = None
    full: dict[str, subprocess.Popen] = {}
    try:
        # The uninterrupted references (fresh processes) start at once, beside the fork server's start-up.
        for tier in tiers:
            full[tier] = start_uninterrupted(Path(root) / tier / "uninterrupted", a.steps, _flags(
                tier=tier, preset=a.preset, seed=a.seed, window=a.window, threads=a.threads,
                dram_cache=a.dram_cache))
        runner = Cli(fresh=a.fresh_processes, env=BAR_ENV)
        for i, tier in enumerate(tiers):
            n = a.trials // len(tiers) + (i < a.trials % len(tiers))  # --trials in all, split over the tiers
            results.append(torture_tier(runner, trials=n, steps=a.steps, tier=tier, preset=a.preset,
                                        seed=a.seed, pool_dir=Path(root) / tier, window=a.window,
                                        threads=a.threads, fresh_left=a.fresh_left, log=log,
                                        uninterrupted=full[tier], dram_cache=a.dram_cache))
    finally:
        for proc in full.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if runner is not None:
            runner.close()
        if not keep:
            _destroy_under(Path(root))
    for r in results:
        c = r.counts()
        log(summary_line(r.tier, c) + f"; rolled-back steps per trial {c['rolled_back_hist']}, recovery rolled "
            f"back records in {c['recovery_rolled_back']}, rows restored in {c['rows_restored']}; final "
            f"{'bit-exact' if r.final_ok else 'MISMATCH' if r.final_ok is False else '-'}; {r.seconds:.0f} s")
    total = {k: sum(r.counts()[k] for r in results)
             for k in ("trials", "bit_exact", "diverged", "rolled_back", "rows_restored", "recovery_rolled_back",
                       "after_end", "before_first_step")}
    hist = Counter()
    for r in results:
        hist.update(r.counts()["rolled_back_hist"])
    log(f"rolled-back steps per trial: {dict(sorted(hist.items()))}; recovery rolled back records in "
        f"{total['recovery_rolled_back']}, rows restored in {total['rows_restored']} trials; "
        f"{time.perf_counter() - t0:.0f} s")
    log(f"{total['bit_exact']}/{total['trials']} trials bit-exact")
    log(summary_line("torture", total))
    if any(r.reference_failed for r in results):
        return 2
    failed = []
    if total["diverged"]:
        failed.append(f"{total['diverged']} divergence(s)")
    short = [r.tier for r in results if len(r.trials) < r.trials_wanted]
    if short:
        failed.append(f"too few mid-run trials on {', '.join(short)}")
    if a.quick and a.min_rolled_back is None:
        if total["rolled_back"] < 1:
            failed.append("no trial rolled back a step")
    else:
        need = 0.8 if a.min_rolled_back is None else a.min_rolled_back
        for r in results:  # on every tier: one tier's vacuous kills must not hide behind another's
            c = r.counts()
            if c["trials"] and c["rolled_back"] < need * c["trials"]:
                failed.append(f"{r.tier}: only {_pct(c['rolled_back'], c['trials'])} of the trials rolled back "
                              f">= 1 step (--min-rolled-back {need:g})")
    if failed:
        log("torture: FAIL: " + "; ".join(failed))
        return 1
    return 0


def _remove_pool(path: Path) -> None:
    """Remove one pool (its shm region too, for the shm tier)."""
    if not path.exists():
        return
    with contextlib.suppress(Exception):
        sys.path.insert(0, str(REPO))
        from memory_pool import destroy_pool

        destroy_pool(path)
    shutil.rmtree(path, ignore_errors=True)
    _gc_regions_under(path)


def _gc_regions_under(path: Path) -> None:
    """Remove the shm regions of pools under ``path`` that are gone (a create killed before its
    header, which destroy_pool refuses; a pool deleted with rmtree)."""
    with contextlib.suppress(Exception):
        from memory_pool.lifecycle import gc

        gc(under=path)


def _destroy_under(root: Path) -> None:
    """Remove the pools (shm regions included) and the directory."""
    with contextlib.suppress(Exception):
        sys.path.insert(0, str(REPO))
        from memory_pool import destroy_pool

        for header in root.rglob("pool.json"):
            with contextlib.suppress(Exception):
                destroy_pool(header.parent)
    shutil.rmtree(root, ignore_errors=True)
    _gc_regions_under(root)


if __name__ == "__main__":
    sys.exit(main())
