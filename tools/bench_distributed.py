#!/usr/bin/env python
"""Samples/s with 1 vs 2 processes (torchrun, gloo, table-wise sharded pools), and what the
coordinated commit costs, measured side by side in one run.

Each configuration trains the same model from scratch for ``--steps`` steps (after a
``--warmup``-step run that is not counted: the second run on the same pool continues it), with
``--threads`` split over the ranks so both use the same cores. Reported per configuration:
samples/s of the timed run, seconds per step in the embedding all_to_alls + dense all_reduce
("exchange"), and in the per-step all_reduce(MIN) that agrees on the globally committed step
("commit agreement", which also absorbs the ranks' skew).

    python tools/bench_distributed.py [--preset small] [--steps 20] [--rounds 2] [--tier shm]
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

REPO = Path(__file__).resolve().parents[1]


def run(nproc: int, pool: Path, steps: int, a, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "dlrm_cxl", "train", "--pool", str(pool), "--preset", a.preset, "--steps", str(steps),
           "--tier", a.tier, "--threads", str(threads), "--json", "--no-progress"]
    if nproc == 1:  # a plain process: the single-process code path, no collectives
        cmd = [sys.executable, "-m", "dlrm_cxl"] + cmd[cmd.index("train"):]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tier", default="shm")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    a = p.parse_args(argv)
    from checkpointing.jobdir import numbered_rank_dirs
    from memory_pool import destroy_pool
    from memory_pool.lifecycle import gc as gc_shm_regions

    results: dict[int, list] = {1: [], 2: []}
    work = Path(tempfile.mkdtemp(prefix="dlrm-bench-dist-"))
    try:
        for r in range(a.rounds):
            for nproc in ((1, 2) if r % 2 == 0 else (2, 1)):
                pool = work / f"p{nproc}-{r}"
                threads = max(1, a.cores // nproc)
                run(nproc, pool, a.warmup, a, threads)
                s = run(nproc, pool, a.warmup + a.steps, a, threads)
                results[nproc].append(s)
                print(f"round {r + 1}: {nproc} process(es): {s['samples_per_s']:,.0f} samples/s", flush=True)
                for d in [pool, *numbered_rank_dirs(pool)]:
                    if (d / "pool.json").exists():
                        destroy_pool(d)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        gc_shm_regions(under=work)  # shm regions of rank pools an error left behind
    print(f"\n# {a.preset}, tier {a.tier}, {a.steps} timed steps, {a.cores} cores split over the ranks")
    print(f"{'processes':<10} {'samples/s':>10} {'vs 1':>6} {'exchange ms/step':>17} {'commit agreement ms/step':>25}")
    base = statistics.median(s["samples_per_s"] for s in results[1])
    for n in (1, 2):
        sps = statistics.median(s["samples_per_s"] for s in results[n])
        d = [s.get("distributed") or {} for s in results[n]]
        ex = statistics.median(x.get("comm_seconds", 0.0) for x in d) * 1e3 / a.steps
        co = statistics.median(x.get("coord_seconds", 0.0) for x in d) * 1e3 / a.steps
        print(f"{n:<10} {sps:>10,.0f} {sps / base:>5.2f}x {ex:>17.1f} {co:>25.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
