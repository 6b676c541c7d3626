#!/usr/bin/env python
"""What a crash costs to recover from, through the CLI: ``dlrm-cxl recover`` after a SIGKILL.

For each tier and window setting: ``dlrm-cxl train`` runs ``--steps`` steps of ``--preset`` and is
killed at a random moment of a random step past ``--min-step`` (``--crash-at K:random``: a
seeded watchdog in the trainer, any phase); then ``dlrm-cxl recover --json`` runs as its own
process. Reported per kill: the recovery's own time (``seconds`` in its report: open, restore,
replay; imports and process start-up excluded), of which the replay; the whole command's wall time
(start-up included); the steps replayed; the steps lost (between the newest committed step and
the step the trainer died in). The state after recovery is checked against nothing here: the
tests (tests/test_windows.py) and tools/torture.py do that.

    python tools/bench_recovery.py                                  # small, shm,pmem,power-sim, budget
    python tools/bench_recovery.py --windows 1,4,8,16,budget --tiers pmem --kills 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def _cli(*args, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "dlrm_cxl", *map(str, args)], capture_output=True, text=True,
                       cwd=_ROOT)
    if check and p.returncode != 0:
        raise RuntimeError(f"dlrm-cxl {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr[-2000:]}")
    return p


def one_kill(work: Path, preset: str, tier: str, window: str, steps: int, k: int, seed: int) -> dict:
    pool = work / f"pool-{tier}-{window}"
    flags = ["--preset", preset, "--tier", tier, "--no-progress", "--seed", seed]
    if window != "budget":
        flags += ["--window", window]
    r = _cli("train", "--pool", pool, *flags, "--steps", steps, "--fresh", "--crash-at", f"{k}:random", check=False)
    if r.returncode not in (-9, 137):
        raise RuntimeError(f"the trainer was not killed (exit {r.returncode}): {r.stderr[-1500:]}")
    t0 = time.perf_counter()
    rec = _cli("recover", "--pool", pool, "--json", "--no-digest")
    wall = time.perf_counter() - t0
    rep = json.loads(rec.stdout)
    _cli("destroy", "--pool", pool, check=False)
    return {"tier": tier, "window": window, "killed_at": k, "committed": rep["committed_step"],
            "restored": rep.get("restored_step"), "replayed": rep.get("replayed", 0), "seconds": rep["seconds"],
            "replay_seconds": rep.get("replay_seconds", 0.0), "wall": wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--tiers", default="shm,pmem,power-sim")
    p.add_argument("--windows", default="budget", help="comma-separated: W values and/or 'budget' (default)")
    p.add_argument("--steps", type=int, default=60, help="steps of each killed run (default 60)")
    p.add_argument("--min-step", type=int, default=30, help="kills land in steps min-step..steps-1 (default 30)")
    p.add_argument("--kills", type=int, default=3, help="kills per tier and window (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write every kill's numbers here")
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    work = Path(tempfile.mkdtemp(prefix="dlrm-bench-recovery-"))
    rows = []
    print(f"$ python tools/bench_recovery.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    for tier in a.tiers.split(","):
        for w in a.windows.split(","):
            for i in range(a.kills):
                k = rng.randrange(a.min_step, a.steps)
                r = one_kill(work, a.preset, tier, w, a.steps, k, a.seed)
                rows.append(r)
                print(f"  {tier:<10} window {w:<7} killed in step {k}: restored {r['restored']}, replayed "
                      f"{r['replayed']} to step {r['committed']} ({k - r['committed']} behind the step in flight); "
                      f"recover {r['seconds']:.3f} s "
                      f"({r['replay_seconds']:.3f} s replaying), the command {r['wall']:.2f} s", flush=True)
    print(f"\n{'tier':<10}{'window':>8}{'recover s (median, max)':>26}{'replay s':>10}{'replayed':>10}"
          f"{'command s':>11}{'behind':>8}")
    for tier in a.tiers.split(","):
        for w in a.windows.split(","):
            xs = [r for r in rows if r["tier"] == tier and r["window"] == w]
            sec = [r["seconds"] for r in xs]
            print(f"{tier:<10}{w:>8}{statistics.median(sec):>17.3f}, {max(sec):.3f}"
                  f"{statistics.median(r['replay_seconds'] for r in xs):>10.3f}"
                  f"{statistics.median(r['replayed'] for r in xs):>10.0f}"
                  f"{statistics.median(r['wall'] for r in xs):>11.2f}"
                  f"{max(r['killed_at'] - r['committed'] for r in xs):>8}")
    print("recover s: the report's own time (open, restore, replay), imports and start-up excluded; command s: "
          "the whole `dlrm-cxl recover` process; behind: the most steps between the step the trainer died in and "
          "the step recovered to (1: only the step in flight lost; 2: it and the one before)")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
