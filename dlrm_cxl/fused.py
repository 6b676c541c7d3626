"""fbgemm's fused CPU table-batched embedding kernels over memory the caller owns.

TorchRec's FUSED compute kernel is fbgemm_gpu's ``SplitTableBatchedEmbeddingBagsCodegen`` (TBE):
one C++ op pools every table's bags in the forward pass, and its backward sums the gradient of
each touched row and applies the optimizer (EXACT_ROWWISE_ADAGRAD, EXACT_SGD, ...) to that row
in place, with no table-sized gradient. On the host (``EmbeddingLocation.HOST`` /
``ComputeDevice.CPU``) the op sees all tables as one flat float tensor ``host_weights`` plus
``weights_offsets[t]``, the element offset of table ``t``; the optimizer state is the same kind
of flat tensor with its own offsets.

The TBE module itself allocates and initialises that flat tensor (and the state), so it cannot
train tables that already live somewhere else. :class:`FusedEmbeddingBags` calls the same op
(``fbgemm_gpu.split_embedding_codegen_lookup_invokers``) with ``host_weights`` and the state
being tensors the *caller* owns -- typically 1-D views of a memory pool or an ``mmap`` -- and
every table located by its own offset, so tables need not be adjacent (each may start on its
own page). Nothing is copied and nothing table-sized is allocated: the forward reads the
batch's rows from the caller's memory and ``loss.backward()`` updates exactly the batch's rows
(and their optimizer state) there, in place.

The arguments mirror what the TBE constructor computes (``D_offsets``, ``hash_size_cumsum``,
``total_hash_size_bits``, ``info_B_num_bits``/``info_B_mask`` from
``torch.ops.fbgemm.get_infos_metadata``, placements ``HOST``), with sum pooling, fp32 weights and
output, no stochastic rounding, no gradient clipping and no weight decay, so the numerics are
those of TorchRec's FUSED kernel.

Example::

    specs = [FusedTableSpec(rows=1000, dim=64, weight_offset=0, state_offset=0), ...]
    bags = FusedEmbeddingBags(specs, weights, optimizer="rowwise_adagrad", lr=0.05, state=state)
    pooled = bags(kjt.values(), kjt.offsets())     # [B, sum(dims)]
    loss_of(pooled).backward()                     # weights/state rows of the batch updated
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Sequence

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
from fbgemm_gpu.split_embedding_codegen_lookup_invokers import lookup_rowwise_adagrad, lookup_sgd
from fbgemm_gpu.split_embedding_codegen_lookup_invokers.lookup_args import (
    CommonArgs,
    Momentum,
    OptimizerArgs,
    VBEMetadata,
)
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode

from memory_pool import InvalidIdsError, intra_op_threads
from memory_pool.validation import is_int

__all__ = ["FusedTableSpec", "FusedEmbeddingBags", "CachedFusedEmbeddingBags", "bind_cached"]

OPTIMIZERS = ("rowwise_adagrad", "sgd")
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_ROWS = 2**31 - 2  # fbgemm's CPU backward: TORCH_CHECK(hash_size < 2**31 - 1)
# The optimizer state's homes are kept in memory when they take at most 1/8 of the DRAM budget
# (bind_cached; kaggle at a quarter: 135 MB of 2.2 GB).
PINNED_STATE_SHARE = 8


@dataclass(frozen=True)
class FusedTableSpec:
    """One table: ``rows x dim`` float32, row-major, row 0 at element ``weight_offset`` of the
    weights tensor; its rowwise-Adagrad state (one float per row) at element ``state_offset`` of
    the state tensor (``None`` for SGD, which has no state)."""

    rows: int
    dim: int
    weight_offset: int
    state_offset: int | None = None


def _check_flat(name: str, t, spans: list[tuple[int, int, int]], what: str) -> None:
    """``t`` is a 1-D contiguous float32 CPU tensor holding every ``(table, start, length)`` span,
    and no two spans overlap."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (a flat view of the memory), got shape {tuple(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    n = t.numel()
    for table, start, length in spans:
        if start + length > n:
            raise ValueError(f"table {table}: {what} [{start}, {start + length}) lies outside {name} "
                             f"of {n} elements")
    ordered = sorted(spans, key=lambda s: s[1])
    for (ta, sa, la), (tb, sb, _) in zip(ordered, ordered[1:]):
        if sa + la > sb:
            raise ValueError(f"tables {ta} and {tb} overlap in {name}: [{sa}, {sa + la}) and "
                             f"[{sb}, ...)")


def validate_fused_args(specs: Sequence[FusedTableSpec], weights, optimizer: str, lr: float, eps: float,
                        state) -> None:
    """Raise ValueError naming the offending value unless the arguments describe valid tables."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite float > 0, got {lr!r}")
    adagrad = optimizer == "rowwise_adagrad"
    if adagrad and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps)
                    or eps <= 0):
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    specs = list(specs)
    if not specs:
        raise ValueError("specs must name at least one table, got none")
    for t, s in enumerate(specs):
        if not isinstance(s, FusedTableSpec):
            raise ValueError(f"table {t}: expected a FusedTableSpec, got {s!r}")
        for field_name in ("rows", "dim", "weight_offset"):
            v = getattr(s, field_name)
            if not is_int(v) or v < (0 if field_name == "weight_offset" else 1):
                bound = ">= 0" if field_name == "weight_offset" else ">= 1"
                raise ValueError(f"table {t}: {field_name} must be an int {bound}, got {v!r}")
        if s.rows > _MAX_ROWS:
            raise ValueError(f"table {t}: rows must be <= {_MAX_ROWS} (fbgemm's CPU backward indexes rows "
                             f"with int32), got {s.rows}")
        if adagrad and (not is_int(s.state_offset) or s.state_offset < 0):
            raise ValueError(f"table {t}: rowwise_adagrad needs state_offset, an int >= 0, "
                             f"got {s.state_offset!r}")
        if not adagrad and s.state_offset is not None:
            raise ValueError(f"table {t}: sgd has no optimizer state, so state_offset must be None, "
                             f"got {s.state_offset!r}")
    if adagrad and state is None:
        raise ValueError("rowwise_adagrad needs state (one float32 per row), got state=None")
    if not adagrad and state is not None:
        raise ValueError(f"sgd has no optimizer state, so state must be None, got a tensor of shape "
                         f"{tuple(state.shape) if isinstance(state, torch.Tensor) else state!r}")
    _check_flat("weights", weights, [(t, s.weight_offset, s.rows * s.dim) for t, s in enumerate(specs)],
                "rows*dim")
    if adagrad:
        _check_flat("state", state, [(t, s.state_offset, s.rows) for t, s in enumerate(specs)], "rows")
        if state.untyped_storage().data_ptr() == weights.untyped_storage().data_ptr():
            # One storage for both (one pool mapping) is fine, as long as no table's state overlaps
            # any table's rows. Compared in elements from the start of the shared storage.
            w0, m0 = weights.storage_offset(), state.storage_offset()
            for tw, s in enumerate(specs):
                a, la = w0 + s.weight_offset, s.rows * s.dim
                for tm, u in enumerate(specs):
                    b, lb = m0 + u.state_offset, u.rows
                    if a < b + lb and b < a + la:
                        raise ValueError(f"table {tm}'s state [{b}, {b + lb}) overlaps table {tw}'s rows "
                                         f"[{a}, {a + la}) (elements of the storage weights and state share)")


class FusedEmbeddingBags:
    """Sum-pooled lookups of several tables with fbgemm's fused backward + optimizer, on the
    caller's ``weights`` (and ``state``) in place. See the module docstring."""

    def __init__(self, specs: Sequence[FusedTableSpec], weights: torch.Tensor, *, optimizer: str,
                 lr: float, eps: float = 1e-8, state: torch.Tensor | None = None):
        specs = tuple(specs)
        validate_fused_args(specs, weights, optimizer, lr, eps, state)
        self.specs: tuple[FusedTableSpec, ...] = specs
        self.optimizer = optimizer
        self.lr = float(lr)
        self.eps = float(eps)
        # detach() shares the storage: the kernels write into the caller's memory.
        self.weights = weights.detach()
        self.state = state.detach() if state is not None else None

        T = len(self.specs)
        rows = [s.rows for s in self.specs]
        dims = [s.dim for s in self.specs]
        self.dims = tuple(dims)
        self.total_D = sum(dims)
        self._rows = torch.tensor(rows, dtype=torch.int64)
        host = EmbeddingLocation.HOST.value
        self._weights_offsets = torch.tensor([s.weight_offset for s in self.specs], dtype=torch.int64)
        self._weights_placements = torch.full((T,), host, dtype=torch.int32)
        self._D_offsets = torch.tensor([0, *accumulate(dims)], dtype=torch.int32)
        self._hash_size_cumsum = torch.tensor([0, *accumulate(rows)], dtype=torch.int64)
        total_hash_size = sum(rows)
        self._total_hash_size_bits = int(math.log2(float(total_hash_size)) + 1)
        # As the TBE constructor does (max_B = 1).
        self._info_B_num_bits, self._info_B_mask = torch.ops.fbgemm.get_infos_metadata(self._D_offsets, 1, T)
        self._mixed_D = len(set(dims)) > 1
        self._empty_f32 = torch.empty(0, dtype=torch.float32)
        self._lxu_cache_weights = torch.empty(0, 0, dtype=torch.float32)
        self._lxu_cache_locations = torch.empty(0, dtype=torch.int32)
        self._placeholder = torch.zeros(0, dtype=torch.float32, requires_grad=True)
        self._learning_rate = torch.tensor(self.lr, dtype=torch.float32)
        self._vbe = VBEMetadata(B_offsets=None, output_offsets_feature_rank=None,
                                B_offsets_rank_per_feature=None, max_B_feature_rank=-1, max_B=-1, output_size=-1)
        self._optimizer_args = OptimizerArgs(
            stochastic_rounding=False, gradient_clipping=False, max_gradient=1.0, max_norm=0.0,
            eps=self.eps, beta1=0.9, beta2=0.999, weight_decay=0.0, weight_decay_mode=0, eta=0.001,
            momentum=0.9, counter_halflife=-1, adjustment_iter=-1, adjustment_ub=1.0, learning_rate_mode=-1,
            grad_sum_decay=-1, tail_id_threshold=0.0, is_tail_id_thresh_ratio=0, total_hash_size=total_hash_size,
            weight_norm_coefficient=0.0, lower_bound=0.0, regularization_mode=0, use_rowwise_bias_correction=False,
        )
        self._momentum1 = None
        if optimizer == "rowwise_adagrad":
            self._momentum1 = Momentum(
                dev=self._empty_f32, host=self.state, uvm=self._empty_f32,
                offsets=torch.tensor([s.state_offset for s in self.specs], dtype=torch.int64),
                placements=torch.full((T,), host, dtype=torch.int32),
            )

    def __repr__(self) -> str:
        return (f"FusedEmbeddingBags({len(self.specs)} tables, dims={self.dims}, optimizer={self.optimizer!r}, "
                f"lr={self.lr}" + (f", eps={self.eps})" if self.optimizer == "rowwise_adagrad" else ")"))

    def _check_inputs(self, indices: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for name, t in (("indices", indices), ("offsets", offsets)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in _INDEX_DTYPES:
                raise InvalidIdsError(f"{name} must be integers (int64 or int32), got {t.dtype}")
            if t.dim() != 1 or t.device.type != "cpu":
                raise ValueError(f"{name} must be a 1-D CPU tensor, got shape {tuple(t.shape)} on {t.device}")
        T = len(self.specs)
        n_bags = offsets.numel() - 1
        if n_bags < T or n_bags % T:
            raise ValueError(f"offsets must have T*B+1 elements (T={T} tables, batch B >= 1), "
                             f"got {offsets.numel()}")
        B = n_bags // T
        indices = indices.to(torch.int64).contiguous()
        offsets = offsets.to(torch.int64).contiguous()
        first, last = int(offsets[0]), int(offsets[-1])
        if first != 0 or last != indices.numel():
            raise ValueError(f"offsets must run from 0 to len(indices)={indices.numel()}, got {first} .. {last}")
        if bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError("offsets must be non-decreasing")
        if indices.numel():
            # Per-table bounds: an id past its table would read and write another table's rows
            # (or memory outside the tensor), so this check is not optional.
            per_table = offsets[B::B] - offsets[:-1:B]
            limit = torch.repeat_interleave(self._rows, per_table)
            bad = (indices < 0) | (indices >= limit)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                t = int((per_table.cumsum(0) <= i).sum())
                raise InvalidIdsError(f"table {t}: id {int(indices[i])} out of range [0, {self.specs[t].rows}) "
                                      f"at position {i} of indices")
        return indices, offsets

    def __call__(self, indices: torch.Tensor, offsets: torch.Tensor,
                 after_update: Callable[[], None] | None = None) -> torch.Tensor:
        """Pooled (sum) embeddings ``[B, sum(dims)]`` of the bags ``offsets`` cuts ``indices``
        into (key-major, as ``KeyedJaggedTensor.values()/offsets()``). The result requires grad;
        its backward applies the optimizer to the batch's rows of ``weights``/``state`` in place.
        ``after_update``: called by that backward right after the rows have changed (the
        kernel's autograd node feeds a node of ours, whose backward runs after it)."""
        # (on one intra-op thread: a few passes over the batch's ids, between the step's parallel
        # ops; a team of two waited ~5 ms for its member preempted by the prefetch thread, against
        # 0.4 ms alone: memory_pool.threads.intra_op_threads)
        with intra_op_threads(1):
            indices, offsets = self._check_inputs(indices, offsets)
        placeholder = self._placeholder if after_update is None else _AfterUpdate.apply(self._placeholder,
                                                                                         after_update)
        common = CommonArgs(
            placeholder_autograd_tensor=placeholder,
            dev_weights=self._empty_f32,
            host_weights=self.weights,
            uvm_weights=self._empty_f32,
            lxu_cache_weights=self._lxu_cache_weights,
            weights_placements=self._weights_placements,
            weights_offsets=self._weights_offsets,
            D_offsets=self._D_offsets,
            total_D=self.total_D,
            max_D=max(self.dims),
            hash_size_cumsum=self._hash_size_cumsum,
            total_hash_size_bits=self._total_hash_size_bits,
            indices=indices,
            offsets=offsets,
            pooling_mode=int(PoolingMode.SUM),
            indice_weights=None,
            feature_requires_grad=None,
            lxu_cache_locations=self._lxu_cache_locations,
            uvm_cache_stats=None,
            output_dtype=SparseType.FP32.as_int(),
            vbe_metadata=self._vbe,
            is_experimental=False,
            use_uniq_cache_locations_bwd=False,
            use_homogeneous_placements=True,
            learning_rate_tensor=self._learning_rate,
            info_B_num_bits=self._info_B_num_bits,
            info_B_mask=self._info_B_mask,
        )
        if self.optimizer == "sgd":
            return lookup_sgd.invoke(common, self._optimizer_args)
        return lookup_rowwise_adagrad.invoke(common, self._optimizer_args, self._momentum1, mixed_D=self._mixed_D)


class _AfterUpdate(torch.autograd.Function):
    """Identity on the kernel's placeholder input: its backward runs once the kernel's backward
    (the fused optimizer update) has run, and calls ``fn``."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return grad, None


class CachedFusedEmbeddingBags:
    """fbgemm's fused kernels on a DRAM cache arena (:mod:`memory_pool.cache_arena`) instead of
    the pool's arena: for tables whose home is larger than the DRAM budget.

    :meth:`prefetch` (the prefetch thread, in the order the batches will run) reads a planned
    batch's rows into the cache ahead of its step; :meth:`__call__` makes the batch's rows
    resident, translates its ids to slot ids and runs the fused forward on the slots; the fused
    backward updates the slots in place, and then (``after_update``) the rows are written through
    to their home, before the trainer commits the step. Bit-identical to
    :class:`FusedEmbeddingBags` on the pool's arena: the same rows, in the same order, through
    the same kernels."""

    def __init__(self, arena, *, optimizer: str, lr: float, eps: float = 1e-8, table_names=()):
        self.arena = arena
        self.table_names = list(table_names)  # the pool tables that are the groups' homes
        groups = arena.cfg.groups
        adagrad = optimizer == "rowwise_adagrad"
        specs = [FusedTableSpec(g.slots, g.dims[0], arena.offset(0, i), arena.offset(1, i) if adagrad else None)
                 for i, g in enumerate(groups)]
        self.bags = FusedEmbeddingBags(specs, arena.flat[0], optimizer=optimizer, lr=lr, eps=eps,
                                       state=arena.flat[1] if adagrad else None)
        self.dims = self.bags.dims

    def __repr__(self) -> str:
        return f"CachedFusedEmbeddingBags({len(self.arena.groups)} tables, {self.arena.nbytes:,} bytes of DRAM)"

    def numbers_rows_as(self, row_base: torch.Tensor) -> bool:
        """Whether the arena numbers the tables' rows as ``row_base`` does (table ``f``'s row
        ``r`` is ``row_base[f] + r``): then a plan's rows in that numbering go in as they are."""
        return torch.equal(self.arena.row_base, row_base)

    def prefetch(self, rows, flat: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 lengths=None) -> int:
        """A planned batch's distinct rows per table (``flat``: the same in the arena's
        numbering, if the caller has it): returns its sequence number. ``values``, ``lengths``:
        the batch's ids (the very tensor :meth:`__call__` will get) and how many each table has."""
        return self.arena.prefetch(rows, flat, values, lengths)

    def __call__(self, values: torch.Tensor, offsets: torch.Tensor, rows, seq: int | None = None,
                 flat: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled embeddings of a batch (``values``/``offsets`` as the KJT's; ``rows``: its
        sorted distinct rows per table; ``seq``: what :meth:`prefetch` returned, if it was;
        ``flat``: ``rows`` in the arena's numbering, if the caller has it)."""
        T = len(self.arena.groups)
        B = (offsets.numel() - 1) // T
        with intra_op_threads(1):
            lengths = (offsets[B::B] - offsets[:-1:B]).tolist()
        seq, slots = self.arena.begin(rows, values, lengths, seq, flat)
        arena = self.arena
        return self.bags(slots, offsets, after_update=lambda: arena.end(rows, seq, flat))


def bind_cached(pool, tables, states, *, optimizer: str, lr: float, eps: float,
                batch_size: int | None = None) -> CachedFusedEmbeddingBags:
    """A :class:`CachedFusedEmbeddingBags` for ``tables`` (and their optimizer-state tables
    ``states``, None for SGD) of ``pool``, with the pool's DRAM budget (``dram_cache_bytes``)
    split over them; the tables serve their own reads and writes through it from now on
    (``Table.use_cache``). ``batch_size``: refuse a budget too small for one batch of one id
    per sample and table (:class:`~memory_pool.cache_arena.CacheTooSmallError`)."""
    from memory_pool.cache_arena import CacheArena, CacheArenaConfig

    def home(t):
        if t.arena_offset is None:
            return t.view()
        flat = pool.arena_tensor(torch.float32, on_demand=True)  # (rows are readied before reads: ready below)
        a = t.arena_offset // 4
        return flat[a:a + t.num_embeddings * t.embedding_dim].view(t.num_embeddings, t.embedding_dim)

    members = [[t] + ([s] if s is not None else []) for t, s in zip(tables, states)]
    spec = [(t.name, t.num_embeddings, tuple(m.embedding_dim for m in ms)) for t, ms in zip(tables, members)]
    # The rows each group may create instead of read (memory_pool/fresh.py), claimed before any
    # of the tables' memory is handed out below (which would drop an unclaimed table's bitmap).
    # (DLRM_CXL_FRESH=0: every miss read, for an A/B of this rule)
    fresh = [pool.fresh.claim([m.name for m in ms], [m.embedding_dim for m in ms])
             if os.environ.get("DLRM_CXL_FRESH", "1") != "0" else None for ms in members]
    budget = int(pool.dram_cache_bytes or 0) - pool.fresh.nbytes  # (the bitmaps are DRAM of the pool's too)
    # The optimizer state's homes kept in memory, on a journaled tier, when they are small
    # (row-wise Adagrad: 4 bytes a row, 135 MB for kaggle's 8.8 GB): a miss then reads one page
    # from the device (its weights) instead of two (weights and state live in two files, and a
    # miss is alone in its pages) -- the device's random reads are what such a step waits on
    # (tools/bench_beyond_dram.py --device-floor). They are read ahead once, kept by every trim,
    # and taken out of the arena's share of the budget; the budget's measurement counts them.
    # (DLRM_CXL_KEEP_STATE=0: not kept, for an A/B of this rule)
    pinned = [s for s in states if s is not None] if pool.journaled and os.environ.get("DLRM_CXL_KEEP_STATE", "1") != "0" else []
    pinned_bytes = sum(s.region.nbytes for s in pinned)
    if not pinned or pinned_bytes > budget // PINNED_STATE_SHARE or \
            budget - pinned_bytes < CacheArenaConfig.min_budget(spec, batch_size or 1):
        pinned, pinned_bytes = [], 0
    cfg = CacheArenaConfig.for_budget(budget - pinned_bytes, spec, batch_rows=batch_size or 1)
    for s in pinned:
        s.region.keep_cached = True
        s.region.read_ahead()

    def ready(g: int, ids: torch.Tensor) -> None:
        if pool.rows_pending:
            pool.ready([(m, ids) for m in members[g]])

    def peek(g: int, ids: torch.Tensor) -> list | None:
        if not pool.rows_pending:
            return None
        got = [m.pending_values(ids) for m in members[g]]
        return got if any(x is not None for x in got) else None

    # Write-back on a journaled tier: there the working copy is volatile and every window's
    # commit writes its rows' after-images (read through the cache), so the cache need not write
    # a step's rows home -- which, into the private copy-on-write mapping of the images, cost a
    # page fault and a page of memory per row (memory_pool/cache_arena.py, "Durability").
    def advise(g: int, ids: torch.Tensor) -> None:
        for m in members[g]:
            m.region.will_need(ids)

    # Write-back on a direct home too (shm), flushed at every recovery point: each row goes home
    # once a window instead of once a step (memory_pool/cache_writeback.py). Not on real pmem,
    # whose flush would also need cache-line flushes. (DLRM_CXL_DIRECT_WRITE_BACK=0:
    # write-through, for an A/B: tools/bench_beyond_dram.py's shm+cache-wt)
    direct_wb = not pool.journaled and not pool.real_pmem and os.environ.get("DLRM_CXL_DIRECT_WRITE_BACK", "1") != "0"
    arena = CacheArena(cfg, [[home(m) for m in ms] for ms in members], ready=ready, peek=peek,
                       write_back=pool.journaled or direct_wb, flushed_at_recovery_points=direct_wb,
                       fresh=fresh, advise=advise if pool.journaled and os.environ.get("DLRM_CXL_WILLNEED", "1") != "0" else None)
    for g, ms in enumerate(members):
        for i, m in enumerate(ms):
            m.use_cache(arena.member(g, i))
    return CachedFusedEmbeddingBags(arena, optimizer=optimizer, lr=lr, eps=eps,
                                    table_names=[m.name for ms in members for m in ms])
