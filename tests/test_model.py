"""PoolDLRM and SparseOptimizer against TorchRec and fbgemm.

* Forward: logits equal ``torchrec.models.dlrm.DLRM`` with the same weights (import and export).
* One training step: the embedding update equals fbgemm's FUSED CPU kernels
  (``EXACT_ROWWISE_ADAGRAD``, ``EXACT_SGD``) as TorchRec runs them: the reference is a real
  ``DistributedModelParallel`` (world size 1, gloo) with TABLE_WISE sharding and the FUSED compute
  kernel, i.e. fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` on the host. Dense gradients
  equal TorchRec's.
* The backward touches exactly the rows of the batch and never builds a table-sized tensor.
* ``plan()`` validation, ModelConfig validation, presets, to_dict/from_dict.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_cxl.data import make_batch
from dlrm_cxl.model import (
    KAGGLE_CARDINALITIES,
    PRESETS,
    EmbeddingOptimizerConfig,
    ModelConfig,
    PoolDLRM,
    SparseOptimizer,
    state_table_name,
    torchrec_dlrm,
    validate_model_config,
)
from memory_pool import InvalidIdsError, MemoryPool

FEATURES = ("f0", "f1", "f2", "f3", "f4")
ROWS = (40, 300, 7, 120, 250)
DIM = 8
NUM_DENSE = 5
EBC = "sparse_arch.embedding_bag_collection.embedding_bags"


def tiny_cfg(kind: str = "rowwise_adagrad", lr: float = 0.1, eps: float = 1e-8, rows=ROWS, batch_size: int = 32,
             **kw) -> ModelConfig:
    return ModelConfig(FEATURES, tuple(rows), DIM, num_dense=NUM_DENSE, bottom_mlp=(16, DIM), top_mlp=(16, 1),
                       batch_size=batch_size, dense_optimizer="sgd", dense_lr=0.01,
                       embedding_optimizer=EmbeddingOptimizerConfig(kind, lr, eps), **kw)


def make_pool(path, cfg: ModelConfig, tier: str = "dram", init: str = "uniform", **kw) -> MemoryPool:
    pool = MemoryPool.create(path, tier=tier, **kw)
    for f, (name, n) in enumerate(zip(cfg.feature_names, cfg.num_embeddings)):
        pool.create_table(name, n, cfg.embedding_dim, init=init, seed=f)
    SparseOptimizer.create_state_tables(pool, cfg.embedding_optimizer, cfg)
    return pool


def jagged_batch(cfg: ModelConfig, seed: int, B: int | None = None, max_len: int = 4, dup_range: int = 5):
    """Dense [B, num_dense], a KJT of bags of 0..max_len-1 ids (empty bags included), labels [B].

    Odd features draw ids from only ``dup_range`` rows, so ids repeat within and across bags;
    the last feature has nothing but empty bags."""
    B = B or cfg.batch_size
    g = torch.Generator().manual_seed(seed)
    F_ = len(cfg.feature_names)
    lengths = torch.randint(0, max_len, (F_ * B,), generator=g)
    lengths[0] = 0                       # an empty first bag
    lengths[B - 1] = 0                   # and an empty last bag
    lengths[(F_ - 1) * B:] = 0           # a feature whose bags are all empty
    vals = []
    for f, n in enumerate(cfg.num_embeddings):
        k = int(lengths[f * B:(f + 1) * B].sum())
        hi = min(n, dup_range) if f % 2 else n
        vals.append(torch.randint(0, hi, (k,), generator=g))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(cfg.feature_names), values=torch.cat(vals),
                                              lengths=lengths.to(torch.int32))
    dense = torch.randn(B, cfg.num_dense, generator=g)
    labels = torch.randint(0, 2, (B,), generator=g).float()
    return dense, kjt, labels


def single_id_batch(cfg: ModelConfig, seed: int, B: int | None = None):
    """One id per sample and feature, as the data pipeline's make_batch lays it out."""
    B = B or cfg.batch_size
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, n, B) for n in cfg.num_embeddings], axis=1)
    b = make_batch(rng.standard_normal((B, cfg.num_dense)).astype(np.float32), ids,
                   rng.integers(0, 2, B).astype(np.float32), cfg.feature_names)
    return b.dense, b.sparse, b.labels


def tables_of(pool: MemoryPool) -> dict[str, torch.Tensor]:
    return {name: pool.table(name).view().clone() for name in pool.tables()}


def plain(v) -> torch.Tensor:
    """A full tensor from a state_dict value (a ShardedTensor of one shard under DMP)."""
    if hasattr(v, "local_shards"):
        shards = v.local_shards()
        assert len(shards) == 1 and tuple(shards[0].tensor.shape) == tuple(v.size())
        return shards[0].tensor.detach().clone()
    return v.detach().clone()


def pool_step(model: PoolDLRM, opt: SparseOptimizer, dense, kjt, labels):
    model.zero_grad(set_to_none=True)
    plan = model.plan(kjt)
    logits, pooled = model(dense, plan)
    loss = F.binary_cross_entropy_with_logits(logits, labels)
    loss.backward()
    updates = opt.compute(plan, pooled.grad)
    opt.apply(updates)
    return logits.detach(), pooled, plan


# --------------------------------------------------------------------------- 1. forward


def test_forward_equals_torchrec_dlrm_on_jagged_bags(tmp_pool_dir):
    cfg = tiny_cfg()
    torch.manual_seed(0)
    ref = torchrec_dlrm(cfg).eval()
    pool = make_pool(tmp_pool_dir, cfg, tier="pmem", init="zeros")
    model = PoolDLRM(cfg, pool)
    model.import_torchrec(ref.state_dict())
    for f in cfg.feature_names:
        assert torch.equal(pool.table(f).view(), ref.state_dict()[f"{EBC}.{f}.weight"])
    batches = [jagged_batch(cfg, s) for s in range(3)] + [single_id_batch(cfg, 7), jagged_batch(cfg, 9, B=1)]
    worst = 0.0
    for dense, kjt, _ in batches:
        with torch.no_grad():
            want = ref(dense, kjt).squeeze(-1)
            got, _ = model(dense, model.plan(kjt))
        assert got.shape == want.shape == (dense.shape[0],)
        worst = max(worst, float((got - want).abs().max()))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # The batches do exercise multi-id bags, empty bags and an all-empty feature.
    lengths = batches[0][1].lengths()
    assert int(lengths.max()) > 1 and int((lengths == 0).sum()) > cfg.batch_size
    print(f"forward max |pool - torchrec| = {worst:.3g}")
    pool.close()


def test_export_torchrec_loads_strict_into_fresh_torchrec_dlrm(tmp_pool_dir):
    cfg = tiny_cfg()
    pool = make_pool(tmp_pool_dir, cfg, tier="pmem")  # tables: the pool's own uniform init
    torch.manual_seed(1)
    model = PoolDLRM(cfg, pool)
    state = model.export_torchrec()
    torch.manual_seed(2)
    fresh = torchrec_dlrm(cfg).eval()
    assert set(state) == set(fresh.state_dict())
    result = fresh.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for f in cfg.feature_names:
        assert torch.equal(fresh.state_dict()[f"{EBC}.{f}.weight"], pool.table(f).view())
    for dense, kjt, _ in (jagged_batch(cfg, 3), single_id_batch(cfg, 4)):
        with torch.no_grad():
            torch.testing.assert_close(model(dense, model.plan(kjt))[0], fresh(dense, kjt).squeeze(-1),
                                       atol=1e-5, rtol=0)
    # The export is a copy: changing it does not change the pool.
    before = pool.table("f0").view().clone()
    state[f"{EBC}.f0.weight"].add_(1.0)
    assert torch.equal(pool.table("f0").view(), before)
    pool.close()


def test_import_torchrec_into_cached_tables_serves_the_imported_rows(tmp_pool_dir):
    """Tables served through a DRAM row cache must not keep serving rows cached before the import."""
    cfg = tiny_cfg()
    # f0 (1280 bytes) is served from DRAM, f1 gets a 50-row cache, the rest none.
    pool = make_pool(tmp_pool_dir, cfg, tier="pmem", dram_cache_bytes=40 * 32 + 300 * 4 + 50 * (32 + 16))
    assert pool.table("f1").cached
    model = PoolDLRM(cfg, pool)
    dense, kjt, _ = jagged_batch(cfg, 5)
    with torch.no_grad():
        model(dense, model.plan(kjt))  # fill the caches with the old rows
        torch.manual_seed(3)
        ref = torchrec_dlrm(cfg).eval()
        model.import_torchrec(ref.state_dict())
        torch.testing.assert_close(model(dense, model.plan(kjt))[0], ref(dense, kjt).squeeze(-1), atol=1e-5, rtol=0)
    pool.close()


def test_import_torchrec_with_a_wrong_table_shape_changes_nothing(tmp_pool_dir):
    cfg = tiny_cfg()
    pool = make_pool(tmp_pool_dir, cfg)
    model = PoolDLRM(cfg, pool)
    dense_before = {k: v.clone() for k, v in model.state_dict().items()}
    tables_before = tables_of(pool)
    state = torchrec_dlrm(cfg).state_dict()
    state[f"{EBC}.f3.weight"] = torch.zeros(ROWS[3] + 1, DIM)
    with pytest.raises(ValueError, match="f3"):
        model.import_torchrec(state)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in dense_before.items())
    assert all(torch.equal(v, pool.table(k).view()) for k, v in tables_before.items())
    pool.close()


# --------------------------------------------------------------------------- 2. vs fbgemm fused kernels


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A 1-process gloo group (file store) for TorchRec's DistributedModelParallel."""
    import torch.distributed as dist

    created = False
    assert not (dist.is_initialized() and dist.get_world_size() != 1), \
        "another test left a process group of more than one rank initialised in this process"
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        created = True
    yield dist.GroupMember.WORLD
    if created:
        dist.destroy_process_group()


def fused_torchrec_dlrm(cfg: ModelConfig, process_group, seed: int = 0):
    """TorchRec's DLRM under DMP, every table TABLE_WISE on the FUSED kernel with the embedding
    optimizer of ``cfg`` (fbgemm SplitTableBatchedEmbeddingBagsCodegen, host memory, CPU)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType

    eo = cfg.embedding_optimizer
    optim = {"rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "sgd": EmbOptimType.EXACT_SGD}[eo.kind]
    fused = {"optimizer": optim, "learning_rate": eo.lr}
    if eo.kind == "rowwise_adagrad":
        fused["eps"] = eo.eps
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    constraints = {f: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value],
                                           compute_kernels=[EmbeddingComputeKernel.FUSED.value])
                   for f in cfg.feature_names}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints)
    torch.manual_seed(seed)
    base = torchrec_dlrm(cfg)
    plan = planner.collective_plan(base, [sharder], process_group)
    dmp = DistributedModelParallel(base, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    # It is what we asked for: fused fbgemm TBEs on the host with the wanted optimizer.
    # (ShardedEmbeddingBagCollection hides its lookups from named_modules(), so walk them.)
    ebc = dmp.module.sparse_arch.embedding_bag_collection
    tbes = [em._emb_module for lookup in ebc._lookups for em in lookup._emb_modules]
    assert all(isinstance(t, SplitTableBatchedEmbeddingBagsCodegen) for t in tbes)
    assert tbes and all(t.optimizer == optim for t in tbes)
    for sharding in plan.plan.values():
        for p in sharding.values():
            assert p.sharding_type == ShardingType.TABLE_WISE.value
            assert p.compute_kernel == EmbeddingComputeKernel.FUSED.value
    return dmp


def pool_model_from(dmp, cfg: ModelConfig, path, tier: str = "pmem"):
    state = {k: plain(v) for k, v in dmp.state_dict().items()}
    pool = make_pool(path, cfg, tier=tier, init="zeros")
    model = PoolDLRM(cfg, pool)
    model.import_torchrec(state)
    return pool, model, SparseOptimizer(cfg.embedding_optimizer, pool, model.tables)


def dmp_tables(dmp, cfg) -> dict[str, torch.Tensor]:
    sd = dmp.state_dict()
    return {f: plain(sd[f"{EBC}.{f}.weight"]) for f in cfg.feature_names}


def dmp_momentum(dmp, cfg) -> dict[str, torch.Tensor]:
    st = dmp.fused_optimizer.state_dict()["state"]
    return {f: plain(st[f"{EBC}.{f}.weight"][f"{f}.momentum1"]).reshape(-1) for f in cfg.feature_names}


def dmp_step(dmp, dense, kjt, labels):
    for p in dmp.parameters():
        p.grad = None
    logits = dmp(dense, kjt).squeeze(-1)
    F.binary_cross_entropy_with_logits(logits, labels).backward()
    return logits.detach()


def changed_rows(after: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    return (after != before).reshape(after.shape[0], -1).any(dim=1).nonzero().flatten()


@pytest.mark.parametrize("eps", [1e-8, 1e-2])
def test_rowwise_adagrad_steps_match_fbgemm_fused_exact_rowwise_adagrad(process_group, tmp_pool_dir, eps):
    """Two steps (so the accumulator is reused) with duplicates and empty bags; eps=1e-2 is of the
    order of sqrt(mean(g^2)), so where eps goes matters."""
    cfg = tiny_cfg("rowwise_adagrad", lr=0.05, eps=eps)
    dmp = fused_torchrec_dlrm(cfg, process_group)
    pool, model, opt = pool_model_from(dmp, cfg, tmp_pool_dir)
    w_diff = m_diff = 0.0
    for step in range(2):
        dense, kjt, labels = jagged_batch(cfg, 10 + step)
        before = tables_of(pool)
        ref_before_w, ref_before_m = dmp_tables(dmp, cfg), dmp_momentum(dmp, cfg)
        ref_logits = dmp_step(dmp, dense, kjt, labels)
        logits, pooled, plan = pool_step(model, opt, dense, kjt, labels)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
        # Same upstream gradient: the dense gradients agree (DDP over one rank averages over 1).
        dense_ref = {n.removeprefix("_dmp_wrapped_module.module."): p.grad for n, p in dmp.named_parameters()
                     if not n.removeprefix("_dmp_wrapped_module.module.").startswith("sparse_arch.")}
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, dense_ref[n], atol=1e-6, rtol=1e-5)
        ref_w, ref_m = dmp_tables(dmp, cfg), dmp_momentum(dmp, cfg)
        moved = 0.0
        for f, rows in zip(cfg.feature_names, plan.rows):
            ours = pool.table(f).view()
            m = pool.table(state_table_name(f)).view().reshape(-1)
            # Each against its own previous state: after step 0 the two differ by float rounding.
            assert torch.equal(changed_rows(ref_w[f], ref_before_w[f]), changed_rows(ours, before[f])), f
            assert torch.equal(changed_rows(ref_m[f], ref_before_m[f]),
                               changed_rows(m, before[state_table_name(f)].reshape(-1))), f
            torch.testing.assert_close(ours, ref_w[f], atol=1e-6, rtol=0)
            torch.testing.assert_close(m, ref_m[f], atol=1e-12, rtol=1e-5)
            w_diff = max(w_diff, float((ours - ref_w[f]).abs().max()))
            m_diff = max(m_diff, float((m - ref_m[f]).abs().max()))
            if rows.numel():
                moved = max(moved, float((ours - before[f]).abs().max()))
        assert moved > 1e-3  # the step did something measurable
    print(f"rowwise adagrad eps={eps}: max |w - fbgemm| = {w_diff:.3g}, max |m - fbgemm momentum1| = {m_diff:.3g}")
    pool.close()


def test_sgd_step_matches_fbgemm_exact_sgd_and_torch_sgd(process_group, tmp_pool_dir):
    cfg = tiny_cfg("sgd", lr=0.5)
    dmp = fused_torchrec_dlrm(cfg, process_group, seed=4)
    pool, model, opt = pool_model_from(dmp, cfg, tmp_pool_dir)
    assert opt.state_tables == [None] * len(FEATURES) and not any(".adagrad" in t for t in pool.tables())
    # Torch reference: TorchRec's plain DLRM (nn.EmbeddingBag tables, dense gradients) + torch.optim.SGD.
    torch.manual_seed(99)
    ref = torchrec_dlrm(cfg)
    ref.load_state_dict({k: plain(v) for k, v in dmp.state_dict().items()}, strict=True)
    sgd = torch.optim.SGD([p for n, p in ref.named_parameters() if n.startswith("sparse_arch.")], lr=cfg.embedding_optimizer.lr)
    diff_fbgemm = diff_torch = 0.0
    for step in range(2):
        dense, kjt, labels = jagged_batch(cfg, 20 + step)
        before, ref_before = tables_of(pool), dmp_tables(dmp, cfg)
        dmp_step(dmp, dense, kjt, labels)
        pool_step(model, opt, dense, kjt, labels)
        ref.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(ref(dense, kjt).squeeze(-1), labels).backward()
        sgd.step()
        ref_w = dmp_tables(dmp, cfg)
        for f in cfg.feature_names:
            ours = pool.table(f).view()
            torch_w = ref.state_dict()[f"{EBC}.{f}.weight"]
            assert torch.equal(changed_rows(ref_w[f], ref_before[f]), changed_rows(ours, before[f])), f
            torch.testing.assert_close(ours, ref_w[f], atol=1e-6, rtol=0)
            torch.testing.assert_close(ours, torch_w, atol=1e-6, rtol=0)
            diff_fbgemm = max(diff_fbgemm, float((ours - ref_w[f]).abs().max()))
            diff_torch = max(diff_torch, float((ours - torch_w).abs().max()))
        assert max(float((pool.table(f).view() - before[f]).abs().max()) for f in FEATURES) > 1e-3
    print(f"sgd: max |w - fbgemm EXACT_SGD| = {diff_fbgemm:.3g}, max |w - torch SGD| = {diff_torch:.3g}")
    pool.close()


def test_duplicate_ids_are_summed_before_the_rowwise_update(process_group, tmp_pool_dir):
    """Row 3 of f1 occurs twice in bag 0, once in bag 1 and once in bag 2: its update is one
    Adagrad step on the summed gradient (as fbgemm does), not three or four steps."""
    cfg = tiny_cfg("rowwise_adagrad", lr=0.05, eps=1e-8)
    B = 4
    per_feature = {
        "f0": [[1], [2], [1], []],
        "f1": [[3, 3], [3, 5], [3], [6]],
        "f2": [[0, 1, 2], [], [2], [2, 2]],
        "f3": [[7], [8], [9], [7]],
        "f4": [[], [], [], []],
    }
    lengths = torch.tensor([len(b) for f in FEATURES for b in per_feature[f]], dtype=torch.int32)
    values = torch.tensor([i for f in FEATURES for b in per_feature[f] for i in b], dtype=torch.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(FEATURES), values=values, lengths=lengths)
    g = torch.Generator().manual_seed(5)
    dense, labels = torch.randn(B, NUM_DENSE, generator=g), torch.tensor([1.0, 0.0, 1.0, 0.0])

    dmp = fused_torchrec_dlrm(cfg, process_group, seed=6)
    pool, model, opt = pool_model_from(dmp, cfg, tmp_pool_dir)
    before = tables_of(pool)
    dmp_step(dmp, dense, kjt, labels)
    _, pooled, _ = pool_step(model, opt, dense, kjt, labels)
    ref_w, ref_m = dmp_tables(dmp, cfg), dmp_momentum(dmp, cfg)

    # By hand, from the pooled gradient: G = sum over occurrences of the bag's gradient.
    gp = pooled.grad[:, FEATURES.index("f1"), :]
    G = 2 * gp[0] + gp[1] + gp[2]
    m = float(G.square().mean())
    want = before["f1"][3] - cfg.embedding_optimizer.lr * G / (math.sqrt(m) + cfg.embedding_optimizer.eps)
    torch.testing.assert_close(pool.table("f1").view()[3], want, atol=1e-6, rtol=0)
    torch.testing.assert_close(pool.table(state_table_name("f1")).view()[3, 0], torch.tensor(m), atol=1e-12, rtol=1e-5)
    for f in FEATURES:
        torch.testing.assert_close(pool.table(f).view(), ref_w[f], atol=1e-6, rtol=0)
        torch.testing.assert_close(pool.table(state_table_name(f)).view().reshape(-1), ref_m[f], atol=1e-12, rtol=1e-5)
    assert torch.equal(changed_rows(pool.table("f1").view(), before["f1"]), torch.tensor([3, 5, 6]))
    assert torch.equal(pool.table("f4").view(), before["f4"])  # only empty bags: untouched
    pool.close()


# --------------------------------------------------------------------------- 4. dense gradients


@pytest.mark.parametrize("batch", ["jagged", "single_id"])
def test_dense_and_row_gradients_equal_torchrec_dlrm_gradients(tmp_pool_dir, batch):
    """Same weights, same loss: every dense parameter's .grad equals TorchRec's, and the per-row
    gradient our optimizer applies (pooled.grad summed per row) equals the row of TorchRec's
    table gradient, which is zero outside the batch."""
    cfg = tiny_cfg("sgd", lr=1.0)
    torch.manual_seed(11)
    ref = torchrec_dlrm(cfg)
    pool = make_pool(tmp_pool_dir, cfg, init="zeros")
    model = PoolDLRM(cfg, pool)
    model.import_torchrec(ref.state_dict())
    dense, kjt, labels = jagged_batch(cfg, 30) if batch == "jagged" else single_id_batch(cfg, 30)
    F.binary_cross_entropy_with_logits(ref(dense, kjt).squeeze(-1), labels).backward()
    before = tables_of(pool)
    model.zero_grad(set_to_none=True)
    plan = model.plan(kjt)
    logits, pooled = model(dense, plan)
    F.binary_cross_entropy_with_logits(logits, labels).backward()
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        assert p.grad is not None and want is not None and float(want.abs().max()) > 0, name
        torch.testing.assert_close(p.grad, want, atol=1e-7, rtol=1e-5)
        worst = max(worst, float((p.grad - want).abs().max()))
    # Row gradients: with SGD at lr=1 the update is exactly -row_grad.
    SparseOptimizer.apply(SparseOptimizer(cfg.embedding_optimizer, pool, model.tables).compute(plan, pooled.grad))
    for f in cfg.feature_names:
        table_grad = ref_params[f"{EBC}.{f}.weight"].grad
        torch.testing.assert_close(before[f] - pool.table(f).view(), table_grad, atol=1e-7, rtol=1e-5)
    print(f"dense grads ({batch}): max |pool - torchrec| = {worst:.3g}")
    pool.close()


# --------------------------------------------------------------------------- 3. touched rows only


class _AllocationLog(TorchDispatchMode):
    """Records the largest tensor any op creates (in-place ops and views of inputs excluded)."""

    def __init__(self):
        super().__init__()
        self.largest = (0, "")
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                if t.numel() > self.largest[0]:
                    self.largest = (t.numel(), str(func))
        return out


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "sgd"])
def test_backward_changes_exactly_the_rows_in_the_batch(tmp_pool_dir, kind):
    cfg = tiny_cfg(kind, rows=(2000, 3000, 7, 1500, 2500))
    pool = make_pool(tmp_pool_dir, cfg, tier="pmem")
    torch.manual_seed(0)
    model = PoolDLRM(cfg, pool)
    opt = SparseOptimizer(cfg.embedding_optimizer, pool, model.tables)
    for seed in (0, 1):
        dense, kjt, labels = jagged_batch(cfg, seed, B=16)
        before = tables_of(pool)
        _, pooled, plan = pool_step(model, opt, dense, kjt, labels)
        for f, name in enumerate(cfg.feature_names):
            in_batch = torch.unique(plan.ids[f])
            names = [name] + ([state_table_name(name)] if kind == "rowwise_adagrad" else [])
            for t in names:
                after = pool.table(t).view()
                outside = torch.ones(after.shape[0], dtype=torch.bool)
                outside[in_batch] = False
                assert torch.equal(after[outside], before[t][outside]), f"{t}: a row outside the batch changed"
                changed = changed_rows(after, before[t])
                assert set(changed.tolist()) <= set(in_batch.tolist())
            # Every row of the batch with a non-zero gradient moved.
            g = pooled.grad[:, f, :]
            bag = plan.bag_of_id[f]
            rows_with_grad = plan.ids[f][(g if bag is None else g[bag]).abs().sum(1) > 0]
            assert set(torch.unique(rows_with_grad).tolist()) <= set(changed_rows(pool.table(name).view(), before[name]).tolist())
    pool.close()


def test_no_gradient_the_size_of_a_table_is_created(tmp_pool_dir):
    cfg = tiny_cfg(rows=(20000, 30000, 7, 15000, 25000))
    pool = make_pool(tmp_pool_dir, cfg, tier="pmem")
    model = PoolDLRM(cfg, pool)
    opt = SparseOptimizer(cfg.embedding_optimizer, pool, model.tables)
    # Parameters are exactly TorchRec's dense parameters; no table is a parameter or needs grad.
    ref_names = {n for n, _ in torchrec_dlrm(cfg).named_parameters() if not n.startswith("sparse_arch.")}
    assert {n for n, _ in model.named_parameters()} == ref_names
    dense_numel = sum(p.numel() for p in model.parameters())
    assert dense_numel < 1000
    assert not any(pool.table(n).view().requires_grad for n in pool.tables())

    dense, kjt, labels = jagged_batch(cfg, 0, B=16)
    log = _AllocationLog()
    with log:
        _, pooled, plan = pool_step(model, opt, dense, kjt, labels)
    assert pooled.is_leaf and pooled.grad is not None and pooled.grad.shape == (16, len(FEATURES), DIM)
    assert all(p.grad is not None for p in model.parameters())
    assert log.ops > 50  # the mode saw forward, backward and the optimizer
    smallest_big_table = 15000 * DIM
    largest, op = log.largest
    assert largest < smallest_big_table // 10, f"{op} created a tensor of {largest} elements"
    pool.close()


# --------------------------------------------------------------------------- 5. plan() validation


@pytest.mark.parametrize("feature, bad_id, words", [
    ("f3", ROWS[3], ["'f3'", str(ROWS[3]), "out of range"]),
    ("f3", 10**9, ["'f3'", str(10**9)]),
    ("f1", -1, ["'f1'", "-1", "negative"]),
    ("f4", -7, ["'f4'", "-7"]),
])
def test_plan_rejects_bad_ids_naming_the_feature_and_changes_nothing(tmp_pool_dir, feature, bad_id, words):
    cfg = tiny_cfg()
    pool = make_pool(tmp_pool_dir, cfg, tier="pmem")
    model = PoolDLRM(cfg, pool)
    before, written = tables_of(pool), pool.stats.bytes_written
    dense, kjt, _ = single_id_batch(cfg, 0, B=8)
    values = kjt.values().clone()
    f = FEATURES.index(feature)
    values[f * 8 + 5] = bad_id
    bad = KeyedJaggedTensor.from_lengths_sync(keys=list(FEATURES), values=values, lengths=kjt.lengths())
    with pytest.raises(InvalidIdsError) as info:
        model.plan(bad)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert pool.stats.bytes_written == written
    assert all(torch.equal(v, pool.table(k).view()) for k, v in before.items())
    pool.close()


@pytest.mark.parametrize("keys", [
    ["f1", "f0", "f2", "f3", "f4"],          # wrong order
    ["f0", "f1", "f2", "f3"],                # missing
    ["f0", "f1", "f2", "f3", "f4", "f5"],    # extra
    ["f0", "f1", "f2", "f3", "x"],           # renamed
])
def test_plan_rejects_keys_that_are_not_the_model_features(tmp_pool_dir, keys):
    cfg = tiny_cfg()
    pool = make_pool(tmp_pool_dir, cfg)
    model = PoolDLRM(cfg, pool)
    before = tables_of(pool)
    B = 4
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.zeros(B * len(keys), dtype=torch.int64),
                                              lengths=torch.ones(B * len(keys), dtype=torch.int32))
    with pytest.raises(ValueError, match=re.escape(str(keys))) as info:
        model.plan(kjt)
    assert not isinstance(info.value, InvalidIdsError)
    assert all(torch.equal(v, pool.table(k).view()) for k, v in before.items())
    pool.close()


def test_plan_rejects_float_ids(tmp_pool_dir):
    cfg = tiny_cfg()
    pool = make_pool(tmp_pool_dir, cfg)
    model = PoolDLRM(cfg, pool)
    kjt = KeyedJaggedTensor(keys=list(FEATURES), values=torch.zeros(5 * 2), lengths=torch.ones(5 * 2, dtype=torch.int32))
    with pytest.raises(InvalidIdsError, match="integers"):
        model.plan(kjt)
    pool.close()


# --------------------------------------------------------------------------- 6. config validation, presets


BAD_CONFIGS = [
    (dict(bottom_mlp=(16, 4)), r"bottom_mlp.*embedding_dim=8.*\(16, 4\)"),
    (dict(bottom_mlp=()), r"bottom_mlp.*\(\)"),
    (dict(top_mlp=(16, 2)), r"top_mlp.*\(16, 2\)"),
    (dict(top_mlp=(1,)), r"top_mlp.*\(1,\)"),
    (dict(dense_optimizer="rmsprop"), r"dense_optimizer.*'rmsprop'"),
    (dict(embedding_optimizer=EmbeddingOptimizerConfig("adam")), r"embedding optimizer.*'adam'"),
    (dict(dense_lr=0.0), r"dense_lr.*got 0\.0"),
    (dict(dense_lr=-0.1), r"dense_lr.*-0\.1"),
    (dict(dense_lr=float("nan")), r"dense_lr.*nan"),
    (dict(dense_lr=float("inf")), r"dense_lr.*inf"),
    (dict(embedding_optimizer=EmbeddingOptimizerConfig(lr=0.0)), r"embedding lr.*got 0\.0"),
    (dict(embedding_optimizer=EmbeddingOptimizerConfig("sgd", lr=-2.5)), r"embedding lr.*-2\.5"),
    (dict(embedding_optimizer=EmbeddingOptimizerConfig(eps=0.0)), r"eps.*got 0\.0"),
    (dict(embedding_optimizer=EmbeddingOptimizerConfig(eps=-1e-8)), r"eps.*-1e-08"),
    (dict(embedding_optimizer=EmbeddingOptimizerConfig(initial_accumulator=-1.0)), r"initial_accumulator.*-1\.0"),
    (dict(num_embeddings=(40, 0, 7, 120, 250)), r"num_embeddings.*\(40, 0, 7, 120, 250\)"),
    (dict(num_embeddings=(40, 300)), r"5 features, 2 sizes"),
    (dict(feature_names=("f0", "f1", "f0", "f3", "f4")), r"duplicate.*'f0'"),
    (dict(embedding_dim=0, bottom_mlp=(16, 0)), r"embedding_dim.*0"),
    (dict(batch_size=0), r"batch_size.*0"),
]


@pytest.mark.parametrize("change, message", BAD_CONFIGS, ids=[m for m in
                         ("bottom_mlp_end", "bottom_mlp_empty", "top_mlp_end", "top_mlp_short", "dense_optimizer",
                          "embedding_optimizer", "dense_lr_zero", "dense_lr_negative", "dense_lr_nan", "dense_lr_inf",
                          "embedding_lr_zero", "embedding_lr_negative", "eps_zero", "eps_negative",
                          "initial_accumulator_negative", "num_embeddings_zero", "num_embeddings_count",
                          "duplicate_features", "embedding_dim_zero", "batch_size_zero")])
def test_bad_model_config_raises_value_error_naming_the_value(tmp_pool_dir, change, message):
    good = tiny_cfg()
    validate_model_config(good)
    bad = dataclasses.replace(good, **change)
    with pytest.raises(ValueError, match=message):
        validate_model_config(bad)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(json.loads(json.dumps(bad.to_dict())))
    pool = make_pool(tmp_pool_dir, good)
    with pytest.raises(ValueError, match=message):
        PoolDLRM(bad, pool)
    pool.close()


def test_sgd_config_needs_no_eps():
    validate_model_config(tiny_cfg("sgd", eps=0.0))


def test_presets_small_and_kaggle_have_the_documented_shapes():
    for name, cfg in PRESETS.items():
        validate_model_config(cfg)
    small = PRESETS["small"]
    assert len(small.feature_names) == len(small.num_embeddings) == 26
    assert small.num_embeddings == tuple(min(c, 100_000) for c in KAGGLE_CARDINALITIES)
    assert max(small.num_embeddings) == 100_000 and sum(n == 100_000 for n in small.num_embeddings) == 7
    assert small.embedding_dim == 64
    assert small.bottom_mlp == (512, 256, 64) and small.top_mlp == (512, 256, 1)
    assert small.batch_size == 2048
    kaggle = PRESETS["kaggle"]
    assert kaggle.num_embeddings == KAGGLE_CARDINALITIES and len(kaggle.num_embeddings) == 26
    assert sum(kaggle.num_embeddings) == 33_762_577
    assert kaggle.embedding_dim == 64
    assert kaggle.feature_names == small.feature_names == tuple(f"cat_{i}" for i in range(26))
    # 33.8M rows x 64 floats + one Adagrad float per row.
    assert kaggle.table_bytes == 33_762_577 * 65 * 4


# --------------------------------------------------------------------------- 7. to_dict / from_dict


@pytest.mark.parametrize("cfg", [
    tiny_cfg(),
    tiny_cfg("sgd", lr=0.3),
    dataclasses.replace(tiny_cfg(), dense_optimizer="adam", dense_lr=1e-3, num_dense=3,
                        embedding_optimizer=EmbeddingOptimizerConfig("rowwise_adagrad", 0.02, 1e-6, 0.1)),
    *PRESETS.values(),
], ids=["tiny_adagrad", "tiny_sgd", "custom", *PRESETS])
def test_model_config_round_trips_through_to_dict_and_json(cfg):
    d = cfg.to_dict()
    assert isinstance(d["embedding_optimizer"], dict)
    snapshot = json.dumps(d, sort_keys=True)
    again = ModelConfig.from_dict(json.loads(json.dumps(d)))  # as the pool's meta stores it
    assert again == cfg and hash(again) == hash(cfg)
    assert isinstance(again.embedding_optimizer, EmbeddingOptimizerConfig)
    assert all(isinstance(getattr(again, k), tuple) for k in ("feature_names", "num_embeddings", "bottom_mlp", "top_mlp"))
    assert json.dumps(d, sort_keys=True) == snapshot  # from_dict did not change its argument
    assert ModelConfig.from_dict(d) == cfg
