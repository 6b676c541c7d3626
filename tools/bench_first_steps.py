#!/usr/bin/env python
"""Time to the N-th step from nothing: dlrm-cxl from a fresh pool (pool creation included)
against TorchRec from an unbuilt model (model initialisation included).

The done-criterion it measures: "``kaggle`` from a fresh pool: the time to its 100th step, pool
creation or open included, is within 1.2x of TorchRec's time to its 100th step, model
initialisation included."

Variants (the same preset, seed 0, the same SyntheticData batches, the same optimizers: row-wise
Adagrad on the embeddings, Adagrad on the dense part):

* ``torchrec``: the clock starts before the model is built: ``torchrec_dlrm`` on the meta
  device, ``DistributedModelParallel`` (world size 1, gloo) sharding it TABLE_WISE with the FUSED
  kernel and ``EXACT_ROWWISE_ADAGRAD`` (which materialises and initialises the tables), the dense
  optimizer, then ``--steps`` steps (``TorchRecVariant`` of ``tools/bench_train.py``). Its
  ``--steps`` batches are generated before the clock starts (conservative: dlrm-cxl generates
  its batches inside the clock, on its prefetch thread);
* ``<tier>`` for each ``--variants`` entry (default ``shm,pmem``): the clock starts before
  ``Trainer(...)`` is built on a fresh pool of that tier under ``--root`` (pool creation, table
  initialisation, the step-0 recovery point), ``--checkpoint undo`` by default as ``dlrm-cxl
  train``; then ``--steps`` steps driven as ``Trainer.run`` drives them (the metrics file, the
  GC freeze past 32 steps, plans made ``--prefetch-batches`` ahead on the prefetch thread,
  ``ckpt.observe_step``, ``bound.after_commit``), then ``ckpt.drain()``: the clock stops when
  the background checkpoint work is done;
* ``<tier>+cache`` (e.g. ``pmem+cache``): the same with a DRAM cache of ``--fraction`` of the
  tables (``dram_cache_bytes``).

Python imports (torch, torchrec, fbgemm, dlrm_cxl) are done before either clock starts. Each
variant runs in a process of its own, one after the other (only one model's tables exist at a
time); its pool is destroyed after it. Printed per variant: the total seconds to step N, split
into setup (the clock's start until the model / Trainer is built) and training (the steps, the
wait for the first batch and, for dlrm-cxl, the final drain), the seconds of the first 10 steps
(from the end of setup) and of the last 10, and the ratio of the total to TorchRec's.

Usage::

    python tools/bench_first_steps.py                                    # kaggle, 100 steps: shm, pmem vs torchrec
    python tools/bench_first_steps.py --variants shm,pmem,pmem+cache --root /mnt/fs --json out.json
    python tools/bench_first_steps.py --preset tiny --steps 20 --variants shm,pmem,pmem+cache   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for _dir in (_ROOT, _ROOT / "tools"):   # the packages, and tools/bench_train.py
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))

import torch  # noqa: E402

from bench_train import TorchRecVariant, command_line, fmt_table, machine_line, make_batches  # noqa: E402
from dlrm_cxl.data import Prefetcher  # noqa: E402
from dlrm_cxl.metrics import open_metrics  # noqa: E402
from dlrm_cxl.model import PRESETS  # noqa: E402
from dlrm_cxl.options import TrainOptions  # noqa: E402
from dlrm_cxl.trainer import Trainer  # noqa: E402
from memory_pool import destroy_pool  # noqa: E402


def _preimport_torchrec() -> None:
    """What ``TorchRecVariant.setup`` imports, imported before the clock (imports are not model
    initialisation; dlrm-cxl's are done at this module's import too)."""
    import fbgemm_gpu.split_embedding_configs  # noqa: F401
    import torch.distributed  # noqa: F401
    import torchrec.distributed.embedding_types  # noqa: F401
    import torchrec.distributed.embeddingbag  # noqa: F401
    import torchrec.distributed.model_parallel  # noqa: F401
    import torchrec.distributed.planner  # noqa: F401
    import torchrec.distributed.types  # noqa: F401


def _preimport_pool() -> None:
    try:  # (fbgemm's kernels: imported where the Trainer binds them)
        import dlrm_cxl.fused  # noqa: F401
    except ImportError:
        pass


def _summary(name: str, setup: float, ends: list[float], total: float) -> dict:
    """``ends[i]``: seconds from the end of setup to the end of step i + 1."""
    n = len(ends)
    k = min(10, n)
    return {"variant": name, "steps": n, "total_seconds": total, "setup_seconds": setup,
            "train_seconds": total - setup, "first10_seconds": ends[k - 1] if n else 0.0,
            "last10_seconds": ends[-1] - (ends[n - k - 1] if n > k else 0.0) if n else 0.0,
            "drain_seconds": total - setup - (ends[-1] if n else 0.0), "step_end_seconds": ends}


def run_torchrec(cfg, *, steps: int, root: Path) -> dict:
    batches = make_batches(cfg, steps, seed=0, alpha=TrainOptions.zipf_alpha)
    _preimport_torchrec()
    workdir = root / "torchrec"
    workdir.mkdir(parents=True, exist_ok=True)
    gc.collect()
    t0 = time.perf_counter()
    v = TorchRecVariant(cfg, batches, workdir)
    v.setup()
    t1 = time.perf_counter()
    ends = []
    for _ in range(steps):
        v.steps(1)
        ends.append(time.perf_counter() - t1)
    total = time.perf_counter() - t0
    out = _summary("torchrec", t1 - t0, ends, total)
    v.close()
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def run_pool(name: str, cfg, *, tier: str, budget: int | None, checkpoint: str, steps: int, root: Path,
             threads: int | None, prefetch: int) -> dict:
    _preimport_pool()
    pool = root / name.replace("+", "-")
    o = TrainOptions(pool=str(pool), steps=steps, tier=tier, dram_cache_bytes=budget, threads=threads,
                     checkpoint=checkpoint, progress=False, prefetch_batches=prefetch, fresh=True)
    gc.collect()
    t0 = time.perf_counter()
    t = Trainer(o, cfg, log=lambda s: None)
    try:
        t1 = time.perf_counter()
        # From here on as Trainer.run (a fresh pool: from step 0, no witnesses to replay).
        start = t.step
        n = max(o.steps - start, 0)
        metrics = open_metrics(t)
        if n > 32:
            gc.collect()
            gc.freeze()
        ends = []
        try:
            with Prefetcher(t.plan_ahead(t.source.iter_batches(t.position_of(start))),
                            depth=o.prefetch_batches) as batches:
                for k in range(start + 1, o.steps + 1):
                    batch, pos, plan = next(batches)
                    metrics.step(k, t.run_step(k, batch, pos, plan)[0])
                    ends.append(time.perf_counter() - t1)
            t.ckpt.drain()
            total = time.perf_counter() - t0
        finally:
            metrics.close()
        out = _summary(name, t1 - t0, ends, total)
        out.update(tier=tier, budget_bytes=budget, durability=t.pool.durability, checkpoint=checkpoint)
        return out
    finally:
        gc.unfreeze()  # (as Trainer.run: the next variant in this process gets this one's memory back)
        t.close()
        destroy_pool(pool)


def parse_variant(v: str, budget: int) -> tuple[str, int | None]:
    """``shm`` -> ("shm", None); ``pmem+cache`` -> ("pmem", budget)."""
    tier, plus, what = v.partition("+")
    if plus and what != "cache":
        raise SystemExit(f"--variants: {v!r}: expected <tier> or <tier>+cache")
    return tier, (budget if plus else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kaggle", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=100, help="steps to time to (default 100)")
    ap.add_argument("--variants", default="shm,pmem", help="dlrm-cxl variants: <tier> or <tier>+cache (default shm,pmem)")
    ap.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec reference")
    ap.add_argument("--fraction", type=float, default=0.25, help="+cache: DRAM budget as a fraction of the tables")
    ap.add_argument("--checkpoint", default="undo", choices=("undo", "none"), help="dlrm-cxl variants (default undo)")
    ap.add_argument("--prefetch-batches", type=int, default=TrainOptions.prefetch_batches)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--root", type=Path, default=None, help="where the pools go (default: a temporary directory)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (a child: one variant, RESULT on stdout)
    a = ap.parse_args(argv)
    if a.steps < 1:
        raise SystemExit("--steps must be >= 1")
    cfg = PRESETS[a.preset]
    budget = int(cfg.table_bytes * a.fraction)
    own_root = a.root is None
    root = a.root or Path(tempfile.mkdtemp(prefix="bench-first-steps-", dir=os.environ.get("TMPDIR", "/tmp")))

    if a.one is not None:  # (a child process: one variant)
        if a.threads:
            torch.set_num_threads(a.threads)
        if a.one == "torchrec":
            r = run_torchrec(cfg, steps=a.steps, root=root)
        else:
            tier, b = parse_variant(a.one, budget)
            r = run_pool(a.one, cfg, tier=tier, budget=b, checkpoint=a.checkpoint, steps=a.steps, root=root,
                         threads=a.threads, prefetch=a.prefetch_batches)
        r["torch_threads"] = torch.get_num_threads()
        print("RESULT " + json.dumps(r), flush=True)
        return 0

    variants = ([] if a.no_torchrec else ["torchrec"]) + [v for v in a.variants.split(",") if v]
    for v in variants:
        if v != "torchrec":
            parse_variant(v, budget)  # (a typo fails before anything runs)
    print(f"$ {command_line()}")
    print(f"# {machine_line()}")
    print(f"# preset {a.preset}: {len(cfg.num_embeddings)} tables, {sum(cfg.num_embeddings):,} rows, dim "
          f"{cfg.embedding_dim}, {cfg.table_bytes / 1e9:.3f} GB of tables; batch {cfg.batch_size}; time to step "
          f"{a.steps}; checkpoint {a.checkpoint}; +cache budget {budget / 1e9:.3f} GB ({a.fraction:g}); root {root}",
          flush=True)
    # Each variant in a process of its own, one after the other: only one model's tables exist at
    # a time, and none starts with what the allocator kept of the one before.
    results = []
    try:
        for v in variants:
            cmd = [sys.executable, __file__, "--one", v, "--preset", a.preset, "--steps", str(a.steps),
                   "--fraction", str(a.fraction), "--checkpoint", a.checkpoint,
                   "--prefetch-batches", str(a.prefetch_batches), "--root", str(root)]
            cmd += ["--threads", str(a.threads)] if a.threads else []
            p = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                print(f"{v} failed (rc {p.returncode}):\n{p.stderr[-3000:]}", file=sys.stderr)
                return 1
            r = json.loads(line[-1][7:])
            results.append(r)
            print(f"  {v}: {r['total_seconds']:.2f} s to step {a.steps} (setup {r['setup_seconds']:.2f} s)", flush=True)
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)

    base = next((r["total_seconds"] for r in results if r["variant"] == "torchrec"), None)
    rows = []
    for r in results:
        rows.append([r["variant"], f"{r['setup_seconds']:.2f}", f"{r['train_seconds']:.2f}",
                     f"{r['total_seconds']:.2f}", f"{r['first10_seconds']:.2f}", f"{r['last10_seconds']:.2f}",
                     f"{r['drain_seconds']:.3f}" if r["variant"] != "torchrec" else "-",
                     f"{r['total_seconds'] / base:.2f}x" if base and r["variant"] != "torchrec" else "-"])
    print()
    w = min(10, a.steps)
    print(fmt_table(["variant", "setup s", "train s", f"total s (to step {a.steps})", f"first {w} s", f"last {w} s",
                     "drain s", "vs torchrec"], rows))
    print("\nsetup: the clock's start until the model (torchrec: built and sharded by DMP, tables initialised) or "
          "the Trainer (a fresh pool created, tables initialised, the step-0 recovery point) is built. train: the "
          "rest, to the end of the last step and (dlrm-cxl) the drain of background checkpoint work. first 10: "
          "from the end of setup to the end of step 10; last 10: the last 10 steps. vs torchrec: total / "
          "torchrec's total (the criterion: <= 1.2x on kaggle, 100 steps).")
    if a.json:
        a.json.write_text(json.dumps({"command": command_line(), "machine": machine_line(), "preset": a.preset,
                                      "steps": a.steps, "checkpoint": a.checkpoint, "budget_bytes": budget,
                                      "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
