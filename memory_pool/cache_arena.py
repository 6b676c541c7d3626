"""A DRAM cache arena that fbgemm's fused kernels run on, in front of tables whose home (shm
"CXL" memory, persistent memory, a file) is larger than the DRAM budget.

**Layout.** A *group* is an embedding table together with the tables that share its row index
(its row-wise optimizer state: ``momentum1_host`` of the fused TBE). Each group gets ``slots``
rows of DRAM: one flat float32 tensor per *member position* holds the slots of every group (member
0: the weights, ``[slots, dim]`` per group; member 1: the optimizer state, ``[slots, 1]``), so
that ``CacheArena.flat[m]`` is exactly what the fused TBE takes as ``weights_host`` /
``momentum1_host``, and group ``g`` is table ``g`` at element offset ``offsets[m][g]``. An
``int32`` map per group (one entry per home row: 4 bytes, -1 when not cached) gives the slot of a
row; each slot knows its row and a *stamp* (below). All of it is counted in the budget: the
slots, the maps and the per-slot metadata (:meth:`CacheArenaConfig.for_budget`).

**A step** (``seq``: the planned batch's number, see below):

1. :meth:`CacheArena.begin` — the batch's distinct rows per group are made resident (misses read
   from the home, sorted, into free or evicted slots: with their optimizer state), and the
   batch's ids are translated to slot ids. fbgemm's fused forward and backward then run on
   :attr:`flat` exactly as on the pool's arena, in place: only the batch's slots change.
2. :meth:`CacheArena.end` — right after the fused backward (``FusedEmbeddingBags``' after-update
   hook): the batch's rows, weights and state, are written from their slots to the home
   (**write-through at the end of the step**), then the step's slots may be evicted.

**Durability (the decision, and why).** The home plus the journal is the durable state; the
cache is a working copy that is *never dirty at a step boundary*. Write-through at the end of
every step, not write-back at eviction, because on a direct tier (shm, real pmem) the journal
holds no after-images: recovery restores the home from the before-images of the unfinished steps
and trusts it for every committed one. A row updated by committed step ``k`` and still only in
the cache when the process dies would be lost (its home value predates step ``k``, and no record
has the newer one), and its write-back at a later eviction, in step ``j > k``, would change the
home outside step ``j``'s undo records (``j`` does not touch the row, so logs nothing for it):
a crash in ``j`` could not undo it. With write-through the home changes only between the fused
update and the commit of the step that changed the rows, which is where the uncached fused path
changes it in place: after the write-ahead barrier (the step's before-images are durable), before
``commit``; a crash in between is rolled back from those before-images (direct tiers) or never
reaches durable media (journaled tiers: the working copy is volatile, the commit writes the
after-images). So eviction never writes anything back: an evicted row is equal to its home.

That is also why the checkpointer's row gathers (``MemoryPool.row_gathers``, ``Table.view``, the
digest, export) may read the home for a cached row and get the cache's current value: the home
and the cache differ only inside a step, between the fused update and :meth:`end`, on the
trainer's thread, and no gather runs then — the before-images of step ``k`` are gathered during
its forward (after step ``k-1``'s write-through), the after-images of step ``k`` after its
:meth:`end` (``commit``), and the next step's update waits for them (``persist``). The writes
that go the other way (``Table.scatter_rows``, ``restore_raw``: an aborted step's before-images,
recovery, a bulk load) refresh the slot of a cached row (:class:`CacheMember`), so the cache never
serves a stale row.

**Lookahead (Bagpipe's rule).** :meth:`prefetch` is called with the plans of the batches ahead,
in order, on the prefetch thread: each gets the next ``seq``; its hits are stamped with it and
its misses are read into slots that no running or planned batch needs (stamp below the running
step's), oldest stamp first. A slot needed by a planned batch is never taken by the prefetch; the
step itself may take one (the planned batch furthest ahead first) when nothing else is free,
and the planned batch reads the row again at its turn. A batch that is planned and never trained
(the end of training, a crash) holds its slots only until a later batch begins: the rows it read
are clean, so nothing needs undoing.

**Too many rows.** A batch needing more distinct rows of a table than its group has slots
raises :class:`CacheTooSmallError` (exit 2) naming the table, the rows and the budget that would
do; no automatic split (a split batch would be two optimizer steps, not one: different
arithmetic). A budget too small for one batch of the model is refused before training
(:meth:`CacheArenaConfig.for_budget`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from .errors import CacheTooSmallError, InvalidConfigError
from .threads import intra_op_threads

__all__ = ["CacheGroupConfig", "CacheArenaConfig", "CacheArena", "CacheMember", "CacheStats",
           "CacheTooSmallError", "MAP_BYTES_PER_ROW", "META_BYTES_PER_SLOT"]

MAP_BYTES_PER_ROW = 4        # the int32 row -> slot map
META_BYTES_PER_SLOT = 17     # per slot: its row (int64), its stamp (int64) and its clock bit (bool)
_NEVER = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class CacheGroupConfig:
    """One cached table and its members: ``dims[m]`` floats per row of member ``m`` (the
    weights, then the optimizer state); ``slots`` rows of DRAM for them."""

    name: str
    rows: int
    dims: tuple[int, ...]
    slots: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row, every member (float32)."""
        return 4 * sum(self.dims)

    @property
    def home_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def nbytes(self) -> int:
        """DRAM of the group's cache: slots, map and slot metadata."""
        return self.slots * (self.row_bytes + META_BYTES_PER_SLOT) + self.rows * MAP_BYTES_PER_ROW

    @staticmethod
    def slots_for(budget: int, rows: int, row_bytes: int) -> int:
        """Most slots whose cache (map and metadata included) fits ``budget`` bytes; 0 if none."""
        left = budget - rows * MAP_BYTES_PER_ROW
        return max(0, min(rows, left // (row_bytes + META_BYTES_PER_SLOT)))


@dataclass(frozen=True)
class CacheArenaConfig:
    """The groups of a cache arena and their slots; :class:`CacheArena` owns the memory."""

    groups: tuple[CacheGroupConfig, ...]
    budget_bytes: int

    @classmethod
    def for_budget(cls, budget_bytes: int, tables: Sequence[tuple[str, int, tuple[int, ...]]], *,
                   batch_rows: int = 1) -> "CacheArenaConfig":
        """``tables``: ``(name, rows, member dims)``. Every table first gets the slots of one
        batch (``batch_rows``: the most distinct rows of a table one batch may need -- the batch
        size, with one id per sample and table -- or all its rows, if fewer) and the row map
        every table needs; what is left of the budget is split so that every table caches the
        same fraction of its remaining rows. Raises :class:`CacheTooSmallError` when the
        budget does not hold the maps and one batch (the hint names the budget that would)."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise InvalidConfigError(f"the DRAM budget must be an int >= 0 bytes, got {budget_bytes!r}")
        if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
            raise InvalidConfigError(f"batch_rows must be an int >= 1, got {batch_rows!r}")
        need = cls.min_budget(tables, batch_rows)
        if budget_bytes < need:
            raise CacheTooSmallError(
                f"a DRAM budget of {budget_bytes:,} bytes cannot hold one batch: the {len(tables)} tables' row maps "
                f"and {batch_rows:,} rows of each table (all of a smaller table's) take {need:,} bytes",
                hint=f"raise --dram-cache to at least {_size(need)} (or lower --batch-size)")
        base = [min(rows, batch_rows) for _, rows, _ in tables]
        cost = [4 * sum(dims) + META_BYTES_PER_SLOT for _, _, dims in tables]
        rest = sum((rows - b) * c for (_, rows, _), b, c in zip(tables, base, cost))
        left = budget_bytes - need
        groups = []
        for (name, rows, dims), b, c in zip(tables, base, cost):
            extra = (rows - b) * left // rest if rest else 0
            groups.append(CacheGroupConfig(name, rows, tuple(dims), min(rows, b + extra)))
        return cls(tuple(groups), budget_bytes)

    @staticmethod
    def min_budget(tables: Sequence[tuple[str, int, tuple[int, ...]]], batch_rows: int = 1) -> int:
        """The smallest budget :meth:`for_budget` accepts: every table's row map and
        ``batch_rows`` slots (at most its rows)."""
        return sum(rows * MAP_BYTES_PER_ROW + min(rows, batch_rows) * (4 * sum(dims) + META_BYTES_PER_SLOT)
                   for _, rows, dims in tables)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def members(self) -> int:
        return len(self.groups[0].dims) if self.groups else 0


def _size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{-(-n // (1 << shift))}{unit}"
    return str(n)


@dataclass
class CacheStats:
    """What the cache did since it was made. Rows are distinct rows of a step (a row looked up
    twice in one batch counts once)."""

    steps: int = 0
    rows_needed: int = 0           # distinct rows the steps needed
    hits: int = 0                  # of them, resident when the step began (prefetched ones included)
    misses: int = 0                # read from the home at the step's start (the step waited)
    rows_prefetched: int = 0       # read from the home ahead of their step, by the prefetch thread
    prefetch_skipped: int = 0      # planned batches (x tables) the prefetch left to their step: no free slot
    prefetch_stolen: int = 0       # prefetched rows a step evicted before their batch ran
    evictions: int = 0             # rows dropped from a slot for another (never written back: see the module)
    bytes_read_home: int = 0
    bytes_written_home: int = 0    # write-through at the end of each step
    wait_seconds: float = 0.0      # the step's time in begin(): reading misses, waiting for the prefetch's lock
    write_seconds: float = 0.0     # the step's time writing its rows through to the home
    prefetch_seconds: float = 0.0  # the prefetch thread's time reading rows ahead

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hits / self.rows_needed if self.rows_needed else None
        n = max(self.steps, 1)
        d["wait_ms_per_step"] = 1e3 * self.wait_seconds / n
        d["write_ms_per_step"] = 1e3 * self.write_seconds / n
        d["bytes_read_home_per_step"] = self.bytes_read_home / n
        return d


@dataclass
class _Group:
    cfg: CacheGroupConfig
    homes: list            # [rows, dims[m]] tensors: the home of each member
    slots: list            # [slots, dims[m]] views of the flat tensors
    row_slot: torch.Tensor  # [rows] int32
    slot_row: torch.Tensor  # [slots] int64, -1 free
    stamp: torch.Tensor     # [slots] int64: the newest batch that needs the slot (-1: none)
    ref: torch.Tensor       # [slots] bool: needed again since the clock's hand last passed it
    members: list = field(default_factory=list)
    hand: int = 0           # the clock's hand: the next slot it looks at


class CacheArena:
    """The DRAM slots of :class:`CacheArenaConfig`'s groups; see the module docstring.

    ``homes[g][m]``: the home of member ``m`` of group ``g``, a ``[rows, dims[m]]`` float32
    tensor (the pool's working copy of the table). ``ready(g, ids)``: called before rows ``ids``
    of group ``g`` are read from their homes (an on-demand replay applies its pending rows)."""

    def __init__(self, cfg: CacheArenaConfig, homes: Sequence[Sequence[torch.Tensor]],
                 ready: Callable[[int, torch.Tensor], None] | None = None):
        if not cfg.groups:
            raise InvalidConfigError("a cache arena needs at least one table")
        if len({len(g.dims) for g in cfg.groups}) != 1:
            raise InvalidConfigError("every table of a cache arena needs the same members (weights, state)")
        self.cfg = cfg
        self.stats = CacheStats()
        self._ready = ready
        self._lock = threading.RLock()
        M = cfg.members
        self.offsets: list[list[int]] = [[0] * len(cfg.groups) for _ in range(M)]
        totals = [0] * M
        for gi, g in enumerate(cfg.groups):
            for m in range(M):
                self.offsets[m][gi] = totals[m]
                totals[m] += g.slots * g.dims[m]
        # np.empty: a slot's pages are touched (resident) only once a row is read into it. Two
        # tensors over the same memory: ``flat`` for the kernels, ``_work`` for the cache's own
        # copies. fbgemm's autograd node saves ``flat`` and checks at the backward that its
        # version did not change since the forward; the prefetch thread writes other slots of the
        # same memory meanwhile (never the step's), which must not count as a change of it.
        mem = [np.empty(max(n, 1), dtype=np.float32) for n in totals]
        self.flat: list[torch.Tensor] = [torch.from_numpy(a) for a in mem]
        self._work: list[torch.Tensor] = [torch.from_numpy(a) for a in mem]
        self.groups: list[_Group] = []
        base = [0]
        # One row -> slot map over every group (each group's map is a view of it): one gather
        # translates a whole batch.
        self._map = torch.full((sum(g.rows for g in cfg.groups),), -1, dtype=torch.int32)
        # Per slot, over every group (each group's are views): its stamp and its clock bit; one
        # scatter stamps a whole batch's hits.
        self._stamp = torch.full((sum(g.slots for g in cfg.groups),), -1, dtype=torch.int64)
        self._ref = torch.zeros(self._stamp.numel(), dtype=torch.bool)
        sbase = [0]
        for gi, g in enumerate(cfg.groups):
            hs = list(homes[gi])
            for m, h in enumerate(hs):
                if tuple(h.shape) != (g.rows, g.dims[m]) or h.dtype != torch.float32:
                    raise InvalidConfigError(f"table {g.name!r}: member {m}'s home is {tuple(h.shape)} {h.dtype}, "
                                             f"expected ({g.rows}, {g.dims[m]}) float32")
            slots = [self._work[m][self.offsets[m][gi]:self.offsets[m][gi] + g.slots * g.dims[m]].view(g.slots, g.dims[m])
                     for m in range(M)]
            self.groups.append(_Group(g, hs, slots, self._map[base[-1]:base[-1] + g.rows],
                                      torch.full((g.slots,), -1, dtype=torch.int64),
                                      self._stamp[sbase[-1]:sbase[-1] + g.slots],
                                      self._ref[sbase[-1]:sbase[-1] + g.slots]))
            base.append(base[-1] + g.rows)
            sbase.append(sbase[-1] + g.slots)
        self._row_base = torch.tensor(base, dtype=torch.int64)
        self._slot_base = torch.tensor(sbase, dtype=torch.int64)
        self._whole = self._layout_whole()
        self._next_seq = 0
        self._floor = 0          # slots stamped below this are needed by no running or planned batch
        self._running: int | None = None

    # -- description
    @property
    def nbytes(self) -> int:
        return self.cfg.nbytes

    @property
    def row_base(self) -> torch.Tensor:
        """``[groups + 1]``: group ``g``'s row ``r`` is row ``row_base[g] + r`` of the arena's numbering."""
        return self._row_base

    def offset(self, member: int, group: int) -> int:
        """Element offset of group ``group`` in :attr:`flat` ``[member]``."""
        return self.offsets[member][group]

    def resident(self, group: int) -> int:
        return int((self.groups[group].slot_row >= 0).sum())

    def member(self, group: int, member: int) -> "CacheMember":
        """The view a pool :class:`~memory_pool.table.Table` serves its rows through."""
        return CacheMember(self, group, member)

    def _layout_whole(self) -> list | None:
        """Per member: ``(home rows, cache slots, home row of each group's row 0 minus its row
        base, slot row of each group's slot 0)`` when every group's home is a row-aligned view of
        one tensor (the pool's arena) and every group has the same width: then a batch's rows of
        every group are copied with one gather and one scatter (:meth:`end`), not two per group.
        None otherwise (one copy per group)."""
        out = []
        for m in range(self.cfg.members):
            homes = [g.homes[m] for g in self.groups]
            dim = homes[0].shape[1]
            h0 = homes[0]
            if any(h.shape[1] != dim or not h.is_contiguous() or h.storage_offset() % dim
                   or h.untyped_storage().data_ptr() != h0.untyped_storage().data_ptr() for h in homes):
                return None
            n = h0.untyped_storage().nbytes() // (4 * dim)
            whole = torch.as_strided(h0, (n, dim), (dim, 1), 0)
            slots = self.flat[m][:self.flat[m].numel() - self.flat[m].numel() % dim].view(-1, dim)
            if any(o % dim for o in self.offsets[m]):
                return None
            hdelta = torch.tensor([h.storage_offset() // dim for h in homes], dtype=torch.int64) - self._row_base[:-1]
            sdelta = torch.tensor([o // dim for o in self.offsets[m]], dtype=torch.int64)
            out.append((whole, slots, hdelta, sdelta))
        return out

    def _flat_rows(self, rows: Sequence[torch.Tensor], flat: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's rows of every group in :attr:`row_base`'s numbering (``flat``, if the caller
        has it already) and the rows per group."""
        counts = torch.tensor([ids.numel() for ids in rows], dtype=torch.int64)
        if flat is None:
            flat = torch.cat([ids + self._row_base[gi] for gi, ids in enumerate(rows)]) if rows else \
                torch.empty(0, dtype=torch.int64)
        return flat, counts

    # -- the steps
    def prefetch(self, rows: Sequence[torch.Tensor], flat: torch.Tensor | None = None) -> int:
        """A planned batch (``rows[g]``: its sorted distinct rows of group ``g``; ``flat``: the
        same in one numbering, see :meth:`_flat_rows`): returns its ``seq`` and reads the rows it
        misses into slots no running or planned batch needs, if there are enough (else its step
        reads them). Call in the order the batches will run."""
        t0 = time.perf_counter()
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            _, read, skipped = self._admit_all(rows, flat, seq, steal=False)
            self.stats.rows_prefetched += read
            self.stats.prefetch_skipped += skipped
        self.stats.prefetch_seconds += time.perf_counter() - t0
        return seq

    def begin(self, rows: Sequence[torch.Tensor], values: torch.Tensor, lengths: Sequence[int],
              seq: int | None = None, flat: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        """Step of batch ``seq`` (None: not prefetched) begins: every row of ``rows`` resident;
        returns (its seq, ``values`` -- the ids of every group, concatenated, ``lengths[g]`` of
        group ``g`` -- as slot ids). Raises :class:`CacheTooSmallError` (nothing changed) when a group needs more rows
        than it has slots."""
        t0 = time.perf_counter()
        for gi, ids in enumerate(rows):
            g = self.cfg.groups[gi]
            if ids.numel() > g.slots:
                raise CacheTooSmallError(
                    f"a batch needs {ids.numel():,} distinct rows of table {g.name!r}, but its DRAM cache has "
                    f"{g.slots:,} slots (budget {self.cfg.budget_bytes:,} bytes)",
                    hint=f"raise --dram-cache to at least "
                         f"{_size(CacheArenaConfig.min_budget([(x.name, x.rows, x.dims) for x in self.cfg.groups], ids.numel()))}"
                         f" (or lower --batch-size)")
        # (one intra-op thread: these small copies run while the prefetch thread holds a core;
        # a team of two waits for its preempted member: memory_pool.threads.intra_op_threads)
        with self._lock, intra_op_threads(1):
            if seq is None:
                seq = self._next_seq
                self._next_seq += 1
            self._floor = seq
            self._running = seq
            needed, misses, _ = self._admit_all(rows, flat, seq, steal=True)
            st = self.stats
            st.steps += 1
            st.rows_needed += needed
            st.hits += needed - misses
            st.misses += misses
            shifted = values + torch.repeat_interleave(self._row_base[:-1], torch.as_tensor(lengths))
            slots = self._map.index_select(0, shifted).to(torch.int64)
        self.stats.wait_seconds += time.perf_counter() - t0
        return seq, slots

    def end(self, rows: Sequence[torch.Tensor], seq: int, flat: torch.Tensor | None = None) -> None:
        """After the fused update of batch ``seq``: its rows, every member, written from their
        slots to the home (write-through), then its slots may be evicted."""
        t0 = time.perf_counter()
        n = 0
        # (on torch's threads: scattered stores into the home, latency-bound, gain from two)
        n = self._write_through(rows, flat)
        with self._lock:
            if self._running == seq:
                self._running = None
                self._floor = seq + 1
        self.stats.bytes_written_home += n
        self.stats.write_seconds += time.perf_counter() - t0

    def _write_through(self, rows: Sequence[torch.Tensor], flat: torch.Tensor | None) -> int:
        n = 0
        if self._whole is not None:
            # One gather and one scatter per member for every group's rows.
            flat, counts = self._flat_rows(rows, flat)
            if flat.numel():
                slot = self._map.index_select(0, flat).to(torch.int64)
                for whole, slots, hdelta, sdelta in self._whole:
                    src = slots.index_select(0, slot + torch.repeat_interleave(sdelta, counts))
                    whole.index_copy_(0, flat + torch.repeat_interleave(hdelta, counts), src)
                    n += src.numel() * 4
        else:
            for gi, ids in enumerate(rows):
                if not ids.numel():
                    continue
                g = self.groups[gi]
                slot = g.row_slot.index_select(0, ids).to(torch.int64)
                for h, s in zip(g.homes, g.slots):
                    h.index_copy_(0, ids, s.index_select(0, slot))
                    n += ids.numel() * s.shape[1] * 4
        return n

    def abandon(self, seq: int) -> None:
        """Batch ``seq``'s step failed before its update: its slots are free again."""
        with self._lock:
            if self._running == seq:
                self._running = None
                self._floor = seq + 1

    # -- admission (under the lock)
    def _admit_all(self, rows: Sequence[torch.Tensor], flat: torch.Tensor | None, seq: int, *,
                   steal: bool) -> tuple[int, int, int]:
        """Every group's rows ``rows[g]`` resident and stamped ``seq``: the hits of all groups
        stamped with one scatter, then each group with misses admits them (:meth:`_admit`).
        Returns (rows needed, rows read from the home, groups skipped: ``not steal`` and no free
        slot for their misses)."""
        flat, counts = self._flat_rows(rows, flat)
        if not flat.numel():
            return 0, 0, 0
        local = self._map.index_select(0, flat)
        hit = local >= 0
        gslot = local.to(torch.int64) + torch.repeat_interleave(self._slot_base[:-1], counts)
        hs = gslot[hit]
        if hs.numel():
            # A planned or running batch needs them (never evicted while it does), and they were
            # needed again: the clock passes them over once (second chance).
            self._stamp[hs] = torch.clamp(self._stamp[hs], min=seq)
            self._ref[hs] = True
        missed = flat[~hit]
        if not missed.numel():
            return flat.numel(), 0, 0
        cut = torch.searchsorted(missed, self._row_base).tolist()
        read = skipped = 0
        for gi in range(len(self.groups)):
            if cut[gi + 1] > cut[gi]:
                k = self._admit(gi, missed[cut[gi]:cut[gi + 1]] - self._row_base[gi], seq, steal=steal, batch=rows[gi])
                skipped, read = (skipped + 1, read) if k < 0 else (skipped, read + k)
        return flat.numel(), read, skipped

    def _admit(self, gi: int, miss: torch.Tensor, seq: int, *, steal: bool, batch: torch.Tensor) -> int:
        """Rows ``miss`` (sorted, distinct, none resident) of group ``gi`` read into slots and
        stamped ``seq``; returns their number, or -1 when ``not steal`` and no slot is free for
        them (then nothing is read). ``batch``: all of the batch's rows of the group."""
        g = self.groups[gi]
        m = miss.numel()
        victims = self._victims(g, m)
        if victims is None:
            if not steal:
                return -1
            # Nothing free enough: rows of the planned batch furthest ahead (never this batch's).
            stamp = g.stamp
            key = torch.where(stamp < self._floor, stamp,
                              torch.where(stamp == seq, _NEVER, (1 << 62) - stamp))
            mine = g.row_slot.index_select(0, batch).to(torch.int64)
            key[mine[mine >= 0]] = _NEVER  # (this batch's resident rows, whatever their stamp)
            victims = torch.topk(key, m, largest=False, sorted=False).indices
            if bool((key[victims] == _NEVER).any()):  # (begin() checked the count: not reached)
                raise CacheTooSmallError(f"table {g.cfg.name!r}: no free cache slot")
            self.stats.prefetch_stolen += int((stamp[victims] >= self._floor).sum())
        victims, _ = torch.sort(victims)  # (slots in order: the reads below go to ascending addresses)
        old = g.slot_row[victims]
        was = old >= 0
        if bool(was.any()):
            g.row_slot[old[was]] = -1
            self.stats.evictions += int(was.sum())
        if self._ready is not None:
            self._ready(gi, miss)
        for h, s in zip(g.homes, g.slots):
            # miss is sorted: the home is read in ascending order
            s.index_copy_(0, victims, h.index_select(0, miss))
            self.stats.bytes_read_home += m * s.shape[1] * 4
        g.slot_row[victims] = miss
        g.row_slot[miss] = victims.to(torch.int32)
        g.stamp[victims] = seq
        g.ref[victims] = False
        return m

    def _victims(self, g: "_Group", m: int) -> torch.Tensor | None:
        """``m`` slots of group ``g`` that no running or planned batch needs (Bagpipe's rule),
        chosen by a clock (CLOCK, second chance: a slot needed again since the hand last passed
        it is passed over once, and loses its bit), in chunks from the hand: O(m) a step, not
        O(slots) (a scan of every stamp: ~9 ms a step on `small`, far more on `kaggle`'s 8.4 M
        slots). None when two turns of the hand find fewer than ``m``."""
        S = g.stamp.numel()
        floor = self._floor
        found: list[torch.Tensor] = []
        need, looked = m, 0
        while need and looked < 2 * S:
            lo = g.hand
            n = min(S - lo, max(4 * need, 4096))
            ok = (g.stamp[lo:lo + n] < floor) & ~g.ref[lo:lo + n]
            idx = ok.nonzero().squeeze(1)
            if idx.numel() >= need:
                idx = idx[:need]
                last = int(idx[-1]) + 1
            else:
                last = n
            g.ref[lo:lo + last] = False
            g.hand = (lo + last) % S
            idx = idx + lo
            found.append((idx, g.stamp[idx]))
            # (taken: not eligible again if the hand comes round a second time)
            g.stamp[idx] = _NEVER
            need -= idx.numel()
            looked += last
        for idx, old in found:
            g.stamp[idx] = old  # (the caller stamps the victims it uses)
        return None if need else torch.cat([idx for idx, _ in found])

    # -- the pool's own reads and writes of cached tables (CacheMember)
    def read_rows(self, gi: int, member: int, ids: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        g = self.groups[gi]
        with self._lock:
            slot = g.row_slot.index_select(0, ids).to(torch.int64)
            hit = slot >= 0
            s, h = g.slots[member], g.homes[member]
            rb = s.shape[1] * 4
            if bool(hit.all()):
                return s.index_select(0, slot), ids.numel() * rb, 0
            out = h.index_select(0, ids)
            if bool(hit.any()):
                out[hit] = s.index_select(0, slot[hit])
            n_home = int((~hit).sum())
            return out, (ids.numel() - n_home) * rb, n_home * rb

    def write_rows_through(self, gi: int, member: int, ids: torch.Tensor, values: torch.Tensor) -> None:
        g = self.groups[gi]
        with self._lock:
            slot = g.row_slot.index_select(0, ids).to(torch.int64)
            cached = slot >= 0
            if bool(cached.any()):
                g.slots[member][slot[cached]] = values[cached].to(torch.float32)

    def invalidate(self, gi: int) -> None:
        """Forget every cached row of group ``gi`` (its home was replaced: a bulk load)."""
        g = self.groups[gi]
        with self._lock:
            g.row_slot.fill_(-1)
            g.slot_row.fill_(-1)
            g.stamp.fill_(-1)
            g.ref.fill_(False)
            g.hand = 0


class CacheMember:
    """How a pool table reads and writes its rows while a :class:`CacheArena` caches them
    (``Table.use_cache``): reads of cached rows come from their slots, the rest from the home
    (nothing is admitted: only steps admit rows); a write to the home refreshes the row's slot.
    The interface of :class:`memory_pool.cache.RowCache`."""

    def __init__(self, arena: CacheArena, group: int, member: int):
        self.arena = arena
        self.group = group
        self.member = member
        self.hits = 0
        self.misses = 0

    @property
    def capacity(self) -> int:
        return self.arena.cfg.groups[self.group].slots

    @property
    def nbytes(self) -> int:
        return self.arena.cfg.groups[self.group].nbytes if self.member == 0 else 0

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """Rows ``ids`` (duplicates allowed). Returns (rows, bytes from DRAM, bytes from home)."""
        out, b_dram, b_home = self.arena.read_rows(self.group, self.member, ids)
        rb = out.shape[1] * out.element_size() if out.dim() == 2 else 4
        self.hits += b_dram // max(rb, 1)
        self.misses += b_home // max(rb, 1)
        return out, b_dram, b_home

    def write_through(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Rows ``ids`` were just written to the home: refresh their slots."""
        self.arena.write_rows_through(self.group, self.member, ids, values)

    def reset(self, home: torch.Tensor) -> "CacheMember":
        """The whole table was replaced at home (a bulk load): nothing cached is valid."""
        self.arena.invalidate(self.group)
        return self
