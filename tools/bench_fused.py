#!/usr/bin/env python
"""Forward + fused backward/optimizer time of :class:`dlrm_cxl.fused.FusedEmbeddingBags` vs
fbgemm's own ``SplitTableBatchedEmbeddingBagsCodegen`` (CPU, host), side by side in one run.

Both run the same fbgemm CPU kernels; ours reads and updates tables in a caller-owned flat
tensor (each table starting on its own 4 KiB page, so with gaps between tables; ``--file``: a
file-backed shared mmap instead of anonymous memory), the TBE in the flat tensor it allocated
itself. Same weights, same optimizer (EXACT_ROWWISE_ADAGRAD by default), the same pre-generated
SyntheticData batches (one Zipf id per sample per table) and the same upstream gradient.

A step is ``out = bags(values, offsets); out.backward(grad)``. After ``--warmup`` untimed steps
each, ``--rounds`` rounds time ``--steps`` steps of each variant, interleaved (A B, B A, ...);
reported: median ms/step over rounds, min..max, and the ratio of medians. At the end the two
variants' weights and optimizer state are compared (they took the same steps, so they should be
bit-identical).

Usage::

    python tools/bench_fused.py                    # small preset: 26 tables, dim 64, batch 2048
    python tools/bench_fused.py --threads 1 --optimizer sgd --file /dev/shm/bench_fused.bin
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: E402
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from dlrm_cxl.data import SyntheticData  # noqa: E402
from dlrm_cxl.fused import FusedEmbeddingBags, FusedTableSpec  # noqa: E402
from dlrm_cxl.model import PRESETS  # noqa: E402
from dlrm_cxl.options import data_spec  # noqa: E402

PAGE = 4096 // 4  # floats per page


def _align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def build(preset: str, optimizer: str, lr: float, eps: float, file: str | None, seed: int):
    cfg = PRESETS[preset]
    rows, D = cfg.num_embeddings, cfg.embedding_dim
    adagrad = optimizer == "rowwise_adagrad"
    specs, w_off, s_off = [], 0, 0
    for r in rows:
        specs.append(FusedTableSpec(r, D, w_off, s_off if adagrad else None))
        w_off = _align(w_off + r * D)
        s_off = _align(s_off + r)
    if file:
        with open(file, "wb") as f:
            f.truncate((w_off + s_off) * 4)
        flat = torch.from_file(file, shared=True, size=w_off + s_off, dtype=torch.float32)
    else:
        flat = torch.zeros(w_off + s_off)
    weights, state = flat[:w_off], (flat[w_off:] if adagrad else None)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, D, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in rows],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD if adagrad else EmbOptimType.EXACT_SGD,
        learning_rate=lr, eps=eps)
    g = torch.Generator().manual_seed(seed)
    for t, (s, r) in enumerate(zip(specs, rows)):
        bound = (1.0 / r) ** 0.5
        x = torch.empty(r, D).uniform_(-bound, bound, generator=g)
        tbe.split_embedding_weights()[t].copy_(x)
        weights[s.weight_offset:s.weight_offset + r * D].copy_(x.view(-1))
    ours = FusedEmbeddingBags(specs, weights, optimizer=optimizer, lr=lr, eps=eps, state=state)
    return cfg, specs, ours, tbe, weights, state


def compare(specs, weights, state, tbe) -> tuple[float, float]:
    w_diff = m_diff = 0.0
    tw = tbe.split_embedding_weights()
    tm = tbe.split_optimizer_states() if state is not None else None
    for t, s in enumerate(specs):
        ours = weights[s.weight_offset:s.weight_offset + s.rows * s.dim].view(s.rows, s.dim)
        w_diff = max(w_diff, float((ours - tw[t]).abs().max()))
        if state is not None:
            m = state[s.state_offset:s.state_offset + s.rows]
            m_diff = max(m_diff, float((m - tm[t][0].reshape(-1)).abs().max()))
    return w_diff, m_diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--optimizer", default="rowwise_adagrad", choices=["rowwise_adagrad", "sgd"])
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--batches", type=int, default=8, help="distinct pre-generated batches, cycled")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    ap.add_argument("--file", default=None, help="back our tables by a shared mmap of this file")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    cfg, specs, ours, tbe, weights, state = build(a.preset, a.optimizer, a.lr, a.eps, a.file, a.seed)
    spec = data_spec(cfg)
    data = SyntheticData(spec, seed=a.seed)
    batches = []
    g = torch.Generator().manual_seed(a.seed + 1)
    for k in range(a.batches):
        kjt = data.batch(k).sparse
        values, offsets = kjt.values(), kjt.offsets().to(torch.int64)
        batches.append((values, offsets, torch.randn(cfg.batch_size, ours.total_D, generator=g)))

    variants = {"fused (ours)": ours, "fbgemm TBE": tbe}
    counters = {name: 0 for name in variants}

    def run(name: str, n: int) -> float:
        mod = variants[name]
        t0 = time.perf_counter()
        for _ in range(n):
            values, offsets, grad = batches[counters[name] % len(batches)]
            counters[name] += 1
            mod(values, offsets).backward(grad)
        return (time.perf_counter() - t0) / n * 1e3

    for name in variants:
        run(name, a.warmup)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(a.rounds):
        for name in names[r % 2:] + names[:r % 2]:
            times[name].append(run(name, a.steps))

    print(f"preset={a.preset}: {len(specs)} tables, rows={sum(s.rows for s in specs):,}, dim={cfg.embedding_dim}, "
          f"batch={cfg.batch_size}, optimizer={a.optimizer}, threads={torch.get_num_threads()}, "
          f"storage={'mmap ' + a.file if a.file else 'anonymous'}; {a.rounds} rounds x {a.steps} steps")
    print(f"{'variant':<14} {'median ms/step':>15} {'min..max':>17}")
    for name in names:
        ts = times[name]
        print(f"{name:<14} {statistics.median(ts):>15.2f} {min(ts):>8.2f}..{max(ts):<8.2f}")
    ratio = statistics.median(times[names[0]]) / statistics.median(times[names[1]])
    print(f"ratio ours / TBE: {ratio:.3f}")
    w_diff, m_diff = compare(specs, weights, state, tbe)
    same = counters[names[0]] == counters[names[1]]
    print(f"after {counters[names[0]]} identical steps each: max |w - TBE w| = {w_diff:.3g}"
          + (f", max |state - TBE momentum1| = {m_diff:.3g}" if state is not None else "")
          + ("" if same else " (step counts differ: not comparable)"))
    if a.file:
        del ours, weights, state
        os.unlink(a.file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
