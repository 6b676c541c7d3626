#!/usr/bin/env python3
"""Distributed torture: SIGKILL one rank of a 2-process torchrun job from outside; elastic restart
brings the job back, it finishes, and its final state must be bit-identical to an uninterrupted job.

    python tools/torture_distributed.py --trials M [--steps N] [--tier pmem|power-sim|shm]
                                        [--seed S] [--max-restarts R] [--pool-dir DIR]
                                        [--min-rolled-back F]
    python tools/torture_distributed.py --quick      # 2 trials, 40 steps (about 1.5 minutes)

Long mode (the acceptance run; about 15 minutes on a quiet 2-core machine, ~25 s a trial)::

    python tools/torture_distributed.py --trials 30

Acceptance: zero divergences and >= 80 % of the trials rolled back at least one step
(``--min-rolled-back 0.8``, the default outside ``--quick``).

Every job is ``torchrun --standalone --nproc_per_node 2 --max-restarts R -m dlrm_cxl train --pool
DIR --preset tiny --steps N --threads 1`` (gloo on CPU, tables sharded table-wise over the two
ranks, one pool per rank under ``DIR``), started by this script as a real process.

1. **Reference.** One uninterrupted job of N steps (``--max-restarts 0``); its digest (the job
   digest rank 0 prints, which ``dlrm-cxl inspect --pool DIR --json`` must report too) is the
   reference.
2. **Trials.** Each trial is a fresh job. Once rank 0 has printed its banner, the ranks are found
   as the children of the torchrun agent (the process this script started) whose environment
   says ``RANK=r`` and ``TORCHELASTIC_RESTART_COUNT=0``; one of them, chosen at random
   (``random.Random(seed)``), is killed with SIGKILL after a random delay (uniform between about
   two step times and 90 % of the run, counted from the first step: the time from the banner to
   rank 0's first completed step is learnt from the trials before, so kills land mid-run and not
   while the ranks still open their pools). torchrun sees the rank die, stops the other one and
   restarts both; every rank recovers to the newest step *every* rank committed and the job
   runs to the end. A trial is **bit-exact** when the job exits 0, the killed rank really died
   (the job restarted: a second banner), and both the digest rank 0 prints at the end and the
   digest ``dlrm-cxl inspect --pool DIR --json`` reports (at step N, not needing recovery) equal
   the reference. Anything else is a **divergence**.
3. **Counting** (as in ``tools/torture.py``): rank 0's progress bar is refreshed at every step
   (``TQDM_MININTERVAL=0``, ``TQDM_MINITERS=1``), so its stderr says how many steps the job had
   completed when the rank died; the restarted job's banner (``step C -> N``) says which step
   it resumed from, the globally committed step ``C``. The job was executing step ``reached =
   completed + 1``; the trial **rolled back** the steps after ``C`` up to ``reached`` (or what
   rank 0's recovery reported, if more). Kills that land after the job had completed its last
   step or printed its summary, or that find the rank already gone, are counted as **after end**
   and are not trials.

Output: one line per kill and ``torture-distributed: M trials, K bit-exact, D diverged, R rolled
back >= 1 step (P%), E after end (not counted)``. Exit status 0 only when nothing diverged,
every trial ran, and the rolled-back fraction is met; 2 when the reference job fails.
"""

import argparse
import bisect
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torture import (BAR_ENV, BAR_RE, BAR_RATE_RE, REPO, Cli, _child_env, _destroy_under, parse_digest,  # noqa: E402
                     wait_event)

BANNER_RE = re.compile(r"^dlrm-cxl: pool .*\| step (\d+) -> (\d+)\s*$")
RECOVERED_RE = re.compile(r"recovered to step (\d+): rolled back (\d+) steps, (\d+) rows")
SUMMARY_RE = re.compile(r"^done: step (\d+)")
SECONDS_RE = re.compile(r"^done: step \d+ \((\d+) steps this run, \d+ samples in ([0-9.]+) s")


def torchrun_cmd(pool: Path, *, steps: int, tier: str, seed: int, restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--max-restarts", str(restarts), "-m", "dlrm_cxl", "train", "--pool", str(pool), "--preset", "tiny",
            "--tier", tier, "--seed", str(seed), "--steps", str(steps), "--threads", "1"]


class Job:
    """A torchrun job whose output is read as it comes, with the time each piece arrived."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        env = _child_env({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})})
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=env)
        self.out_lines: list[tuple[float, str]] = []     # (arrival, line) of stdout
        self.err = ""                                     # all of stderr
        self._err_marks: list[tuple[int, float]] = []    # (length of self.err, arrival)
        self.banner = threading.Event()
        self._lock = threading.Lock()
        self._t = [threading.Thread(target=self._pump_out, daemon=True),
                   threading.Thread(target=self._pump_err, daemon=True)]
        for t in self._t:
            t.start()

    def _pump_out(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._lock:
                self.out_lines.append((time.monotonic(), line))
            if BANNER_RE.match(line):
                self.banner.set()

    def _pump_err(self) -> None:
        fd = self.proc.stderr.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            with self._lock:
                self.err += chunk.decode("utf-8", "replace")
                self._err_marks.append((len(self.err), time.monotonic()))

    def wait_banner(self, timeout: float) -> bool:
        return wait_event(self.banner, self.proc, timeout, tick=0.005)

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        for t in self._t:
            t.join(timeout=30)
        return rc

    @property
    def stdout(self) -> str:
        return "\n".join(line for _, line in self.out_lines)

    def err_before(self, t: float) -> str:
        """What arrived on stderr before time ``t``."""
        with self._lock:
            lens = [n for n, _ in self._err_marks]
            times = [tm for _, tm in self._err_marks]
            i = bisect.bisect_right(times, t)
            return self.err[: lens[i - 1]] if i else ""

    def bar_before(self, t: float, total: int) -> int | None:
        """Steps completed by rank 0's progress bar according to what arrived before time ``t``."""
        found = [int(n) for n, tot in BAR_RE.findall(self.err_before(t)) if int(tot) == total]
        return max(found) if found else None

    def first_step_at(self, total: int) -> float | None:
        """When rank 0's progress bar first showed a completed step (monotonic time), or None."""
        with self._lock:
            times = [tm for _, tm in self._err_marks]
        return next((tm for tm in times if (self.bar_before(tm, total) or 0) >= 1), None)

    def banners(self) -> list[tuple[float, int]]:
        return [(tm, int(m.group(1))) for tm, line in self.out_lines if (m := BANNER_RE.match(line))]


def rank_pids(agent: int, restart: int = 0) -> dict[int, int]:
    """{rank: pid} of the workers of the torchrun agent ``agent`` in incarnation ``restart``."""
    kids: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{agent}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{agent}/task/{task}/children") as f:
                kids.update(int(x) for x in f.read().split())
    out = {}
    for pid in kids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"dlrm_cxl" not in cmdline or b"RANK" not in env:
            continue
        if int(env.get(b"TORCHELASTIC_RESTART_COUNT", b"0")) != restart:
            continue
        out[int(env[b"RANK"])] = pid
    return out


@dataclass
class Trial:
    n: int
    rank: int
    delay_s: float
    rc: int | None = None
    step_s: float | None = None        # seconds per step, from rank 0's progress bar
    startup_s: float | None = None     # banner -> rank 0's first completed step, before the kill
    killed: bool = False               # the signal reached a live rank
    completed: int | None = None       # steps rank 0's bar had completed at the kill
    reached: int | None = None         # the step the job was executing
    resumed_from: int | None = None    # the restarted job's first banner: the globally committed step
    incarnations: int = 0
    rank0_recovery: str = ""
    lost_steps: list = field(default_factory=list)
    after_end: bool = False
    bit_exact: bool = False
    problem: str = ""

    @property
    def rolled_back(self) -> int:
        return len(self.lost_steps)


def _inspect(cli: Cli, pool: Path) -> dict | None:
    res = cli.run(["inspect", "--pool", pool, "--json"], timeout=600)
    if res.returncode != 0:
        return None
    with contextlib.suppress(ValueError):
        return json.loads(res.stdout)
    return None


def reference(cli: Cli, pool: Path, *, steps: int, tier: str, seed: int, log) -> tuple[str | None, float]:
    """Digest of an uninterrupted job, and its seconds per step."""
    t0 = time.perf_counter()
    job = Job(torchrun_cmd(pool, steps=steps, tier=tier, seed=seed, restarts=0) + ["--no-progress"])
    rc = job.wait(900)
    digest = parse_digest(job.stdout)
    info = _inspect(cli, pool) if rc == 0 else None
    if rc != 0 or digest is None or info is None or info.get("state_digest") != digest or info.get("step") != steps:
        log(f"reference job failed: rc {rc}, printed digest {digest}, inspect {info and info.get('state_digest')}, "
            f"step {info and info.get('step')}\n{job.stdout[-2000:]}\n{job.err[-3000:]}")
        return None, 0.0
    m = next((m for _, line in job.out_lines if (m := SECONDS_RE.match(line))), None)
    step_s = float(m.group(2)) / max(int(m.group(1)), 1) if m else 0.05
    log(f"reference: uninterrupted 2-rank job, {steps} steps, tier {tier}, seed {seed}: digest {digest[:16]}... "
        f"({step_s * 1e3:.0f} ms/step; {time.perf_counter() - t0:.1f} s)")
    return digest, step_s


def run_trial(cli: Cli, n: int, pool: Path, *, steps: int, tier: str, seed: int, restarts: int, ref: str,
              rnd: random.Random, step_s: float, startup_s: float = 0.0) -> Trial:
    rank = rnd.randrange(2)
    hi = 0.9 * steps * step_s
    delay = startup_s + rnd.uniform(min(2 * step_s, hi / 2), hi)
    t = Trial(n, rank, delay)
    job = Job(torchrun_cmd(pool, steps=steps, tier=tier, seed=seed, restarts=restarts), env=BAR_ENV)

    def give_up(problem: str) -> Trial:
        t.problem = problem
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGTERM)  # the agent stops its workers
        t.rc = job.wait(120)
        log_tail = job.err.strip()[-1500:]
        t.problem += f" (rc {t.rc}): {log_tail}"
        return t

    try:
        if not job.wait_banner(600):
            return give_up("rank 0 printed no banner")
        pids: dict[int, int] = {}
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline and job.proc.poll() is None:
            pids = rank_pids(job.proc.pid, 0)
            if len(pids) < 2:
                time.sleep(0.01)
        if rank not in pids:
            return give_up(f"rank {rank} not found among the agent's children ({pids})")
        pidfd = os.pidfd_open(pids[rank])  # the kill cannot hit another process once this one is gone
        try:
            time.sleep(delay)
            t_kill = time.monotonic()
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                t.killed = True
            except ProcessLookupError:
                t.killed = False
        finally:
            os.close(pidfd)
    except BaseException:
        give_up("interrupted")
        raise
    t.rc = job.wait(900)
    rates = BAR_RATE_RE.findall(job.err_before(t_kill))
    if rates:  # the rate rank 0's bar showed last before the kill
        v, unit = float(rates[-1][0]), rates[-1][1]
        t.step_s = (1 / v if v > 0 else None) if unit.endswith("/s") else v
    bar = job.bar_before(t_kill + 1.0, steps)  # a restart takes seconds: what came within 1 s is from before
    banners = job.banners()
    t.incarnations = len(banners)
    first = job.first_step_at(steps)
    if banners and first is not None and first < t_kill:
        t.startup_s = first - banners[0][0]
    start0 = banners[0][1] if banners else 0
    t.completed = bar if bar is not None else start0
    t.reached = t.completed + 1 if start0 < t.completed < steps else t.completed
    if len(banners) > 1:
        t.resumed_from = banners[1][1]
    rec = [line for _, line in job.out_lines if RECOVERED_RE.search(line)]
    t.rank0_recovery = RECOVERED_RE.search(rec[0]).group(0) if rec else ""
    summary_before_kill = any(SUMMARY_RE.match(line) and tm < t_kill for tm, line in job.out_lines)
    t.after_end = (not t.killed or summary_before_kill or t.completed >= steps
                   or (t.resumed_from is not None and t.resumed_from >= steps))
    if t.resumed_from is not None:
        lost = set(range(t.resumed_from + 1, t.reached + 1))
        m = RECOVERED_RE.search(t.rank0_recovery)
        if m and int(m.group(2)) > len(lost):  # rank 0's own report names more
            lost |= set(range(int(m.group(1)) + 1, int(m.group(1)) + 1 + int(m.group(2))))
        t.lost_steps = sorted(lost)
    # judge
    digest = parse_digest(job.stdout)
    info = _inspect(cli, pool)
    problems = []
    if t.rc != 0:
        problems.append(f"torchrun exited {t.rc}: {job.err.strip()[-1500:]}")
    if t.killed and not t.after_end and t.incarnations < 2:
        problems.append("the killed job did not restart (one banner)")
    if digest != ref:
        problems.append(f"final digest {(digest or '-')[:16]} != reference {ref[:16]}")
    if info is None:
        problems.append("inspect failed")
    else:
        if info.get("step") != steps or info.get("needs_recovery"):
            problems.append(f"inspect: step {info.get('step')}, needs recovery {info.get('needs_recovery')}")
        if info.get("state_digest") != ref:
            problems.append(f"inspect digest {(info.get('state_digest') or '-')[:16]} != reference {ref[:16]}")
    t.problem = "; ".join(problems)
    t.bit_exact = not problems
    return t


def summary_line(label: str, trials: list[Trial], after_end: int, diverged: int) -> str:
    rb = sum(t.rolled_back >= 1 for t in trials)
    pct = f"{100 * rb / len(trials):.0f}%" if trials else "-"
    return (f"{label}: {len(trials)} trials, {sum(t.bit_exact for t in trials)} bit-exact, {diverged} diverged, "
            f"{rb} rolled back >= 1 step ({pct}), {after_end} after end (not counted)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, help="mid-run kills (jobs) to survive; >= 30 is the long mode")
    p.add_argument("--steps", type=int, default=60, help="steps of every job (default 60)")
    p.add_argument("--tier", default="pmem", choices=["pmem", "power-sim", "shm"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts of the trials (default 3)")
    p.add_argument("--pool-dir", type=Path, help="where the jobs go (default: a temporary directory, removed)")
    p.add_argument("--min-rolled-back", type=float, default=None,
                   help="fail when fewer than this fraction of the trials rolled back >= 1 step "
                        "(default 0.8; --quick: at least one trial)")
    p.add_argument("--quick", action="store_true", help="2 trials of 40 steps")
    a = p.parse_args(argv)
    if a.quick:
        a.trials = a.trials or 2
        a.steps = 40
    if not a.trials or a.trials < 1:
        p.error("--trials M (>= 1) or --quick is required")
    if a.steps < 8:
        p.error("--steps must be >= 8")
    log = lambda s: print(s, flush=True)  # noqa: E731
    keep = a.pool_dir is not None
    root = Path(a.pool_dir or tempfile.mkdtemp(prefix="dlrm-cxl-torture-dist-"))
    root.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(f"{a.seed}:distributed")
    t0 = time.perf_counter()
    kills: list[Trial] = []
    cli = None
    try:
        cli = Cli(fresh=False)  # inspect runs forked from a warm interpreter
        ref, step_s = reference(cli, root / "reference", steps=a.steps, tier=a.tier, seed=a.seed, log=log)
        _destroy_under(root / "reference")
        if ref is None:
            return 2
        rates: list[float] = []
        startups: list[float] = []
        attempts = 0
        while sum(not k.after_end for k in kills) < a.trials:
            attempts += 1
            if attempts > 3 * a.trials + 4:
                log("FAIL: gave up: too many kills landed after the end")
                break
            if rates:
                step_s = sorted(rates[-5:])[len(rates[-5:]) // 2]
            startup_s = sorted(startups[-5:])[len(startups[-5:]) // 2] if startups else 0.0
            pool = root / f"trial-{attempts}"
            t = run_trial(cli, attempts, pool, steps=a.steps, tier=a.tier, seed=a.seed, restarts=a.max_restarts,
                          ref=ref, rnd=rnd, step_s=step_s, startup_s=startup_s)
            kills.append(t)
            _destroy_under(pool)
            done = sum(not k.after_end for k in kills)
            what = "after end (not counted)" if t.after_end else f"trial {done}/{a.trials}"
            log(f"{what}: SIGKILL rank {t.rank} +{t.delay_s * 1e3:.0f} ms after the banner"
                f"{'' if t.killed else ' (it had already exited)'}; {t.completed} steps completed; "
                f"resumed from step {t.resumed_from} ({t.incarnations} incarnations"
                f"{'; rank 0 ' + t.rank0_recovery if t.rank0_recovery else ''}); rolled back {t.rolled_back} "
                f"step(s) {t.lost_steps}: " + ("bit-exact" if t.bit_exact else f"DIVERGED: {t.problem}"))
            if t.step_s:
                rates.append(t.step_s)
            if t.startup_s is not None:
                startups.append(t.startup_s)
    finally:
        if cli is not None:
            cli.close()
        if not keep:
            _destroy_under(root)
    trials = [k for k in kills if not k.after_end]
    after = len(kills) - len(trials)
    diverged = sum(not k.bit_exact for k in kills)
    hist = dict(sorted(Counter(t.rolled_back for t in trials).items()))
    log(f"rolled-back steps per trial: {hist}; killed rank: {dict(sorted(Counter(t.rank for t in trials).items()))}; "
        f"{time.perf_counter() - t0:.0f} s")
    log(summary_line("torture-distributed", trials, after, diverged))
    failed = []
    if diverged:
        failed.append(f"{diverged} divergence(s)")
    if len(trials) < a.trials:
        failed.append(f"only {len(trials)} of {a.trials} trials ran")
    rb = sum(t.rolled_back >= 1 for t in trials)
    if a.quick and a.min_rolled_back is None:
        if rb < 1:
            failed.append("no trial rolled back a step")
    else:
        need = 0.8 if a.min_rolled_back is None else a.min_rolled_back
        if trials and rb < need * len(trials):
            failed.append(f"only {rb}/{len(trials)} trials rolled back >= 1 step (--min-rolled-back {need:g})")
    if failed:
        log("torture-distributed: FAIL: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
