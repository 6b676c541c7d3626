#!/usr/bin/env python
"""What a user sees of the DRAM cache: ``dlrm-cxl train`` as real processes, a pool behind a
``--dram-cache`` budget against the same model fully in memory (``--tier dram``), from step 0.

Each variant runs in a fresh process, in a fresh pool (destroyed after), alternating the order
every other round; each round's ratios are against that round's in-memory run (this machine's
speed drifts by more than the differences measured). Variants:

* ``memory``: ``--tier dram``, no budget;
* ``shm+cache``, ``pmem+cache``: that tier's home behind the budget;
* ``shm+cache-wt``: the shm home's arena written through at every step's end
  (``DLRM_CXL_DIRECT_WRITE_BACK=0``) instead of written back and flushed at recovery points.

    python tools/bench_cache_cli.py --preset kaggle --steps 400 --rounds 2 \\
        --variants memory,shm+cache,shm+cache-wt

Printed per run: samples/s (the CLI's, set-up excluded), the ratio to memory, the window, and
from ``pool_stats.cache``: the trainer's time writing rows home a step, the bytes written home a
step, and the rows the recovery points' flushes wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent

VARIANTS = {  # name: (tier, budgeted, extra environment)
    "memory": ("dram", False, {}),
    "shm+cache": ("shm", True, {}),
    "shm+cache-wt": ("shm", True, {"DLRM_CXL_DIRECT_WRITE_BACK": "0"}),
    "pmem+cache": ("pmem", True, {}),
}


def run(variant: str, preset: str, steps: int, budget: str, work: Path) -> dict:
    tier, budgeted, env = VARIANTS[variant]
    pool = work / f"pool-{variant}"
    cmd = [sys.executable, "-m", "dlrm_cxl", "train", "--pool", str(pool), "--preset", preset, "--tier", tier,
           "--steps", str(steps), "--json", "--no-progress", "--no-digest"]
    cmd += ["--dram-cache", budget] if budgeted else []
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=_ROOT, env={**os.environ, **env})
        if out.returncode != 0:
            raise RuntimeError(f"{variant}: rc {out.returncode}\n{out.stderr[-3000:]}")
        return json.loads(out.stdout)
    finally:
        subprocess.run([sys.executable, "-m", "dlrm_cxl", "destroy", "--pool", str(pool)], capture_output=True,
                       cwd=_ROOT)
        shutil.rmtree(pool, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="kaggle")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--budget", default="2195M", help="--dram-cache of the cached variants (default: a quarter "
                                                      "of kaggle's tables)")
    p.add_argument("--variants", default="memory,shm+cache,shm+cache-wt")
    p.add_argument("--workdir", type=Path, help="where pools go (default: a new directory under $TMPDIR)")
    a = p.parse_args(argv)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or "memory" not in variants:
        p.error(f"--variants: {bad or 'memory missing'}; choose among {', '.join(VARIANTS)} (memory among them)")
    if a.rounds < 1 or a.steps < 1:
        p.error(f"--rounds and --steps must be >= 1, got {a.rounds}, {a.steps}")
    work = a.workdir or Path(tempfile.mkdtemp(prefix="dlrm-bench-cache-cli-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"# preset {a.preset}, {a.steps} steps from step 0, budget {a.budget}, {a.rounds} rounds, {os.cpu_count()} cpus")
    ratios: dict[str, list[float]] = {v: [] for v in variants if v != "memory"}
    for r in range(a.rounds):
        got = {}
        for v in (variants if r % 2 == 0 else variants[::-1]):
            d = got[v] = run(v, a.preset, a.steps, a.budget, work)
            c = d["pool_stats"].get("cache") or {}
            n = max(d["steps_run"], 1)
            print(f"  round {r + 1} {v:<13} {d['samples_per_s']:>9,.0f} samples/s  window {d['window']}"
                  + (f"  writing home {c['write_ms_per_step']:.2f} ms/step, {c['bytes_written_home'] / n / 1e6:.2f} "
                     f"MB/step, {c['flushes']:,} rows flushed" if c else ""), flush=True)
        for v in ratios:
            ratios[v].append(got[v]["samples_per_s"] / got["memory"]["samples_per_s"])
    for v, xs in ratios.items():
        print(f"{v}: median {statistics.median(xs):.3f}x of memory ({', '.join(f'{x:.3f}' for x in xs)})")
    if a.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
