#!/usr/bin/env python
"""Where the undo log's and the DRAM cache's time goes, per step, in a training loop driven as
``dlrm-cxl train`` drives it (plans made on the prefetch thread).

Prints, over ``--steps`` steps after ``--warmup``: the wall time per step; the CPU time of each
thread (``/proc/self/task/*/stat``: the trainer's thread, the prefetch thread, the journal's
threads, torch's OpenMP workers) and what each made the device read (``/proc/self/task/*/io``:
on a disk home behind a DRAM cache, the misses on the prefetch thread against the trims'
write-backs on the trainer's); and the wall time per step spent in the checkpointer's and the
cache's main calls (timed by wrapping them: ``WindowRows.first_touch``, ``Transaction.undo``,
``UndoLogCheckpointer.log_before_image`` / ``commit``, ``CacheArena.begin`` / ``end`` /
``prefetch`` / ``_admit_groups``), by the thread that made them.

    python tools/profile_overhead.py                                  # small, shm, undo
    python tools/profile_overhead.py --checkpoint none                # the same without the undo log
    python tools/profile_overhead.py --preset kaggle --dram-cache 0.25  # a cache of 1/4 of the tables
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import checkpointing.undo as undo  # noqa: E402
import checkpointing.window as window  # noqa: E402
import memory_pool.cache_arena as cache_arena  # noqa: E402
import memory_pool.transaction as transaction  # noqa: E402
from dlrm_cxl.data import Prefetcher  # noqa: E402
from dlrm_cxl.model import PRESETS  # noqa: E402
from dlrm_cxl.options import TrainOptions  # noqa: E402
from dlrm_cxl.trainer import Trainer  # noqa: E402
from memory_pool import destroy_pool  # noqa: E402

TIMED = [(window.WindowRows, "first_touch"), (transaction.Transaction, "undo"),
         (undo.UndoLogCheckpointer, "log_before_image"), (undo.UndoLogCheckpointer, "commit"),
         (cache_arena.CacheArena, "begin"), (cache_arena.CacheArena, "end"),
         (cache_arena.CacheArena, "prefetch"), (cache_arena.CacheArena, "_admit_groups")]


class Timers:
    def __init__(self):
        self.seconds: dict = collections.defaultdict(float)

    def wrap(self, cls, name: str) -> None:
        fn = getattr(cls, name)
        label = f"{cls.__name__}.{name}"

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[(threading.current_thread().name, label)] += time.perf_counter() - t0

        setattr(cls, name, timed)


def by_thread() -> tuple[collections.Counter, collections.Counter]:
    """(CPU seconds, bytes read from the device) so far of each of this process's threads, by
    name (torch's OpenMP workers, which Python does not know, together). The bytes are
    ``/proc/self/task/*/io`` ``read_bytes``: what the thread made the device read -- its page
    faults and its synchronous reads; readahead asked for with ``POSIX_FADV_WILLNEED`` counts
    for the thread that asked."""
    tck = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    cpu: collections.Counter = collections.Counter()
    read: collections.Counter = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        name = names.get(int(tid), "openmp workers and others")
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu[name] += (int(fields[11]) + int(fields[12])) / tck
            with open(f"/proc/self/task/{tid}/io") as f:
                read[name] += next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))
        except (OSError, StopIteration):
            continue  # (a thread that ended meanwhile)
    return cpu, read


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--tier", default="shm")
    p.add_argument("--checkpoint", default="undo", choices=["undo", "none"])
    p.add_argument("--window", type=int, default=None, help="default: from the recovery budget, as train")
    p.add_argument("--dram-cache", type=float, default=None, help="a DRAM cache of this fraction of the tables")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--workdir", type=Path)
    a = p.parse_args(argv)
    cfg = PRESETS[a.preset]
    timers = Timers()
    for cls, name in TIMED:
        timers.wrap(cls, name)
    work = a.workdir or Path(tempfile.mkdtemp(prefix="dlrm-profile-"))
    pool = work / "pool"
    budget = int(cfg.table_bytes * a.dram_cache) if a.dram_cache else None
    tr = Trainer(TrainOptions(pool=str(pool), steps=10**9, tier=a.tier, checkpoint=a.checkpoint, window=a.window,
                              dram_cache_bytes=budget, progress=False, fresh=True), cfg, log=lambda s: None)
    try:
        with Prefetcher(tr.plan_ahead(tr.source.iter_batches(None))) as batches:
            for k in range(1, a.warmup + a.steps + 1):
                if k == a.warmup + 1:
                    tr.ckpt.drain()
                    timers.seconds.clear()
                    (c0, r0), t0 = by_thread(), time.perf_counter()
                batch, pos, plan = next(batches)
                tr.run_step(k, batch, pos, plan)  # (as Trainer.run drives it)
            tr.ckpt.drain()
            wall, (c1, r1) = time.perf_counter() - t0, by_thread()
        n = a.steps
        print(f"# {a.preset} on {a.tier}, checkpoint {a.checkpoint}, window {tr.ckpt.window}"
              f"{f', DRAM cache {budget:,} bytes' if budget else ''}: {1e3 * wall / n:.1f} ms a step "
              f"(steps {a.warmup + 1}..{a.warmup + n})")
        print("CPU per step, by thread:")
        for name in sorted(set(c0) | set(c1)):
            print(f"  {name:<34}{1e3 * (c1[name] - c0[name]) / n:8.2f} ms")
        if any(r1[name] > r0[name] for name in r1):
            print("device reads per step, by thread (read_bytes):")
            for name in sorted(set(r0) | set(r1)):
                if r1[name] > r0[name]:
                    print(f"  {name:<34}{(r1[name] - r0[name]) / n / 1e6:8.2f} MB")
        print("wall time per step in:")
        for (thread, label), s in sorted(timers.seconds.items()):
            print(f"  {label:<40}{thread:<22}{1e3 * s / n:8.2f} ms")
    finally:
        tr.close()
        destroy_pool(pool)
    return 0


if __name__ == "__main__":
    sys.exit(main())
