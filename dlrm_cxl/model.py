"""DLRM whose embedding tables live in a :mod:`memory_pool` pool.

The dense parts are TorchRec's own modules (``DenseArch``, ``InteractionArch``, ``OverArch``
from ``torchrec.models.dlrm``), so with identical weights the forward pass is TorchRec's
``DLRM`` and a state_dict maps 1:1. Only the sparse arch differs: lookups read the pool, and
the backward pass does not build a gradient the size of a table. Instead the pooled embeddings
are autograd leaves; after ``loss.backward()`` their gradients are scattered to exactly the
touched rows, and :class:`SparseOptimizer` updates those rows (and their optimizer state, which
is also a pool table) in place.

One training step, as the trainer drives it, on the fused path (the default: every table in
the pool's arena, none behind a DRAM row cache)::

    plan = model.plan(batch.sparse, fused=True)    # validate ids; unique rows per table
    touched = optimizer.touched(plan)              # (table, rows) about to change: the undo log's input
    logits, pooled = model.forward_fused(batch.dense, plan)   # fbgemm TBE forward over pool memory
    pooled.register_hook(write_ahead_barrier)      # runs right before the fused update
    loss.backward()                                # fbgemm's fused backward + optimizer: rows in place

and on the reference path (cached tables, several ranks)::

    plan = model.plan(batch.sparse)
    logits, pooled = model(batch.dense, plan)      # forward; pooled is a leaf [B, F, D]
    loss.backward()
    updates = optimizer.compute(plan, pooled.grad) # new rows, nothing written yet
    optimizer.apply(updates)                       # in-place writes (after the undo log is durable)

Both paths compute fbgemm's EXACT_ROWWISE_ADAGRAD / EXACT_SGD and agree to float rounding; the
fused one is the kernel TorchRec's FUSED compute kernel runs (bit-identical to it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import nn
from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from memory_pool import DistinctRows, InvalidIdsError, MemoryPool, Table, TouchedRows

from .data.batch import criteo_feature_names

__all__ = [
    "ModelConfig",
    "EmbeddingOptimizerConfig",
    "PRESETS",
    "KAGGLE_CARDINALITIES",
    "PoolDLRM",
    "SparsePlan",
    "SparseOptimizer",
    "state_table_name",
    "to_torchrec_state_dict",
    "torchrec_table_key",
    "torchrec_dlrm",
]

# Rows of the 26 categorical features of Criteo Kaggle (Display Advertising Challenge), as in
# the DLRM reference and TorchRec's examples: 33,762,577 rows in all.
KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
CRITEO_FEATURES = criteo_feature_names()


@dataclass(frozen=True)
class EmbeddingOptimizerConfig:
    """Optimizer of the embedding rows. ``rowwise_adagrad`` as fbgemm's EXACT_ROWWISE_ADAGRAD:
    ``m += mean(g*g)``; ``w -= lr * g / (sqrt(m) + eps)``, with one ``m`` per row."""

    kind: str = "rowwise_adagrad"  # or "sgd"
    lr: float = 0.05
    eps: float = 1e-8
    initial_accumulator: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """The shape of the model; presets below. Frozen: the objects that own memory are separate."""

    feature_names: tuple[str, ...]
    num_embeddings: tuple[int, ...]
    embedding_dim: int
    num_dense: int = 13
    bottom_mlp: tuple[int, ...] = (512, 256, 64)
    top_mlp: tuple[int, ...] = (512, 256, 1)
    batch_size: int = 2048
    dense_optimizer: str = "adagrad"  # sgd | adagrad | adam
    dense_lr: float = 0.01
    embedding_optimizer: EmbeddingOptimizerConfig = field(default_factory=EmbeddingOptimizerConfig)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["embedding_optimizer"] = EmbeddingOptimizerConfig(**d.get("embedding_optimizer", {}))
        for k in ("feature_names", "num_embeddings", "bottom_mlp", "top_mlp"):
            d[k] = tuple(d[k])
        cfg = cls(**d)
        validate_model_config(cfg)
        return cfg

    @property
    def table_bytes(self) -> int:
        state = 1 if self.embedding_optimizer.kind == "rowwise_adagrad" else 0
        return sum(self.num_embeddings) * (self.embedding_dim + state) * 4


def validate_model_config(cfg: ModelConfig) -> None:
    if len(cfg.feature_names) != len(cfg.num_embeddings) or not cfg.feature_names:
        raise ValueError(f"need one num_embeddings per feature: {len(cfg.feature_names)} features, "
                         f"{len(cfg.num_embeddings)} sizes")
    if len(set(cfg.feature_names)) != len(cfg.feature_names):
        raise ValueError(f"duplicate feature names in {cfg.feature_names}")
    if any(n < 1 for n in cfg.num_embeddings):
        raise ValueError(f"num_embeddings must be >= 1, got {cfg.num_embeddings}")
    if cfg.embedding_dim < 1 or cfg.num_dense < 1 or cfg.batch_size < 1:
        raise ValueError(f"embedding_dim, num_dense, batch_size must be >= 1: {cfg.embedding_dim}, "
                         f"{cfg.num_dense}, {cfg.batch_size}")
    if not cfg.bottom_mlp or cfg.bottom_mlp[-1] != cfg.embedding_dim:
        raise ValueError(f"bottom_mlp must end in embedding_dim={cfg.embedding_dim}, got {cfg.bottom_mlp}")
    if len(cfg.top_mlp) < 2 or cfg.top_mlp[-1] != 1:
        raise ValueError(f"top_mlp needs >= 2 layers ending in 1, got {cfg.top_mlp}")
    if cfg.dense_optimizer not in ("sgd", "adagrad", "adam"):
        raise ValueError(f"dense_optimizer must be sgd, adagrad or adam, got {cfg.dense_optimizer!r}")
    if cfg.embedding_optimizer.kind not in ("sgd", "rowwise_adagrad"):
        raise ValueError(f"embedding optimizer must be sgd or rowwise_adagrad, got {cfg.embedding_optimizer.kind!r}")
    for name, lr in (("dense_lr", cfg.dense_lr), ("embedding lr", cfg.embedding_optimizer.lr)):
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"{name} must be a positive finite number, got {lr}")
    eo = cfg.embedding_optimizer
    if eo.kind == "rowwise_adagrad":
        # eps = 0 turns a touched row with a zero gradient into 0/0 = NaN on its first update;
        # a negative accumulator makes sqrt() NaN.
        if not (eo.eps > 0 and math.isfinite(eo.eps)):
            raise ValueError(f"embedding optimizer eps must be a positive finite number, got {eo.eps}")
        if not (eo.initial_accumulator >= 0 and math.isfinite(eo.initial_accumulator)):
            raise ValueError(f"embedding optimizer initial_accumulator must be a finite number >= 0, "
                             f"got {eo.initial_accumulator}")


PRESETS: dict[str, ModelConfig] = {
    # Seconds on a laptop; what the tests use. Same 26 features as Criteo, tiny tables.
    "tiny": ModelConfig(CRITEO_FEATURES, tuple(min(c, 1000) for c in KAGGLE_CARDINALITIES), 8,
                        bottom_mlp=(32, 8), top_mlp=(32, 1), batch_size=64),
    # The BRIEF's anchor: Kaggle cardinalities capped at 100k rows, dim 64.
    "small": ModelConfig(CRITEO_FEATURES, tuple(min(c, 100_000) for c in KAGGLE_CARDINALITIES), 64),
    # Full Criteo Kaggle: 33.8M rows, ~8.7 GB of fp32 at dim 64 (+ 135 MB of Adagrad state).
    "kaggle": ModelConfig(CRITEO_FEATURES, KAGGLE_CARDINALITIES, 64),
}


def state_table_name(table: str) -> str:
    """Pool table holding the row-wise Adagrad accumulator of ``table``."""
    return f"{table}.adagrad"


# --------------------------------------------------------------------------- sparse plan


@dataclass
class SparsePlan:
    """Per feature: the batch's ids, bag offsets, and the distinct rows they touch."""

    batch_size: int
    ids: list[torch.Tensor]        # [n_f] int64
    offsets: list[torch.Tensor]    # [B] int64
    bag_of_id: list[torch.Tensor | None]  # [n_f] sample of each id (None: one id per sample)
    rows: list[torch.Tensor]       # [u_f] sorted distinct rows
    inverse: list[torch.Tensor]    # [n_f] index into rows (reference path only)
    values: torch.Tensor | None = None   # fused path: the KJT's ids (int64) and bag offsets
    kjt_offsets: torch.Tensor | None = None
    cache_seq: int | None = None         # fused path on a DRAM cache: the batch's number (prefetch)
    global_rows: torch.Tensor | None = None  # fused path: ``rows`` of all features in one numbering
    row_base: torch.Tensor | None = None     # (feature f's row r is row_base[f] + r)


# --------------------------------------------------------------------------- model


class PoolDLRM(nn.Module):
    """TorchRec's DLRM with the sparse arch served by a memory pool.

    Parameters are only the dense ones; the tables are ``pool.table(feature)``.
    """

    def __init__(self, cfg: ModelConfig, pool: MemoryPool, dense_device: torch.device | str = "cpu",
                 features: Sequence[int] | None = None):
        """``features``: indices of the features whose tables are in ``pool`` (default all;
        a rank of a sharded job holds a subset, see dlrm_cxl.distributed)."""
        super().__init__()
        validate_model_config(cfg)
        self.cfg = cfg
        self.features = list(range(len(cfg.feature_names))) if features is None else list(features)
        self.tables: list[Table] = [pool.table(cfg.feature_names[f]) for f in self.features]
        for t, n in zip(self.tables, [cfg.num_embeddings[f] for f in self.features]):
            if t.num_embeddings != n or t.embedding_dim != cfg.embedding_dim:
                raise ValueError(f"pool table {t.name} is {t.num_embeddings}x{t.embedding_dim}, "
                                 f"config wants {n}x{cfg.embedding_dim}")
        F = len(cfg.feature_names)
        D = cfg.embedding_dim
        device = torch.device(dense_device)
        self.dense_arch = DenseArch(cfg.num_dense, list(cfg.bottom_mlp), device=device)
        self.inter_arch = InteractionArch(num_sparse_features=F)
        self.over_arch = OverArch(D + F * (F - 1) // 2 + F, list(cfg.top_mlp), device=device)
        self.inter_arch.to(device)
        self.dense_device = device
        self.fused = None  # set by bind_fused()
        self.cache_bags = None  # bind_fused(): the fused kernels on a DRAM cache arena (dlrm_cxl/fused.py)
        base = [0]
        for t in self.tables:
            base.append(base[-1] + t.num_embeddings)
        self._row_base = torch.tensor(base, dtype=torch.int64)
        self._distinct = DistinctRows(base)   # (the plan's distinct rows, with one bitmap)

    def _cache_rows(self, plan: SparsePlan) -> torch.Tensor | None:
        """The plan's rows in the DRAM cache arena's numbering, when it numbers them as the plan
        does (it caches every table of this model, in order): one tensor for the whole batch."""
        if plan.global_rows is None:
            return None
        same = getattr(self, "_cache_same_numbering", None)
        if same is None:
            same = self._cache_same_numbering = self.cache_bags.numbers_rows_as(self._row_base)
        return plan.global_rows if same else None

    def _check_ids(self, keys, values: torch.Tensor, bounds: list[int]) -> None:
        """Every id in range, all features at once; on failure the per-feature check names the
        feature and the id. Nothing has changed when this raises."""
        if not values.numel():
            return
        sizes = [t.num_embeddings for t in self.tables]
        feats = [values[bounds[f]:bounds[f + 1]] for f in self.features]
        lo, hi = torch.aminmax(values)
        ok = int(lo) >= 0 and int(hi) < min(sizes)
        if not ok and int(lo) >= 0:
            limit = self._limits(bounds)
            if limit is not None:
                ok = not bool((values >= limit).any())
        if ok:
            return
        for f, table, ids in zip(self.features, self.tables, feats):
            if ids.numel():
                lo, hi = (int(x) for x in torch.aminmax(ids))
                if lo < 0:
                    raise InvalidIdsError(f"feature {keys[f]!r}: negative sparse id {lo}")
                if hi >= table.num_embeddings:
                    raise InvalidIdsError(
                        f"feature {keys[f]!r}: id {hi} out of range [0, {table.num_embeddings})")

    def _limits(self, bounds: list[int]) -> torch.Tensor | None:
        if self.features != list(range(len(self.cfg.feature_names))):
            return None
        sizes = torch.tensor([t.num_embeddings for t in self.tables])
        return torch.repeat_interleave(sizes, torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1]))

    def plan(self, kjt: KeyedJaggedTensor, *, fused: bool = False, rows: bool = True) -> SparsePlan:
        """Validate a batch's sparse input (raises InvalidIdsError/ValueError) and index it.
        ``fused``: only what the fused path needs (distinct rows per table, found with one sort
        over all tables; ``rows=False``: not even those -- nothing needs to know them when no
        undo record, after-image or dirty mark is kept)."""
        keys = list(kjt.keys())
        if keys != list(self.cfg.feature_names):
            raise ValueError(f"KeyedJaggedTensor keys {keys} != model features {list(self.cfg.feature_names)}")
        B = kjt.stride()
        values = kjt.values()
        if values.dtype not in (torch.int64, torch.int32):
            raise InvalidIdsError(f"sparse ids must be integers, got {values.dtype}")
        values = values.to(torch.int64)
        bounds = kjt.offset_per_key()
        self._check_ids(keys, values, bounds)
        plan = SparsePlan(B, [], [], [], [], [])
        if fused:
            plan.values = values
            plan.kjt_offsets = kjt.offsets().to(torch.int64)
            if not rows and self.cache_bags is None:
                plan.rows = [torch.empty(0, dtype=torch.int64) for _ in self.features]
                return plan
            # Distinct rows of every table at once, in one numbering (each table's ids shifted
            # by the rows of the tables before it: memory_pool.rowsets), split at the table
            # boundaries.
            # (NumPy for these whole-batch array operations: one call each, no torch dispatch;
            # the ids are on the CPU -- a batch's sparse input is, whatever the dense device.)
            base = self._row_base
            nb = base.numpy()
            uniq = self._distinct(values, np.diff(np.asarray(bounds)))
            u = uniq.numpy()
            cut = np.searchsorted(u, nb)
            local = u - np.repeat(nb[:-1], np.diff(cut))
            plan.rows = [torch.from_numpy(local[cut[f]:cut[f + 1]]) for f in range(len(self.features))]
            plan.global_rows, plan.row_base = uniq, base
            if self.cache_bags is not None:  # (lookahead: the rows read into the DRAM cache now)
                flat = self._cache_rows(plan)
                # (in the arena's numbering, the batch's ids too: translated to slots ahead, there)
                ids = (values, np.diff(np.asarray(bounds)).tolist()) \
                    if flat is not None and len(bounds) == len(self.tables) + 1 else (None, None)
                plan.cache_seq = self.cache_bags.prefetch(plan.rows, flat, *ids)
            return plan
        lengths = kjt.lengths().to(torch.int64)
        for f in self.features:
            ids = values[bounds[f]:bounds[f + 1]]
            lens = lengths[f * B:(f + 1) * B]
            offsets = torch.zeros(B, dtype=torch.int64)
            if B > 1:
                torch.cumsum(lens[:-1], 0, out=offsets[1:])
            one_each = ids.numel() == B and bool((lens == 1).all())
            bag = None if one_each else torch.repeat_interleave(torch.arange(B), lens)
            rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
            plan.ids.append(ids)
            plan.offsets.append(offsets)
            plan.bag_of_id.append(bag)
            plan.rows.append(rows)
            plan.inverse.append(inverse)
        return plan

    # -- the fused path: fbgemm's table-batched kernels in place on the pool's arena
    def bind_fused(self, pool: MemoryPool) -> bool:
        """Bind fbgemm's fused kernels to the pool's memory -- to a DRAM cache arena in front of
        it when a table is served through a DRAM row cache (dlrm_cxl/fused.py: bind_cached);
        False (reference path) when a table is not float32 or not in the arena, or when this
        model holds a subset of the features (several ranks)."""
        from .fused import FusedEmbeddingBags, FusedTableSpec

        eo = self.cfg.embedding_optimizer
        states = [pool.table(state_table_name(t.name)) if eo.kind == "rowwise_adagrad" else None
                  for t in self.tables]
        every = self.tables + [s for s in states if s is not None]
        if (self.features != list(range(len(self.cfg.feature_names)))
                or any(t.dtype != torch.float32 or t.arena_offset is None for t in every)):
            self.fused = None
            return False
        if any(t.cached for t in every):
            from .fused import bind_cached

            self.fused = self.cache_bags = bind_cached(pool, self.tables, states, optimizer=eo.kind, lr=eo.lr,
                                                       eps=eo.eps, batch_size=self.cfg.batch_size)
            return True
        specs = [FusedTableSpec(t.num_embeddings, t.embedding_dim, t.arena_offset // 4,
                                s.arena_offset // 4 if s is not None else None) for t, s in zip(self.tables, states)]
        # The kernels read the arena directly: forward_fused makes each batch's rows ready first
        # (rows an on-demand replay has not applied yet; memory_pool/ondemand.py).
        flat = pool.arena_tensor(torch.float32, on_demand=True)
        self._fused_pool = pool
        self._fused_tables = [(t, s) for t, s in zip(self.tables, states)]
        self.fused = FusedEmbeddingBags(specs, flat, optimizer=eo.kind, lr=eo.lr, eps=eo.eps,
                                        state=flat if eo.kind == "rowwise_adagrad" else None)
        return True

    def forward_fused(self, dense: torch.Tensor, plan: SparsePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits [B], pooled [B, F*D] from the fused kernel). ``loss.backward()`` then
        updates the batch's rows and their optimizer state in the pool, in place."""
        if self.cache_bags is not None:  # (it readies the rows it reads from the pool itself)
            pooled = self.cache_bags(plan.values, plan.kjt_offsets, plan.rows, plan.cache_seq, self._cache_rows(plan))
            sparse = pooled.to(self.dense_device).view(plan.batch_size, len(self.features), self.cfg.embedding_dim)
            return self.forward_pooled(dense, sparse), pooled
        pool = self._fused_pool
        if pool.rows_pending:
            if plan.values.numel() and not any(r.numel() for r in plan.rows):
                pool.arena_tensor(on_demand=False)  # a plan without its rows: apply them all
            else:
                pool.ready([(t, r) for (t, s), r in zip(self._fused_tables, plan.rows)] +
                           [(s, r) for (t, s), r in zip(self._fused_tables, plan.rows) if s is not None])
        pooled = self.fused(plan.values, plan.kjt_offsets)
        B, F_ = plan.batch_size, len(self.features)
        sparse = pooled.to(self.dense_device).view(B, F_, self.cfg.embedding_dim)
        return self.forward_pooled(dense, sparse), pooled

    def pooled(self, plan: SparsePlan) -> torch.Tensor:
        """Sum-pooled embeddings [B, F, D] of this pool's features, read from the pool (no autograd)."""
        outs = [t.pooled_rows(ids, off) for t, ids, off in zip(self.tables, plan.ids, plan.offsets)]
        return torch.stack(outs, dim=1)

    def forward(self, dense: torch.Tensor, plan: SparsePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits [B], pooled leaf [B, F, D] whose .grad feeds SparseOptimizer)."""
        pooled = self.pooled(plan).to(self.dense_device).requires_grad_(True)
        return self.forward_pooled(dense, pooled), pooled

    def forward_pooled(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The dense part: bottom MLP, interaction with all F pooled features [B, F, D], top MLP."""
        embedded_dense = self.dense_arch(dense.to(self.dense_device))
        concat = self.inter_arch(dense_features=embedded_dense, sparse_features=pooled)
        return self.over_arch(concat).squeeze(-1)

    # -- TorchRec interop
    def export_torchrec(self) -> dict[str, torch.Tensor]:
        """State dict of an equivalent ``torchrec.models.dlrm.DLRM`` (see :func:`torchrec_dlrm`)."""
        return to_torchrec_state_dict(self)

    def import_torchrec(self, state: dict[str, torch.Tensor]) -> None:
        """Load a TorchRec ``DLRM`` state_dict: dense parts into this module, tables into the pool."""
        dense = {k: v for k, v in state.items() if not k.startswith("sparse_arch.")}
        weights = []
        for t in self.tables:  # check every table before changing anything
            key = torchrec_table_key(t.name)
            if key not in state:
                raise ValueError(f"TorchRec state_dict has no {key!r}")
            w = state[key]
            if tuple(w.shape) != (t.num_embeddings, t.embedding_dim):
                raise ValueError(f"{t.name}: weight {tuple(w.shape)} != table {(t.num_embeddings, t.embedding_dim)}")
            weights.append(w)
        self.load_state_dict(dense)
        for t, w in zip(self.tables, weights):
            # A durable bulk load (a table served through a DRAM row cache drops what it cached).
            t.load_(w.detach().to("cpu", t.dtype).contiguous())


def to_torchrec_state_dict(model: PoolDLRM) -> dict[str, torch.Tensor]:
    out = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for t in model.tables:
        out[torchrec_table_key(t.name)] = t.view().clone()
    return out


def torchrec_table_key(name: str) -> str:
    """The state_dict key of table ``name``'s weights in TorchRec's ``DLRM`` (:func:`torchrec_dlrm`)."""
    return f"sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"


def torchrec_dlrm(cfg: ModelConfig, device: str = "cpu"):
    """A plain TorchRec ``DLRM`` of the same shape (tables named after features)."""
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f, embedding_dim=cfg.embedding_dim, num_embeddings=n, feature_names=[f])
                for f, n in zip(cfg.feature_names, cfg.num_embeddings)],
        device=torch.device(device))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=cfg.num_dense,
                dense_arch_layer_sizes=list(cfg.bottom_mlp), over_arch_layer_sizes=list(cfg.top_mlp))


# --------------------------------------------------------------------------- sparse optimizer


@dataclass
class RowUpdate:
    table: Table
    rows: torch.Tensor
    weights: torch.Tensor
    state_table: Table | None = None
    state: torch.Tensor | None = None


class SparseOptimizer:
    """SGD or row-wise Adagrad over pool rows; the Adagrad accumulator is a pool table too."""

    def __init__(self, cfg: EmbeddingOptimizerConfig, pool: MemoryPool, tables: Sequence[Table]):
        self.cfg = cfg
        self.tables = list(tables)
        self.state_tables: list[Table | None] = [
            pool.table(state_table_name(t.name)) if cfg.kind == "rowwise_adagrad" else None for t in self.tables]

    @staticmethod
    def create_state_tables(pool: MemoryPool, cfg: EmbeddingOptimizerConfig, model_cfg: ModelConfig,
                            features: Sequence[int] | None = None) -> None:
        if cfg.kind != "rowwise_adagrad":
            return
        features = range(len(model_cfg.feature_names)) if features is None else features
        for name, n in ((model_cfg.feature_names[f], model_cfg.num_embeddings[f]) for f in features):
            t = pool.create_table(state_table_name(name), n, 1)
            if cfg.initial_accumulator:
                t.load_(torch.full((n, 1), float(cfg.initial_accumulator)))

    def touched(self, plan: SparsePlan) -> TouchedRows:
        """Every (table, rows) this step will change: what the undo log must save first. With
        the plan's rows of all features in one numbering when it has them (the fused path), so
        that the recovery window's first-touch bookkeeping is one array operation a step."""
        out, member = [], []
        for f, t in enumerate(self.tables):
            out.append((t, plan.rows[f]))
            member.append(f)
            if self.state_tables[f] is not None:
                out.append((self.state_tables[f], plan.rows[f]))
                member.append(f)
        if plan.global_rows is None or len(self.tables) != len(plan.row_base) - 1:
            return TouchedRows(out)
        return TouchedRows(out, global_rows=plan.global_rows, base=plan.row_base, member=member)

    def compute(self, plan: SparsePlan, pooled_grad: torch.Tensor,
                before: dict[str, torch.Tensor] | None = None) -> list[RowUpdate]:
        """New values of the touched rows (reads the pool, writes nothing).

        ``before``: the rows' current values by table name, in ``plan.rows`` order, when the
        caller already has them (the undo log's before-images): then nothing is gathered twice.
        The optimizer arithmetic runs once over all tables' rows concatenated, not per table.
        """
        # [F, B, D], contiguous per feature: index_add_ from a strided [B, D] slice is ~7x slower
        grad = pooled_grad.detach().to("cpu", torch.float32).transpose(0, 1).contiguous()
        c = self.cfg
        row_grads, weights, states = [], [], []
        for f, t in enumerate(self.tables):
            g = grad[f]
            if plan.bag_of_id[f] is not None:
                g = g.index_select(0, plan.bag_of_id[f])
            rows = plan.rows[f]
            # Sum the gradient of every occurrence of a row (fbgemm's exact optimizers do the same).
            row_grad = torch.zeros(rows.numel(), g.shape[1], dtype=torch.float32)
            row_grad.index_add_(0, plan.inverse[f], g)
            row_grads.append(row_grad)
            weights.append(before[t.name] if before is not None else t.view().index_select(0, rows))
            st = self.state_tables[f]
            if st is not None:
                states.append(before[st.name] if before is not None else st.view().index_select(0, rows))
        sizes = [r.shape[0] for r in row_grads]
        G = torch.cat(row_grads)
        W = torch.cat(weights)  # a new tensor: the before-images stay untouched
        if c.kind == "sgd":
            W.sub_(G, alpha=c.lr)
            return [RowUpdate(t, plan.rows[f], w) for f, (t, w) in enumerate(zip(self.tables, W.split(sizes)))]
        M = torch.cat(states)
        M.add_(G.square().mean(dim=1, keepdim=True))
        W.addcdiv_(G, M.sqrt().add_(c.eps), value=-c.lr)
        return [RowUpdate(t, plan.rows[f], w, st, m) for f, (t, st, w, m)
                in enumerate(zip(self.tables, self.state_tables, W.split(sizes), M.split(sizes)))]

    @staticmethod
    def apply(updates: Sequence[RowUpdate], between=None) -> None:
        """Write the new rows in place. ``between(i)`` is called after update i (crash injection)."""
        for i, u in enumerate(updates):
            u.table.scatter_rows(u.rows, u.weights)
            if u.state_table is not None:
                u.state_table.scatter_rows(u.rows, u.state)
            if between is not None:
                between(i)
