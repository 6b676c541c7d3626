#!/usr/bin/env python
"""Where a training step's time goes: the CLI's loop under torch.profiler, per phase.

Runs ``dlrm_cxl.trainer.Trainer`` exactly as ``dlrm-cxl train`` does (data generated per step by
the prefetch thread), and prints the wall time per step of each named phase of
``Trainer.train_step`` (``dlrm_cxl.plan``, ``dlrm_cxl.log_before_image``, ``dlrm_cxl.forward``,
``dlrm_cxl.backward_and_fused_update``, ``dlrm_cxl.dense_optimizer``, ``dlrm_cxl.commit``), the
time outside them (the loop, waiting for the next batch), and the busiest operators.

    python tools/profile_step.py                         # small, shm, undo, 20 profiled steps
    python tools/profile_step.py --tier pmem --checkpoint none --kernel reference
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from dlrm_cxl.data import Prefetcher  # noqa: E402
from dlrm_cxl.model import PRESETS  # noqa: E402
from dlrm_cxl.options import TrainOptions  # noqa: E402
from dlrm_cxl.trainer import Trainer  # noqa: E402
from memory_pool import destroy_pool  # noqa: E402

PHASES = ("plan", "log_before_image", "forward", "backward_and_fused_update", "dense_optimizer", "commit")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--tier", default="shm")
    p.add_argument("--checkpoint", default="undo", choices=["undo", "none"])
    p.add_argument("--kernel", default="fused", choices=["fused", "reference"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workdir", type=Path)
    a = p.parse_args(argv)
    work = a.workdir or Path(tempfile.mkdtemp(prefix="dlrm-profile-"))
    pool = work / "pool"
    total = a.warmup + a.steps
    tr = Trainer(TrainOptions(pool=str(pool), steps=10**9, tier=a.tier, checkpoint=a.checkpoint, kernel=a.kernel,
                              progress=False, fresh=True), PRESETS[a.preset], log=lambda s: None)
    try:
        # As `dlrm-cxl train` does: the plans are made on the prefetch thread (Trainer.plan_ahead).
        with Prefetcher(tr.plan_ahead(tr.source.iter_batches(None))) as batches:
            for k in range(1, a.warmup + 1):
                batch, pos, plan = next(batches)
                tr.set_batch_position(k, pos)
                tr.train_step(k, batch, plan)
            tr.ckpt.drain()
            with profile(activities=[ProfilerActivity.CPU], with_stack=bool(os.environ.get("PROF_STACK"))) as prof:
                t0 = time.perf_counter()
                for k in range(a.warmup + 1, total + 1):
                    batch, pos, plan = next(batches)
                    tr.set_batch_position(k, pos)
                    tr.train_step(k, batch, plan)
                wall = time.perf_counter() - t0
        ev = {e.key: e for e in prof.key_averages()}
        print(f"# {a.preset} on {a.tier}, checkpoint {a.checkpoint}, kernel {a.kernel}, "
              f"{torch.get_num_threads()} threads: {1e3 * wall / a.steps:.1f} ms/step "
              f"({a.steps * tr.cfg.batch_size / wall:,.0f} samples/s)")
        inside = 0.0
        print(f"{'phase':<28}{'ms/step':>10}")
        for ph in PHASES:
            e = ev.get(f"dlrm_cxl.{ph}")
            ms = e.cpu_time_total / 1e3 / a.steps if e else 0.0
            inside += ms
            print(f"{ph:<28}{ms:>10.2f}")
        print(f"{'outside (loop, next batch)':<28}{1e3 * wall / a.steps - inside:>10.2f}")
        print("\nbusiest operators (self CPU, all threads):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    finally:
        tr.close()
        destroy_pool(pool)
    return 0


if __name__ == "__main__":
    sys.exit(main())
