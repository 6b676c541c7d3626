#!/usr/bin/env python
"""Throughput of the memory pool's row access and pooled lookup on every tier, side by side.

Not a test: a benchmark. One run measures, for a DLRM-shaped batch (default 2048 samples x 26
sparse features, one Zipf-distributed id per feature, dim 64, 26 tables of 100k rows):

* ``table.read``   rows/s of gathering each feature's ids from its table (copies);
* ``table.write``  rows/s of writing each feature's *unique* ids in place;
* ``pool.lookup``  rows/s (ids pooled per second) of the sum-pooled lookup of a KeyedJaggedTensor;

on the tiers dram, shm, pmem, power-sim, and pmem with a DRAM cache budget of 1/4 of the
tables' bytes -- both as the pool hands it out (one pool-wide budget, first come) and as one
pool per table with 1/4 of that table each (so every table goes through its row cache; its
pooled lookup is ``Table.lookup`` per table, concatenated, as ``pool.lookup`` does). The
same pooled work runs through ``torch.nn.EmbeddingBag(mode="sum")`` (one per table, DRAM)
and fbgemm's CPU table-batched embedding (``SplitTableBatchedEmbeddingBagsCodegen``,
``EmbeddingLocation.HOST``, ``ComputeDevice.CPU``); a large ``torch.clone`` gives the memory
bandwidth, the physical ceiling. The machine is noisy: every variant is measured ``--reps``
times in rotation (interleaved, starting each round at the next variant) and the median is
reported; the ratios are medians of per-round ratios, which cancels the load phases of a shared
machine.

    python tools/bench_pool.py            # full size
    python tools/bench_pool.py --quick    # small tables, few repetitions
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory_pool import MemoryPool, destroy_pool  # noqa: E402
from memory_pool.lifecycle import gc as gc_shm_regions  # noqa: E402


def zipf_ids(rows: int, n: int, alpha: float, perm: torch.Tensor, g: torch.Generator, p: torch.Tensor) -> torch.Tensor:
    """``n`` ids of a Zipf(alpha) popularity over ``rows``; the hot rows are spread by ``perm``."""
    return perm[torch.multinomial(p, n, replacement=True, generator=g)]


def make_batches(args, g):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    T, B, L, R = args.tables, args.batch, args.bag, args.rows
    p = torch.arange(1, R + 1, dtype=torch.float64).pow(-args.alpha)
    perms = [torch.randperm(R, generator=g) for _ in range(T)]
    keys = [f"t{i}" for i in range(T)]
    batches = []
    for _ in range(args.batches):
        per_table = [zipf_ids(R, B * L, args.alpha, perms[t], g, p) for t in range(T)]
        values = torch.cat(per_table)
        lengths = torch.full((T * B,), L, dtype=torch.int64)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
        uniq = [torch.unique(ids) for ids in per_table]
        batches.append({
            "kjt": kjt,
            "ids": per_table,
            "uniq": uniq,
            "wvals": [torch.randn(u.numel(), args.dim, generator=g) * 1e-3 for u in uniq],
            "offsets": torch.arange(0, B * L, L, dtype=torch.int64),  # per table
            "fb_offsets": torch.arange(0, T * B * L + 1, L, dtype=torch.int64),
        })
    return keys, batches


class PoolVariant:
    def __init__(self, name, pools, tables, mode="pool"):
        self.name, self.pools, self.tables, self.mode = name, pools, tables, mode

    def read(self, b):
        for t, ids in zip(self.tables, b["ids"]):
            t.read(ids)
        return sum(ids.numel() for ids in b["ids"])

    def write(self, b):
        for t, ids, v in zip(self.tables, b["uniq"], b["wvals"]):
            t.write(ids, v)
        return sum(u.numel() for u in b["uniq"])

    def lookup(self, b):
        if self.mode == "pool":
            out = self.pools[0].lookup(b["kjt"]).values()
        else:  # one pool per table: Table.lookup per table, then concatenated like a KeyedTensor
            out = torch.cat([t.lookup(ids, b["offsets"]) for t, ids in zip(self.tables, b["ids"])], dim=1)
        return b["kjt"].values().numel(), out

    def describe(self):
        cached = sum(t.cached for t in self.tables)
        return f"{cached}/{len(self.tables)} tables cached"

    def stats(self):
        hits = sum(p.stats.cache_hits for p in self.pools)
        misses = sum(p.stats.cache_misses for p in self.pools)
        return hits, misses

    def close(self):
        for p in self.pools:
            p.close()


class TensorVariant:
    """Plain DRAM tensors, nn.EmbeddingBag per table (the reference for ratios)."""

    def __init__(self, weights):
        self.name = "nn.EmbeddingBag"
        self.w = weights
        self.bags = [torch.nn.EmbeddingBag.from_pretrained(w, mode="sum", freeze=True) for w in weights]

    def read(self, b):
        for w, ids in zip(self.w, b["ids"]):
            w.index_select(0, ids)
        return sum(ids.numel() for ids in b["ids"])

    def write(self, b):
        for w, ids, v in zip(self.w, b["uniq"], b["wvals"]):
            w.index_copy_(0, ids, v)
        return sum(u.numel() for u in b["uniq"])

    def lookup(self, b):
        kjt = b["kjt"]
        bounds = kjt.offset_per_key()
        vals = kjt.values()
        outs = [eb(vals[bounds[i]:bounds[i + 1]], b["offsets"]) for i, eb in enumerate(self.bags)]
        return vals.numel(), torch.cat(outs, dim=1)

    def describe(self):
        return "DRAM, one module per table"

    def close(self):
        pass


class FbgemmVariant:
    def __init__(self, weights, dim):
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.name = "fbgemm TBE (CPU)"
        self.emb = SplitTableBatchedEmbeddingBagsCodegen(
            [(w.shape[0], dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for w in weights],
            pooling_mode=PoolingMode.SUM)
        with torch.no_grad():
            for dst, src in zip(self.emb.split_embedding_weights(), weights):
                dst.copy_(src)

    read = write = None

    def lookup(self, b):
        vals = b["kjt"].values()
        return vals.numel(), self.emb(vals, b["fb_offsets"])

    def describe(self):
        return "SplitTableBatchedEmbeddingBagsCodegen, HOST/CPU"

    def close(self):
        pass


def build_pool_variants(args, weights, root: Path):
    T = args.tables
    total = sum(w.numel() * w.element_size() for w in weights)
    variants = []

    def fill(tables):
        for t, w in zip(tables, weights):
            t.view().copy_(w)  # identical weights everywhere (bypasses dirty tracking: fine here)

    specs = [("dram", "dram", None), ("shm", "shm", None), ("pmem", "pmem", None), ("power-sim", "power-sim", None),
             ("pmem+cache1/4 pool", "pmem", total // 4)]
    for name, tier, budget in specs:
        if args.tiers and name.split("+")[0] not in args.tiers:
            continue
        path = root / name.replace("/", "_").replace(" ", "_")
        pool = MemoryPool.create(path, tier=tier, dram_cache_bytes=budget)
        tables = [pool.create_table(f"t{i}", args.rows, args.dim) for i in range(T)]
        fill(tables)  # power-sim: rows stay in the private mapping; no persist is timed
        variants.append(PoolVariant(name, [pool], tables))
    if not args.tiers or "pmem" in args.tiers:
        pools, tables = [], []
        for i, w in enumerate(weights):
            pool = MemoryPool.create(root / f"percache{i}", tier="pmem",
                                     dram_cache_bytes=w.numel() * w.element_size() // 4)
            tables.append(pool.create_table(f"t{i}", args.rows, args.dim))
            pools.append(pool)
        fill(tables)
        variants.append(PoolVariant("pmem+cache1/4 table", pools, tables, mode="tables"))
    return variants


def bandwidth(nbytes: int, reps: int) -> float:
    x = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    x.clone()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        y = x.clone()
        times.append(time.perf_counter() - t0)
        del y
    return 2 * nbytes / statistics.median(times)  # read + write


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=100_000, help="rows per table")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--bag", type=int, default=1, help="ids per sample and feature")
    ap.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    ap.add_argument("--reps", type=int, default=15, help="interleaved repetitions per variant (median)")
    ap.add_argument("--batches", type=int, default=4, help="distinct batches cycled through")
    ap.add_argument("--inner", type=int, default=2, help="batches per timed measurement")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--dir", default=None, help="parent directory of the pmem/power-sim pools (default: a temp dir)")
    ap.add_argument("--tiers", nargs="*", default=None, help="subset of dram shm pmem power-sim")
    ap.add_argument("--no-fbgemm", action="store_true")
    ap.add_argument("--ops", nargs="*", default=["read", "write", "lookup"], choices=["read", "write", "lookup"],
                    help="operations to time (default all)")
    ap.add_argument("--quick", action="store_true", help="26 x 20k rows, 5 reps, 1 batch per measurement")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.reps, args.batches, args.inner = min(args.rows, 20_000), 5, 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    g = torch.Generator().manual_seed(0)
    print(f"# bench_pool: {args.tables} tables x {args.rows} rows x dim {args.dim} (fp32, "
          f"{args.tables * args.rows * args.dim * 4 / 2**20:.0f} MiB per copy), batch {args.batch} x bag {args.bag}, "
          f"Zipf alpha {args.alpha}; median of {args.reps} interleaved reps x {args.inner} batches; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus, "
          f"load average {os.getloadavg()[0]:.1f}")
    if torch.get_num_threads() > 1 and os.getloadavg()[0] > os.cpu_count() / 2:
        print("# note: a busy machine and several torch threads make every parallel op wait for descheduled "
              "threads; --threads 1 measures more steadily")
    weights = [torch.empty(args.rows, args.dim).uniform_(-0.01, 0.01, generator=g) for _ in range(args.tables)]
    keys, batches = make_batches(args, g)

    root = Path(tempfile.mkdtemp(prefix="bench_pool.", dir=args.dir))
    variants = []
    try:
        variants.append(TensorVariant([w.clone() for w in weights]))
        if not args.no_fbgemm:
            try:
                variants.append(FbgemmVariant(weights, args.dim))
            except Exception as exc:  # keep the benchmark useful without fbgemm
                print(f"# fbgemm unavailable: {type(exc).__name__}: {exc}")
        variants += build_pool_variants(args, weights, root)

        # Sanity: every variant pools to the same numbers (before any write changes weights).
        ref = variants[0].lookup(batches[0])[1]
        for v in variants[1:]:
            got = v.lookup(batches[0])[1]
            if not torch.allclose(got, ref, atol=1e-5, rtol=1e-4):
                raise SystemExit(f"{v.name}: pooled lookup differs from nn.EmbeddingBag")

        ops = ("read", "write", "lookup")
        samples = {(v.name, op): [] for v in variants for op in ops}
        counter = 0
        faults = {}
        for rep in range(args.reps + 1):  # rep 0 warms up (page faults, COW, caches)
            # Rotate the order each rep, so that no variant always follows the same one (the
            # kernel writes back what the file-backed variants dirtied while the next one runs).
            k0 = rep % len(variants)
            for v in variants[k0:] + variants[:k0]:
                for op in ops:
                    fn = getattr(v, op)
                    if fn is None or op not in args.ops:
                        continue
                    rows = 0
                    gc.disable()
                    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    t0 = time.perf_counter()
                    for k in range(args.inner):
                        r = fn(batches[(counter + k) % len(batches)])
                        rows += r[0] if isinstance(r, tuple) else r
                    dt = time.perf_counter() - t0
                    faults[(v.name, op)] = faults.get((v.name, op), 0) + resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                    gc.enable()
                    counter += 1
                    if rep:
                        samples[(v.name, op)].append(rows / dt)
        bw = bandwidth(min(512 << 20, args.tables * args.rows * args.dim * 4), max(3, args.reps))

        med = {k: statistics.median(s) for k, s in samples.items() if s}
        if os.environ.get("BENCH_POOL_SAMPLES"):
            for k, v in samples.items():
                if v:
                    print(k, " ".join(f"{x / 1e6:.2f}" for x in v), f"| page faults/rep {faults[k] / (args.reps + 1):.0f}")

        def paired(name, op):
            """Median over reps of this variant's rate / the reference's rate in the same rep: the
            load of a shared machine comes in phases that hit every variant of a rep alike."""
            a, b = samples.get((name, op)), samples.get((variants[0].name, op))
            if not a or not b:
                return None
            return statistics.median(x / y for x, y in zip(a, b))

        row_bytes = args.dim * 4
        print()
        print(f"{'variant':<22} {'read Mrows/s':>13} {'write Mrows/s':>14} {'lookup Mrows/s':>15} "
              f"{'lookup vs EB':>13} {'read vs EB':>11} {'write vs EB':>12}  notes")
        def fmt(x):
            return f"{x / 1e6:.2f}" if x else "-"

        def ratio(x):
            return f"{x:.2f}x" if x else "-"

        for v in variants:
            r, w, l = (med.get((v.name, op)) for op in ops)
            notes = v.describe()
            if isinstance(v, PoolVariant) and any(t.cached for t in v.tables):
                h, m = v.stats()
                notes += f", hit rate {h / max(1, h + m):.0%}"
            print(f"{v.name:<22} {fmt(r):>13} {fmt(w):>14} {fmt(l):>15} {ratio(paired(v.name, 'lookup')):>13} "
                  f"{ratio(paired(v.name, 'read')):>11} {ratio(paired(v.name, 'write')):>12}  {notes}")
        print(f"{'memcpy ceiling':<22} {fmt(bw / 2 / row_bytes):>13} {'':>14} {'':>15} {'':>13} {'':>11} {'':>12}  "
              f"torch clone {bw / 2**30:.1f} GiB/s read+write = {bw / 2 / row_bytes / 1e6:.1f} M rows/s of {row_bytes} B")
        print("# Mrows/s: median ids per second (lookup: ids pooled; write: unique ids). 'vs EB': median over reps of "
              "the ratio to the nn.EmbeddingBag row measured in the same rep (its read/write: index_select/"
              "index_copy_ on the DRAM weight tensors). memcpy row: a 512 MiB torch.clone as rows of the same size "
              "copied per second; Zipf-hot rows sit in the CPU caches, so gathers can beat it.")
    finally:
        for v in variants:
            v.close()
        for p in sorted(root.iterdir()) if root.exists() else []:
            try:
                destroy_pool(p)
            except Exception:
                pass
        shutil.rmtree(root, ignore_errors=True)
        gc_shm_regions(under=root)  # shm regions of pools destroy_pool could not remove
    return 0


if __name__ == "__main__":
    sys.exit(main())
