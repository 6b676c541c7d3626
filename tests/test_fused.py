"""FusedEmbeddingBags: fbgemm's fused CPU TBE kernels over caller-owned (pool / mmap) memory.

* Numerics: equal to fbgemm's own ``SplitTableBatchedEmbeddingBagsCodegen`` (mixed dims, tables
  apart in the buffer) and to TorchRec's ``DistributedModelParallel`` FUSED end to end through
  ``torchrec_dlrm``, over several steps with duplicate ids and empty bags (EXACT_ROWWISE_ADAGRAD
  with eps 1e-8 and 1e-2, EXACT_SGD).
* In place, zero copy: weights and state are views of a file-backed shared mmap; after a step
  the file changed, in exactly the batch's rows.
* No table-sized allocation: dispatcher-level allocation log, and RSS on a 2M x 64 table.
* Determinism across runs and thread counts.
* Validation errors name the offending value.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from test_model import (  # noqa: F401  (process_group is a fixture)
    _AllocationLog,
    changed_rows,
    dmp_momentum,
    dmp_step,
    dmp_tables,
    fused_torchrec_dlrm,
    jagged_batch,
    plain,
    process_group,
    tiny_cfg,
)

from dlrm_cxl.fused import FusedEmbeddingBags, FusedTableSpec
from dlrm_cxl.model import torchrec_dlrm
from memory_pool import InvalidIdsError

PAGE = 1024  # floats in a 4 KiB page
GAP_W, GAP_M = 1234.5, -77.0  # what the gaps between tables hold; nothing may write there
OPTIMIZERS = [("rowwise_adagrad", 1e-8), ("rowwise_adagrad", 1e-2), ("sgd", 0.0)]
OPT_IDS = ["rowwise_adagrad_eps1e-8", "rowwise_adagrad_eps1e-2", "sgd"]


def _align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def layout(rows, dims, adagrad: bool, lead: int = 3) -> tuple[list[FusedTableSpec], int, int]:
    """Each table (and its state) starting on its own page, after ``lead`` spare floats: tables
    are never adjacent."""
    specs, w, m = [], lead, lead
    for r, d in zip(rows, dims):
        specs.append(FusedTableSpec(r, d, w, m if adagrad else None))
        w = _align(w + r * d) + lead
        m = _align(m + r) + lead
    return specs, w, m


def flat_tables(rows, dims, adagrad: bool, tables: list[torch.Tensor] | None = None, seed: int = 0):
    """(specs, weights, state): tables uniform (or ``tables``) in one flat tensor with gaps."""
    specs, nw, nm = layout(rows, dims, adagrad)
    weights = torch.full((nw,), GAP_W)
    state = torch.full((nm,), GAP_M) if adagrad else None
    g = torch.Generator().manual_seed(seed)
    for t, s in enumerate(specs):
        x = tables[t] if tables is not None else torch.empty(s.rows, s.dim).uniform_(-0.5, 0.5, generator=g)
        table_view(weights, s).copy_(x)
        if adagrad:
            state_view(state, s).zero_()
    return specs, weights, state


def table_view(weights: torch.Tensor, s: FusedTableSpec) -> torch.Tensor:
    return weights[s.weight_offset:s.weight_offset + s.rows * s.dim].view(s.rows, s.dim)


def state_view(state: torch.Tensor, s: FusedTableSpec) -> torch.Tensor:
    return state[s.state_offset:s.state_offset + s.rows]


def gap_mask(n: int, spans) -> torch.Tensor:
    mask = torch.ones(n, dtype=torch.bool)
    for start, length in spans:
        mask[start:start + length] = False
    return mask


def reference_tbe(specs, optimizer: str, lr: float, eps: float, weights: torch.Tensor):
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(s.rows, s.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for s in specs],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD if optimizer == "rowwise_adagrad" else EmbOptimType.EXACT_SGD,
        learning_rate=lr, eps=eps)
    for t, s in enumerate(specs):
        tbe.split_embedding_weights()[t].copy_(table_view(weights, s))
    return tbe


def kjt_batch(rows, seed: int, B: int = 32, max_len: int = 4, dup_range: int = 5):
    """(values, offsets) of a KJT: jagged bags with duplicates, empty bags and an all-empty table."""
    _, kjt, _ = jagged_batch(tiny_cfg(rows=rows, batch_size=B), seed, max_len=max_len, dup_range=dup_range)
    return kjt.values(), kjt.offsets()


# --------------------------------------------------------------------------- 1. numerics


@pytest.mark.parametrize("optimizer, eps", OPTIMIZERS, ids=OPT_IDS)
def test_steps_equal_fbgemm_tbe_with_mixed_dims_and_tables_apart(optimizer, eps):
    rows, dims = (40, 300, 7, 120, 250), (8, 4, 8, 16, 12)
    adagrad = optimizer == "rowwise_adagrad"
    lr = 0.05 if adagrad else 0.5
    specs, weights, state = flat_tables(rows, dims, adagrad)
    tbe = reference_tbe(specs, optimizer, lr, eps, weights)
    bags = FusedEmbeddingBags(specs, weights, optimizer=optimizer, lr=lr, eps=eps, state=state)
    w_gaps = gap_mask(weights.numel(), [(s.weight_offset, s.rows * s.dim) for s in specs])
    m_gaps = gap_mask(state.numel(), [(s.state_offset, s.rows) for s in specs]) if adagrad else None
    g = torch.Generator().manual_seed(1)
    out_diff = w_diff = m_diff = 0.0
    for step in range(4):
        values, offsets = kjt_batch(rows, 40 + step)
        upstream = torch.randn(32, sum(dims), generator=g)
        ours, want = bags(values, offsets), tbe(values, offsets)
        assert ours.shape == want.shape == (32, sum(dims)) and ours.dtype == torch.float32
        assert ours.requires_grad
        out_diff = max(out_diff, float((ours - want).detach().abs().max()))
        before = [table_view(weights, s).clone() for s in specs]
        (ours * upstream).sum().backward()
        (want * upstream).sum().backward()
        ref_w = tbe.split_embedding_weights()
        ref_m = tbe.split_optimizer_states() if adagrad else None
        for t, s in enumerate(specs):
            torch.testing.assert_close(table_view(weights, s), ref_w[t], atol=1e-6, rtol=0)
            w_diff = max(w_diff, float((table_view(weights, s) - ref_w[t]).abs().max()))
            if adagrad:
                torch.testing.assert_close(state_view(state, s), ref_m[t][0].reshape(-1), atol=1e-12, rtol=1e-6)
                m_diff = max(m_diff, float((state_view(state, s) - ref_m[t][0].reshape(-1)).abs().max()))
        moved = max(float((table_view(weights, s) - b).abs().max()) for s, b in zip(specs, before))
        assert moved > 1e-3  # the step did something measurable
        assert torch.equal(table_view(weights, specs[-1]), before[-1])  # only empty bags: untouched
        assert bool((weights[w_gaps] == GAP_W).all()), "a write landed between tables"
        if adagrad:
            assert bool((state[m_gaps] == GAP_M).all()), "a state write landed between tables"
    assert out_diff <= 1e-6
    print(f"{optimizer} eps={eps}: max |out - TBE| = {out_diff:.3g}, max |w - TBE| = {w_diff:.3g}"
          + (f", max |state - TBE momentum1| = {m_diff:.3g}" if adagrad else ""))


@pytest.mark.parametrize("optimizer, eps", OPTIMIZERS, ids=OPT_IDS)
def test_training_steps_equal_torchrec_dmp_fused_end_to_end(process_group, optimizer, eps):
    """TorchRec DLRM under DMP (TABLE_WISE, FUSED) vs the same DLRM's dense modules on top of
    FusedEmbeddingBags: same logits, and after each step the same tables and momentum."""
    adagrad = optimizer == "rowwise_adagrad"
    cfg = tiny_cfg(optimizer, lr=0.05 if adagrad else 2.0, eps=eps if adagrad else 1e-8)
    dmp = fused_torchrec_dlrm(cfg, process_group, seed=3)
    torch.manual_seed(99)
    ref = torchrec_dlrm(cfg)  # our dense modules: the DMP's weights
    ref.load_state_dict({k: plain(v) for k, v in dmp.state_dict().items()}, strict=True)
    start = dmp_tables(dmp, cfg)
    rows, F_, D = cfg.num_embeddings, len(cfg.feature_names), cfg.embedding_dim
    specs, weights, state = flat_tables(rows, [D] * F_, adagrad, tables=[start[f] for f in cfg.feature_names])
    bags = FusedEmbeddingBags(specs, weights, optimizer=optimizer, lr=cfg.embedding_optimizer.lr, eps=eps,
                              state=state)
    if adagrad:
        assert all(float(m.abs().max()) == 0 for m in dmp_momentum(dmp, cfg).values())
    logit_diff = w_diff = m_diff = 0.0
    for step in range(3):
        dense, kjt, labels = jagged_batch(cfg, 50 + step)
        before, ref_before = [table_view(weights, s).clone() for s in specs], dmp_tables(dmp, cfg)
        ref_logits = dmp_step(dmp, dense, kjt, labels)
        B = dense.shape[0]
        pooled = bags(kjt.values(), kjt.offsets()).view(B, F_, D)
        logits = ref.over_arch(ref.inter_arch(dense_features=ref.dense_arch(dense), sparse_features=pooled)).squeeze(-1)
        F.binary_cross_entropy_with_logits(logits, labels).backward()
        logit_diff = max(logit_diff, float((logits.detach() - ref_logits).abs().max()))
        torch.testing.assert_close(logits.detach(), ref_logits, atol=1e-6, rtol=0)
        ref_w = dmp_tables(dmp, cfg)
        ref_m = dmp_momentum(dmp, cfg) if adagrad else {}
        for f, s, b in zip(cfg.feature_names, specs, before):
            ours = table_view(weights, s)
            assert torch.equal(changed_rows(ours, b), changed_rows(ref_w[f], ref_before[f])), f
            torch.testing.assert_close(ours, ref_w[f], atol=1e-6, rtol=0)
            w_diff = max(w_diff, float((ours - ref_w[f]).abs().max()))
            if adagrad:
                torch.testing.assert_close(state_view(state, s), ref_m[f], atol=1e-12, rtol=1e-6)
                m_diff = max(m_diff, float((state_view(state, s) - ref_m[f]).abs().max()))
        assert max(float((table_view(weights, s) - b).abs().max()) for s, b in zip(specs, before)) > 1e-4
    print(f"DMP FUSED {optimizer} eps={eps}: max |logits| diff = {logit_diff:.3g}, max |w| diff = {w_diff:.3g}"
          + (f", max |momentum1| diff = {m_diff:.3g}" if adagrad else ""))


# --------------------------------------------------------------------------- 2. in place, zero copy


def test_backward_updates_the_mmapped_file_in_exactly_the_batch_rows(tmp_path):
    """Weights and state are two views of one file-backed shared mapping (as a pool lays them
    out). The file is written with plain file IO, trained through the mapping, and read back
    with plain file IO."""
    rows, dims = (2000, 3000, 7, 1500, 2500), (8, 8, 16, 8, 4)
    specs, nw, nm = layout(rows, dims, adagrad=True)
    g = torch.Generator().manual_seed(7)
    init = np.concatenate([np.full(nw, GAP_W, np.float32), np.full(nm, GAP_M, np.float32)])
    for s in specs:
        init[s.weight_offset:s.weight_offset + s.rows * s.dim] = torch.empty(s.rows * s.dim).uniform_(-1, 1, generator=g).numpy()
        init[nw + s.state_offset:nw + s.state_offset + s.rows] = torch.rand(s.rows, generator=g).numpy()
    path = tmp_path / "tables.bin"
    init.tofile(path)

    def read_file() -> tuple[np.ndarray, np.ndarray]:
        data = np.frombuffer(path.read_bytes(), dtype=np.float32)
        return data[:nw], data[nw:]

    mapped = torch.from_file(str(path), shared=True, size=nw + nm, dtype=torch.float32)
    weights, state = mapped[:nw], mapped[nw:]
    bags = FusedEmbeddingBags(specs, weights, optimizer="rowwise_adagrad", lr=0.1, state=state)
    assert bags.weights.data_ptr() == weights.data_ptr() and bags.state.data_ptr() == state.data_ptr()

    for step in range(2):
        w0, m0 = (torch.from_numpy(a.copy()) for a in read_file())
        values, offsets = kjt_batch(rows, 60 + step, B=16)
        out = bags(values, offsets)
        # The forward read the file's rows: table 0, bag 1 is the sum of the file's rows.
        lo, hi = int(offsets[1]), int(offsets[2])
        want = table_view(w0, specs[0])[values[lo:hi]].sum(0)
        torch.testing.assert_close(out[1, :dims[0]].detach(), want, atol=1e-6, rtol=0)
        upstream = torch.randn(out.shape, generator=g)
        (out * upstream).sum().backward()

        w1, m1 = (torch.from_numpy(a.copy()) for a in read_file())
        assert torch.equal(w1, weights) and torch.equal(m1, state)  # the file is the tensor
        assert not torch.equal(w1, w0) and not torch.equal(m1, m0)
        B = 16
        for t, s in enumerate(specs):
            ids = values[int(offsets[t * B]):int(offsets[(t + 1) * B])]
            in_batch = set(torch.unique(ids).tolist())
            changed_w = set(changed_rows(table_view(w1, s), table_view(w0, s)).tolist())
            changed_m = set(changed_rows(state_view(m1, s)[:, None], state_view(m0, s)[:, None]).tolist())
            assert changed_w <= in_batch and changed_m <= in_batch, f"table {t}: a row outside the batch changed"
            # Every batch row got a (non-zero) gradient, so every batch row moved.
            assert changed_w == in_batch and changed_m == in_batch, f"table {t}"
        w_gaps = gap_mask(nw, [(s.weight_offset, s.rows * s.dim) for s in specs])
        m_gaps = gap_mask(nm, [(s.state_offset, s.rows) for s in specs])
        assert torch.equal(w1[w_gaps], w0[w_gaps]) and torch.equal(m1[m_gaps], m0[m_gaps])
    del bags, weights, state, mapped


# --------------------------------------------------------------------------- 3. no table-sized allocation


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd"])
def test_forward_and_backward_create_no_tensor_the_size_of_a_table(optimizer):
    rows, dims = (20000, 30000, 7, 25000, 22000), (8, 8, 8, 8, 8)
    adagrad = optimizer == "rowwise_adagrad"
    specs, weights, state = flat_tables(rows, dims, adagrad)
    bags = FusedEmbeddingBags(specs, weights, optimizer=optimizer, lr=0.1, state=state)
    values, offsets = kjt_batch(rows, 0, B=16, dup_range=1000)
    upstream = torch.randn(16, sum(dims))
    log = _AllocationLog()
    seen = []

    class Seen(_AllocationLog):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return log.__torch_dispatch__(func, types, args, kwargs)

    before = table_view(weights, specs[0]).clone()
    with Seen():
        (bags(values, offsets) * upstream).sum().backward()
    assert not torch.equal(table_view(weights, specs[0]), before)  # it did train
    # The mode saw fbgemm's forward and fused backward kernels themselves.
    assert any("split_embedding_codegen_forward" in op for op in seen), seen
    assert any("split_embedding_backward_codegen" in op for op in seen), seen
    largest, op = log.largest
    smallest_big_table = 20000 * 8
    assert largest < smallest_big_table // 50, f"{op} created a tensor of {largest} elements"
    print(f"{optimizer}: largest new tensor {largest} elements ({op}); a table has >= {smallest_big_table}")


def test_rss_does_not_grow_by_a_table_on_a_2m_row_table(tmp_path, run_py):
    """fbgemm allocates in C++ where no dispatch mode sees it, so measure the process: a 2M x 64
    table (512 MiB) in a sparse file; after a warm-up step the peak RSS is reset, then 5 steps
    must not grow anonymous memory or the peak by anything near a table."""
    out = run_py(r"""
        import os, sys, warnings
        warnings.filterwarnings("ignore")
        import torch
        from dlrm_cxl.fused import FusedEmbeddingBags, FusedTableSpec

        def status():
            kv = dict(line.split(":", 1) for line in open("/proc/self/status"))
            return {k: int(kv[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}

        R, D, B = 2_000_000, 64, 16
        d = sys.argv[1]
        for name, n in (("w", R * D), ("m", R)):
            with open(os.path.join(d, name), "wb") as f:
                f.truncate(n * 4)
        w = torch.from_file(os.path.join(d, "w"), shared=True, size=R * D, dtype=torch.float32)
        m = torch.from_file(os.path.join(d, "m"), shared=True, size=R, dtype=torch.float32)
        bags = FusedEmbeddingBags([FusedTableSpec(R, D, 0, 0)], w, optimizer="rowwise_adagrad", lr=0.1, state=m)
        g = torch.Generator().manual_seed(0)

        def step():
            idx = torch.randint(0, R, (B * 3,), generator=g)
            out = bags(idx, torch.arange(0, B * 3 + 1, 3))
            (out * torch.randn(out.shape, generator=g)).sum().backward()

        step()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        s0 = status()
        for _ in range(5):
            step()
        s1 = status()
        print(s0["VmRSS"], s1["VmHWM"] - s0["VmRSS"], s1["RssAnon"] - s0["RssAnon"], s1["RssFile"] - s0["RssFile"],
              int((w != 0).any()))
    """, tmp_path).stdout.split()
    base, peak_growth, anon_growth, file_growth, trained = map(int, out)
    table_bytes = 2_000_000 * 64 * 4
    print(f"2M x 64 table ({table_bytes >> 20} MiB): RSS {base >> 20} MiB, over 5 steps peak +{peak_growth >> 10} KiB, "
          f"anon +{anon_growth >> 10} KiB, file-backed +{file_growth >> 10} KiB (the batch's pages)")
    assert trained == 1
    assert anon_growth < table_bytes // 50, anon_growth
    assert peak_growth < table_bytes // 10, peak_growth


# --------------------------------------------------------------------------- 4. determinism


def _train(optimizer: str, threads: int, steps: int = 3):
    rows, dims = (5000, 300, 7, 2000, 64), (16, 16, 8, 32, 16)
    adagrad = optimizer == "rowwise_adagrad"
    specs, weights, state = flat_tables(rows, dims, adagrad, seed=5)
    bags = FusedEmbeddingBags(specs, weights, optimizer=optimizer, lr=0.05, state=state)
    g = torch.Generator().manual_seed(9)
    outs = []
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(steps):
            # Large bags of few distinct ids: many duplicates per row, split across threads.
            values, offsets = kjt_batch(rows, 70 + step, B=512, max_len=8, dup_range=20)
            out = bags(values, offsets)
            (out * torch.randn(out.shape, generator=g)).sum().backward()
            outs.append(out.detach())
    finally:
        torch.set_num_threads(old)
    return outs, weights, state


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd"])
def test_steps_are_bitwise_deterministic_across_runs_and_thread_counts(optimizer):
    a = _train(optimizer, threads=2)
    b = _train(optimizer, threads=2)
    c = _train(optimizer, threads=1)
    for other, what in ((b, "a second run"), (c, "1 thread vs 2")):
        assert all(torch.equal(x, y) for x, y in zip(a[0], other[0])), f"outputs differ: {what}"
        assert torch.equal(a[1], other[1]), f"weights differ: {what}"
        if optimizer == "rowwise_adagrad":
            assert torch.equal(a[2], other[2]), f"state differs: {what}"
    assert torch.get_num_threads() >= 1


# --------------------------------------------------------------------------- 5. validation


def _good(**change):
    specs, weights, state = flat_tables((40, 300, 7), (8, 4, 8), adagrad=True)
    kw = dict(specs=specs, weights=weights, optimizer="rowwise_adagrad", lr=0.1, eps=1e-8, state=state)
    kw.update(change)
    return kw


def _spec(i: int, **change):
    specs = list(_good()["specs"])
    specs[i] = dataclasses.replace(specs[i], **change)
    return specs


BAD_ARGS = [
    ("optimizer", dict(optimizer="adam"), r"optimizer.*'adam'"),
    ("lr_zero", dict(lr=0.0), r"lr.*got 0\.0"),
    ("lr_nan", dict(lr=float("nan")), r"lr.*nan"),
    ("eps_negative", dict(eps=-1e-8), r"eps.*-1e-08"),
    ("no_tables", dict(specs=[]), r"at least one table"),
    ("weights_dtype", dict(weights=torch.zeros(5000, dtype=torch.float64)), r"weights.*float32.*float64"),
    ("weights_2d", dict(weights=torch.zeros(50, 100)), r"weights.*1-D.*\(50, 100\)"),
    ("weights_strided", dict(weights=torch.zeros(20000)[::2]), r"weights.*contiguous.*\(2,\)"),
    ("weights_not_tensor", dict(weights=[0.0] * 10), r"weights.*list"),
    ("rows_zero", dict(specs=_spec(1, rows=0)), r"table 1: rows.*got 0"),
    ("rows_past_int32", dict(specs=_spec(1, rows=2**31)), r"table 1: rows.*int32.*got 2147483648"),
    ("dim_negative", dict(specs=_spec(2, dim=-4)), r"table 2: dim.*got -4"),
    ("weight_offset_negative", dict(specs=_spec(0, weight_offset=-1)), r"table 0: weight_offset.*got -1"),
    ("weight_offset_float", dict(specs=_spec(0, weight_offset=3.0)), r"table 0: weight_offset.*got 3\.0"),
    ("table_past_the_end", dict(specs=_spec(2, weight_offset=10**6)), r"table 2.*\[1000000, 1000056\).*outside weights"),
    ("tables_overlap", dict(specs=_spec(1, weight_offset=3 + 40 * 8 - 1)), r"tables 0 and 1 overlap in weights"),
    ("state_missing", dict(state=None), r"state=None"),
    ("state_offset_missing", dict(specs=_spec(1, state_offset=None)), r"table 1.*state_offset.*None"),
    ("state_past_the_end", dict(state=torch.zeros(100)), r"table 1: rows \[1027, 1327\) lies outside state of 100 elements"),
    ("state_dtype", dict(state=torch.zeros(5000, dtype=torch.float16)), r"state.*float16"),
    ("sgd_with_state", dict(optimizer="sgd"), r"sgd.*state"),
]


@pytest.mark.parametrize("change, message", [b[1:] for b in BAD_ARGS], ids=[b[0] for b in BAD_ARGS])
def test_bad_arguments_raise_value_error_naming_the_value(change, message):
    kw = _good(**change)
    with pytest.raises(ValueError, match=message):
        FusedEmbeddingBags(kw.pop("specs"), kw.pop("weights"), **kw)


def test_sgd_rejects_a_state_offset_and_state_shared_with_weights_must_not_overlap():
    specs, weights, _ = flat_tables((40, 300), (8, 4), adagrad=False)
    with pytest.raises(ValueError, match=r"table 0.*state_offset.*got 5"):
        FusedEmbeddingBags([FusedTableSpec(40, 8, specs[0].weight_offset, 5), specs[1]], weights,
                           optimizer="sgd", lr=0.1)
    # Weights and state may share one storage (one pool mapping), but not overlap in it.
    specs, weights, _ = flat_tables((40, 300), (8, 4), adagrad=True)
    with pytest.raises(ValueError, match=r"table 0's state \[3, 43\) overlaps table 0's rows \[3, 323\)"):
        FusedEmbeddingBags(specs, weights, optimizer="rowwise_adagrad", lr=0.1, state=weights)


BAD_INPUTS = [
    ("id_past_its_table", lambda v, o: (v.index_fill(0, torch.tensor([int(o[2 * 4])]), 7), o),
     InvalidIdsError, r"table 2: id 7 out of range \[0, 7\)"),
    ("negative_id", lambda v, o: (v.index_fill(0, torch.tensor([0]), -3), o), InvalidIdsError,
     r"table 0: id -3 out of range"),
    ("float_ids", lambda v, o: (v.float(), o), InvalidIdsError, r"indices.*float32"),
    ("float_offsets", lambda v, o: (v, o.double()), InvalidIdsError, r"offsets.*float64"),
    ("offsets_length", lambda v, o: (v, o[:-1]), ValueError, r"T\*B\+1.*T=3.*got 12"),
    ("offsets_end", lambda v, o: (v[:-1], o), ValueError, r"offsets must run from 0 to len\(indices\)=\d+, got 0 \.\. \d+"),
    ("offsets_decreasing", lambda v, o: (v, o.index_fill(0, torch.tensor([3]), 0)), ValueError, r"non-decreasing"),
    ("indices_2d", lambda v, o: (v.view(1, -1), o), ValueError, r"indices.*1-D.*\(1, \d+\)"),
]


@pytest.mark.parametrize("bad, error, message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_batch_raises_naming_the_value_and_changes_nothing(bad, error, message):
    kw = _good()
    bags = FusedEmbeddingBags(kw.pop("specs"), kw.pop("weights"), **kw)
    before_w, before_m = bags.weights.clone(), bags.state.clone()
    B, rows = 4, (40, 300, 7)
    lengths = torch.tensor([2, 0, 1, 3, 1, 1, 0, 2, 1, 2, 1, 1])
    values = torch.cat([torch.tensor([1, 2, 3, 1, 39, 0]), torch.tensor([5, 5, 7, 299]), torch.tensor([0, 6, 6, 1, 2])])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    assert values.numel() == int(offsets[-1]) and all(int(values[int(offsets[t * B]):int(offsets[(t + 1) * B])].max()) < r
                                                      for t, r in enumerate(rows))
    bags(values, offsets).sum().backward()  # the good batch is fine
    before_w, before_m = bags.weights.clone(), bags.state.clone()
    v, o = bad(values.clone(), offsets.clone())
    with pytest.raises(error, match=message):
        bags(v, o)
    assert torch.equal(bags.weights, before_w) and torch.equal(bags.state, before_m)


def test_int32_kjt_offsets_and_no_grad_forward_are_accepted():
    rows, dims = (40, 300, 7, 120, 250), (8,) * 5
    specs, weights, state = flat_tables(rows, dims, adagrad=True)
    bags = FusedEmbeddingBags(specs, weights, optimizer="rowwise_adagrad", lr=0.1, state=state)
    values, offsets = kjt_batch(rows, 3)
    before = weights.clone()
    with torch.no_grad():
        a = bags(values, offsets.to(torch.int32))
    b = bags(values.to(torch.int32), offsets.to(torch.int64))
    assert torch.equal(a, b.detach()) and not a.requires_grad and b.requires_grad
    assert torch.equal(weights, before)  # a forward alone never writes
    assert repr(bags).startswith("FusedEmbeddingBags(5 tables, dims=(8, 8, 8, 8, 8), optimizer='rowwise_adagrad'")


def test_tables_named_in_the_error_are_numbered_in_spec_order():
    # A bad id in the last non-empty table is attributed to that table, not a neighbour.
    rows = (40, 300, 7, 120, 250)
    specs, weights, state = flat_tables(rows, (8,) * 5, adagrad=True)
    bags = FusedEmbeddingBags(specs, weights, optimizer="rowwise_adagrad", lr=0.1, state=state)
    values, offsets = kjt_batch(rows, 4)
    B = 32
    lo = int(offsets[3 * B])
    values[lo] = 120
    with pytest.raises(InvalidIdsError, match=re.escape("table 3: id 120 out of range [0, 120)")):
        bags(values, offsets)
