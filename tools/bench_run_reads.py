#!/usr/bin/env python
"""What a compaction's reads of cold run rows cost: faulted in through the run's mapping (after
``MADV_WILLNEED``, ``Run.rows``) against large direct reads (``Run.rows(bulk=True)``), side by
side in one process, on one run file of ``--mib`` MiB of 256-byte rows in ``--dir``.

A compaction behind a DRAM cache reads the rows it carries home with a dense page, or moves on
from the oldest run, from runs whose pages every trim dropped: on `kaggle` at the runs' bound
80-170k rows, most alone in their page. Each variant reads ``--rows`` random rows of the run
(sorted), cold (the run's pages dropped first), ``--rounds`` times in turns. Printed per read:
wall time, the thread's CPU, and the whole machine's busy CPU (``/proc/stat``, steal left out:
it counts the kernel's work for the I/O on other threads). Run it with nothing else running.

    python tools/bench_run_reads.py --dir /work/pools --mib 2048 --rows 120000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_page_rmw import busy  # noqa: E402
from memory_pool.runfile import Run, write_run  # noqa: E402

ROW = 256


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="where the run file goes (default: a temporary directory)")
    p.add_argument("--mib", type=int, default=1024, help="the run's rows, MiB (default 1024)")
    p.add_argument("--rows", type=int, default=100_000, help="rows read each time (default 100,000)")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    n = (a.mib << 20) // ROW
    if not 0 < a.rows <= n:
        p.error(f"--rows must be between 1 and the run's {n:,} rows, got {a.rows}")
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        path = Path(d) / "run.bin"
        ids = torch.arange(n, dtype=torch.int64) * 3
        rows = torch.randint(0, 256, (n, ROW), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        write_run(path, 1, {"t": (ROW, ids, rows, torch.empty(0, dtype=torch.int64))})
        pick = ids[torch.randperm(n, generator=torch.Generator().manual_seed(1))[:a.rows].sort().values]
        want = rows[pick // 3]
        del rows
        print(f"# a run of {a.mib} MiB ({n:,} rows of {ROW} B); {a.rows:,} random rows read cold, sorted")
        for r in range(a.rounds):
            for bulk in (False, True):
                run = Run.open(path)
                run.drop_cache()
                time.sleep(0.3)
                b0, c0, t0 = busy(), time.thread_time(), time.perf_counter()
                got = run.rows("t", pick, bulk=bulk)
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                time.sleep(0.3)
                machine = busy() - b0
                if not torch.equal(got, want):
                    raise SystemExit("the rows read differ from the rows written")
                print(f"round {r}  {'bulk (direct reads)' if bulk else 'mapped (faults)':22s} wall {wall:6.2f} s  "
                      f"thread {cpu / a.rows * 1e6:5.1f} us a row  machine {machine / a.rows * 1e6:5.1f} us a row",
                      flush=True)
                run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
