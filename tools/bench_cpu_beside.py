#!/usr/bin/env python
"""What a millisecond of CPU spent beside the step costs the step, on this machine.

The fully in-memory model (tier ``dram``, no cache, the default durability) trains with a
*burner* thread that, at the start of every step, spends ``ms`` of its own CPU time (numpy
sorts, which release the GIL). Phases of ``--steps`` steps each, one per value of ``--burn``,
after ``--warmup`` steps, in one process and one pool, so they compare side by side. Printed per
phase: samples/s, the median step, and the step's extra time per ms burnt against the phases
with 0 ms.

Why: on a machine with as many cores as the step has intra-op threads (2 here), the step's ops
meet at a barrier after each one, and a thread that takes a core stalls both. The DRAM cache's
prefetch thread, the step's own ``begin``/``end`` and the compactor are such threads: this
measures the price of their CPU (docs/tiering-measurements.md, eighth session).

Usage::

    python tools/bench_cpu_beside.py                          # kaggle, 0,7,0,7,14,0 ms
    python tools/bench_cpu_beside.py --preset tiny --steps 20 --warmup 5 --burn 0,1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import numpy as np  # noqa: E402

from dlrm_cxl.data import Prefetcher  # noqa: E402
from dlrm_cxl.model import PRESETS  # noqa: E402
from dlrm_cxl.options import TrainOptions  # noqa: E402
from dlrm_cxl.trainer import Trainer  # noqa: E402
from memory_pool import destroy_pool  # noqa: E402


class Burner:
    """A thread that spends ``ms`` of its CPU time each time :meth:`kick` is called."""

    def __init__(self):
        self.ms = 0.0
        self._go = threading.Event()
        self._stop = False
        self._work = np.random.default_rng(0).random(4096)
        self._thread = threading.Thread(target=self._run, name="burner", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        if self.ms > 0:
            self._go.set()

    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            c0 = time.thread_time()
            while time.thread_time() - c0 < self.ms / 1e3:
                np.sort(self._work)

    def close(self) -> None:
        self._stop = True
        self._go.set()
        self._thread.join()


def measure(preset: str, burns: list[float], steps: int, warmup: int, root: Path) -> list[dict]:
    cfg = PRESETS[preset]
    pool = root / "pool"
    t = Trainer(TrainOptions(pool=str(pool), steps=warmup + steps * len(burns), tier="dram", progress=False,
                             fresh=True), cfg, log=lambda s: None)
    burner = Burner()
    out = []
    try:
        with Prefetcher(t.plan_ahead(t.source.iter_batches(None)), depth=2) as batches:
            k = 0
            for phase, ms in enumerate([0.0] + burns):
                n = warmup if phase == 0 else steps
                burner.ms, times, w0 = ms, [], time.perf_counter()
                for _ in range(n):
                    k += 1
                    batch, pos, plan = next(batches)
                    burner.kick()
                    times.append(t.run_step(k, batch, pos, plan)[1])
                if phase:
                    out.append({"burn_ms": ms, "samples_per_s": n * cfg.batch_size / (time.perf_counter() - w0),
                                "median_step_ms": 1e3 * statistics.median(times)})
            t.ckpt.drain()
    finally:
        burner.close()
        t.close()
        destroy_pool(pool)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="kaggle", choices=sorted(PRESETS))
    ap.add_argument("--burn", default="0,7,0,7,14,0", help="ms of CPU burnt beside each step, one phase each")
    ap.add_argument("--steps", type=int, default=200, help="steps per phase")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--root", type=Path, default=None, help="where the pool goes (default: a temporary directory)")
    a = ap.parse_args(argv)
    try:
        burns = [float(x) for x in a.burn.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--burn takes ms values separated by commas, got {a.burn!r}")
    if not burns or any(b < 0 for b in burns):
        ap.error(f"--burn takes ms values >= 0, got {a.burn!r}")
    if a.steps < 1 or a.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0, got {a.steps} and {a.warmup}")
    with tempfile.TemporaryDirectory(prefix="bench-cpu-beside-", dir=a.root) as root:
        rows = measure(a.preset, burns, a.steps, a.warmup, Path(root))
    base = [r["median_step_ms"] for r in rows if r["burn_ms"] == 0]
    ref = statistics.mean(base) if base else None
    print(f"{'burn ms':>8} {'samples/s':>10} {'median ms':>10} {'extra ms per ms burnt':>22}")
    for r in rows:
        extra = (f"{(r['median_step_ms'] - ref) / r['burn_ms']:.2f}" if ref is not None and r["burn_ms"] else "-")
        print(f"{r['burn_ms']:>8.1f} {r['samples_per_s']:>10,.0f} {r['median_step_ms']:>10.1f} {extra:>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
