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
   from the home, sorted, into free or evicted slots: with their optimizer state; a miss of a
   row never written since its initialisation is created from the initializer instead, no read:
   ``memory_pool/fresh.py``), and the
   batch's ids are translated to slot ids. fbgemm's fused forward and backward then run on
   :attr:`flat` exactly as on the pool's arena, in place: only the batch's slots change.
2. :meth:`CacheArena.end` — right after the fused backward (``FusedEmbeddingBags``' after-update
   hook): the batch's rows, weights and state, are marked dirty in their slots (a write-through
   arena writes them home instead), then the step's slots may be evicted.

**Durability.** The home plus the journal is the durable state; the cache is a working copy, and
a crash loses it whole. What a dirty slot means, and when it goes home, depends on the home
(``memory_pool/cache_writeback.py`` has the reasons and the measurements):

* **a direct home (shm), write-back flushed at recovery points** (``flushed_at_recovery_points``):
  every dirty slot is written home at each recovery point, before its commit
  (``MemoryPool.flush_caches``, called by the checkpointer), and by an eviction in between;
* **a journaled home (emulated pmem, power-sim), write-back**: the home is itself a volatile
  working copy, and every window's commit journals its rows' after-images, read through the
  cache (``Table.current_rows``);
* **write-through** (real pmem, whose flush would need its cache-line flushes too; or
  ``DLRM_CXL_DIRECT_WRITE_BACK=0`` on shm, for an A/B): the step's rows are written home at its
  end, so the home and the cache differ only inside a step.

Readers of a home behind a write-back arena read it through the cache (``Table.current_rows``,
``snapshot``) or flush it first (``Table.view``: the digest, a state dict, export; :meth:`flush`).
The writes that go the other way (``Table.scatter_rows``, ``restore_raw``: an aborted step's
before-images, recovery, a bulk load) refresh the slot of a cached row (:class:`CacheMember`), so
the cache never serves a stale row.

**Lookahead (Bagpipe's rule).** :meth:`prefetch` is called with the plans of the batches ahead,
in order, on the prefetch thread: each gets the next ``seq``; its hits are stamped with it and
its misses are read into slots that no running or planned batch needs (stamp below the running
step's), oldest stamp first. A slot needed by a planned batch is never taken by the prefetch; the
step itself may take one (the planned batch furthest ahead first) when nothing else is free,
and the planned batch reads the row again at its turn. A batch whose every row the prefetch made
resident, with no such steal since, begins without looking its rows up again: its step only
translates its ids (measured on `kaggle` at a quarter: 2.2 -> 0.9 ms of the step's own thread).
A batch that is planned and never trained
(the end of training, a crash) holds its slots only until a later batch begins: the rows it read
are clean, so nothing needs undoing.

**Too many rows.** A batch needing more distinct rows of a table than its group has slots
raises :class:`CacheTooSmallError` (exit 2) naming the table, the rows and the budget that would
do; no automatic split (a split batch would be two optimizer steps, not one: different
arithmetic). A budget too small for one batch of the model is refused before training
(:meth:`CacheArenaConfig.for_budget`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from .cache_config import (MAP_BYTES_PER_ROW, META_BYTES_PER_SLOT, CacheArenaConfig, CacheGroupConfig, CacheStats,
                           budget_size)
from .cache_clock import NEVER, clock_victims
from .cache_member import CacheMember
from .cache_writeback import WriteBackSlots
from .errors import CacheTooSmallError, InvalidConfigError
from .threads import intra_op_threads

__all__ = ["CacheGroupConfig", "CacheArenaConfig", "CacheArena", "CacheMember", "CacheStats",
           "CacheTooSmallError", "MAP_BYTES_PER_ROW", "META_BYTES_PER_SLOT"]

# A write-back group's dirtiness counts (dirty_fraction) only from this size of home: below it
# its evicted dirty rows share pages (`kaggle` at a quarter: the groups past this are 6 tables of
# 71 MiB to 2.5 GiB; the 8 others that evict have 0.5-35 MiB and are mostly dirty all the time).
DIRTY_FROM_HOME_BYTES = 64 << 20


@dataclass
class _Group:
    cfg: CacheGroupConfig
    homes: list            # [rows, dims[m]] tensors: the home of each member
    slots: list            # [slots, dims[m]] views of the flat tensors
    row_slot: torch.Tensor  # [rows] int32
    slot_row: torch.Tensor  # [slots] int64, -1 free
    stamp: torch.Tensor     # [slots] int64: the newest batch that needs the slot (-1: none)
    ref: torch.Tensor       # [slots] bool: needed again since the clock's hand last passed it
    dirty: torch.Tensor     # [slots] bool: newer than the home (write-back arenas only)
    members: list = field(default_factory=list)
    hand: int = 0           # the clock's hand: the next slot it looks at
    untouched: bool = True  # no slot from the hand on ever held a row (the hand has not gone round)


class CacheArena(WriteBackSlots):
    """The DRAM slots of :class:`CacheArenaConfig`'s groups; see the module docstring.

    ``homes[g][m]``: the home of member ``m`` of group ``g``, a ``[rows, dims[m]]`` float32
    tensor (the pool's working copy of the table). ``ready(g, ids)``: called before rows ``ids``
    of group ``g`` are read from their homes (an on-demand replay applies its pending rows);
    ``advise(g, ids)`` then (a file's reads started ahead: ``Region.will_need``).
    ``write_back``, ``flushed_at_recovery_points`` (a direct home's write-back arena): see the
    module. ``fresh[g]``: group ``g``'s rows still at their initial
    value, which a miss creates in its slot instead of reading (``memory_pool/fresh.py``).
    ``peek(g, ids)``: per member, ``(mask, values)`` of the rows not applied to the home yet
    (``Table.pending_values``), which a miss takes into its slot instead of ``ready``."""

    def __init__(self, cfg: CacheArenaConfig, homes: Sequence[Sequence[torch.Tensor]],
                 ready: Callable[[int, torch.Tensor], None] | None = None, *, write_back: bool = False,
                 peek: Callable[[int, torch.Tensor], list | None] | None = None,
                 advise: Callable[[int, torch.Tensor], None] | None = None, fresh: Sequence | None = None,
                 flushed_at_recovery_points: bool = False):
        if not cfg.groups:
            raise InvalidConfigError("a cache arena needs at least one table")
        if len({len(g.dims) for g in cfg.groups}) != 1:
            raise InvalidConfigError("every table of a cache arena needs the same members (weights, state)")
        self.cfg = cfg
        self.stats = CacheStats()
        self._ready = ready
        self._peek = peek
        self._advise = advise
        self._fresh = list(fresh) if fresh is not None else [None] * len(cfg.groups)
        self.write_back = bool(write_back)
        # (a direct home's write-back: flushed at every recovery point, see cache_writeback.py)
        self.flushed_at_recovery_points = self.write_back and bool(flushed_at_recovery_points)
        self._init_ends()   # (the lock: WriteBackSlots)
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
        self._dirty = torch.zeros(self._stamp.numel(), dtype=torch.bool)
        if self.lists_spilled:   # (the batch that last changed each slot: clean_through)
            self._changed = torch.full((self._stamp.numel(),), -1, dtype=torch.int32)
        self._slot_row = torch.full((self._stamp.numel(),), -1, dtype=torch.int64)   # (each group's slot_row: a view)
        self._ndirty = [0] * len(cfg.groups)  # dirty slots per group
        # Per group, the rows written into the home (write-back arenas: dirty rows evicted or
        # flushed, and the pool's own writes, CacheMember.write_through) since take_spilled().
        self._spilled: list[list[torch.Tensor]] = [[] for _ in cfg.groups]
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
                                      self._slot_row[sbase[-1]:sbase[-1] + g.slots],
                                      self._stamp[sbase[-1]:sbase[-1] + g.slots],
                                      self._ref[sbase[-1]:sbase[-1] + g.slots],
                                      self._dirty[sbase[-1]:sbase[-1] + g.slots]))
            base.append(base[-1] + g.rows)
            sbase.append(sbase[-1] + g.slots)
        self._row_base = torch.tensor(base, dtype=torch.int64)
        self._slot_base = torch.tensor(sbase, dtype=torch.int64)
        self._whole = self._layout_whole()
        self._next_seq, self._running = 0, None
        self._floor = 0          # slots stamped below this are needed by no running or planned batch
        # Planned batches whose every row the prefetch made resident (begin then only translates
        # their ids), with the rows list it was given (begin checks that it gets the same one),
        # and a count of the steals and invalidations that may have taken one of their slots
        # since (each empties it: below).
        self._complete: dict[int, tuple] = {}   # (with the ids given, and their slots: _translate)
        self._takings = 0
        self._end_slots: tuple | None = None   # (seq, its rows' slots in one numbering): begin -> end

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
            h0, dim = homes[0], homes[0].shape[1]
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
    def prefetch(self, rows: Sequence[torch.Tensor], flat: torch.Tensor | None = None,
                 values: torch.Tensor | None = None, lengths: Sequence[int] | None = None) -> int:
        """A planned batch (``rows[g]``: its sorted distinct rows of group ``g``; ``flat``: the
        same in one numbering, see :meth:`_flat_rows`): returns its ``seq`` and reads the rows it
        misses into slots no running or planned batch needs, if there are enough (else its step
        reads them). Call in the order the batches will run. ``values``, ``lengths``: the ids
        :meth:`begin` will be given (the same tensor), translated to slots here when every row
        is resident, off the step's thread."""
        t0 = time.perf_counter()
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            takings = self._takings
            _, missed, cut = self._stamp_hits(rows, flat, seq)
        # The lock is let go between groups: a step that begins meanwhile waits for one group's
        # reads, not the batch's (~11 ms a batch on `kaggle` at a quarter, of which its steps
        # waited ~2 ms each). Rows that step made resident in between are stamped, not read.
        read, skipped = self._admit_groups(rows, missed, cut, seq, steal=False, recheck=True)
        if not skipped:
            # The step's translation, now (~1 ms of the step's thread on `kaggle`), outside the
            # lock: the rows keep their slots but for a steal or an invalidation (``_takings``).
            pre = self._translate(rows, flat, values, lengths) if values is not None else None
            with self._lock:
                # Every row resident and stamped ``seq``: only a steal (a step's, of a planned
                # batch's slot) or an invalidation evicts it before its step, and none came since
                # this batch was stamped (the lock was let go between groups).
                if self._takings == takings and seq >= self._floor:
                    self._complete[seq] = (rows, values, pre)
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
                         f"{budget_size(CacheArenaConfig.min_budget([(x.name, x.rows, x.dims) for x in self.cfg.groups], ids.numel()))}"
                         f" (or lower --batch-size)")
        done = self._complete.get(seq) if seq is not None else None
        if done is not None and done[0] is rows and done[1] is values and done[2] is not None:
            # Resident, stamped ``seq`` and translated by the prefetch: no lock to wait for. Only
            # this thread (a step's steal, an invalidation) evicts a planned batch's slot, and a
            # lagging floor protects more; the next holder of the lock settles the rest.
            self._ended_step(seq, None, began=flat.numel() if flat is not None else sum(i.numel() for i in rows))
            self._end_slots = (seq, done[2][1])
            self.stats.wait_seconds += time.perf_counter() - t0
            return seq, done[2][0]
        # (one intra-op thread: these small copies run while the prefetch thread holds a core;
        # a team of two waits for its preempted member: memory_pool.threads.intra_op_threads)
        with self._lock, intra_op_threads(1):
            if seq is None:
                seq = self._next_seq
                self._next_seq += 1
            self._floor = seq
            self._running = seq
            done = self._complete.get(seq)
            pre = None
            if done is not None and done[0] is rows:
                # (the prefetch made every row resident and stamped it: nothing to look up, 1.5-2
                # ms of the step's own thread on `kaggle`; its admissions set the rows' ref bits,
                # as the lookup here would have)
                needed = flat.numel() if flat is not None else sum(ids.numel() for ids in rows)
                misses = 0
                if done[1] is values and done[2] is not None:
                    pre = done[2]   # (and the ids translated already: the same tensor, the same slots)
            else:
                needed, missed, cut = self._stamp_hits(rows, flat, seq)
                misses, _ = self._admit_groups(rows, missed, cut, seq, steal=True, recheck=False)
            self._complete = {s: r for s, r in self._complete.items() if s > seq}
            st = self.stats
            st.steps += 1
            st.rows_needed += needed
            st.hits += needed - misses
            st.misses += misses
            if pre is None:
                pre = self._translate(rows, flat, values, lengths)
            self._end_slots = (seq, pre[1])
        self.stats.wait_seconds += time.perf_counter() - t0
        return seq, pre[0]

    def _translate(self, rows: Sequence[torch.Tensor], flat: torch.Tensor | None, values: torch.Tensor,
                   lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(Every row of the batch resident.) ``values`` (``lengths[g]`` ids of group ``g``,
        concatenated) as slot ids of each group, int64; and, for a write-back arena, the batch's
        distinct rows as slots in the arena's one numbering (what :meth:`end` marks dirty)."""
        shifted = values + torch.repeat_interleave(self._row_base[:-1], torch.as_tensor(lengths))
        slots = self._map.index_select(0, shifted).to(torch.int64)
        return slots, self._gslots(rows, flat) if self.write_back else None

    def _gslots(self, rows: Sequence[torch.Tensor], flat: torch.Tensor | None) -> torch.Tensor:
        flat, counts = self._flat_rows(rows, flat)
        return self._map.index_select(0, flat).to(torch.int64) + torch.repeat_interleave(self._slot_base[:-1], counts)

    def end(self, rows: Sequence[torch.Tensor], seq: int, flat: torch.Tensor | None = None) -> None:
        """After the fused update of batch ``seq``: its rows, every member, written from their
        slots to the home (write-through), or, in a write-back arena, marked dirty; then its
        slots may be evicted."""
        t0 = time.perf_counter()
        n = 0
        gslot = None
        if self.write_back:
            # (the slots begin or the prefetch found: stamped ``seq``, kept until the floor passes)
            es, gslot = self._end_slots or (None, None)
            if es != seq or gslot is None:
                with self._lock, intra_op_threads(1):
                    gslot = self._gslots(rows, flat)
        else:
            # (on torch's threads: scattered stores into the home, latency-bound, gain from two)
            n = self._write_through(rows, flat)
        # The dirty marks and the floor: settled by the next holder of the lock, not waited for.
        self._ended_step(seq, gslot)
        self.stats.bytes_written_home += n
        self.stats.write_seconds += time.perf_counter() - t0

    def _write_through(self, rows: Sequence[torch.Tensor], flat: torch.Tensor | None) -> int:
        n = 0
        if self._whole is not None:
            flat, counts = self._flat_rows(rows, flat)
            if flat.numel():
                gi = torch.repeat_interleave(torch.arange(len(self.groups)), counts)
                n = self._whole_to_home(flat, gi, self._map.index_select(0, flat).to(torch.int64))
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

    def _whole_to_home(self, flat: torch.Tensor, gi: torch.Tensor, slot: torch.Tensor) -> int:
        """Rows ``flat`` (:meth:`_flat_rows`' numbering) of groups ``gi``, every member, from their
        slots ``slot`` (each in its group) to the home: one gather and one scatter per member for
        every group's rows (``_whole``; the write-through and a recovery point's flush). Returns
        the bytes written."""
        n = 0
        for whole, slots, hdelta, sdelta in self._whole:
            whole.index_copy_(0, flat + hdelta.index_select(0, gi), slots.index_select(0, slot + sdelta.index_select(0, gi)))
            n += flat.numel() * slots.shape[1] * 4
        return n

    def abandon(self, seq: int) -> None:
        """Batch ``seq``'s step failed before its update: its slots are free again."""
        with self._lock:
            if self._running == seq:
                self._running = None
                self._floor = seq + 1

    # -- admission (under the lock)
    def _admit_groups(self, rows, missed: torch.Tensor, cut: list[int], seq: int, *, steal: bool,
                      recheck: bool) -> tuple[int, int]:
        """Each group's rows of ``missed`` (from :meth:`_stamp_hits`) read into slots stamped
        ``seq`` (:meth:`_admit`), the lock taken per group (reentrant: ``begin`` holds it
        throughout); ``recheck``: rows a step admitted since are stamped, not read
        (:meth:`_still_missing`). Returns (rows read, groups skipped: ``not steal`` and no
        free slot for their misses)."""
        read = skipped = 0
        for gi in range(len(self.groups)):
            if cut[gi + 1] > cut[gi]:
                with self._lock:
                    miss = missed[cut[gi]:cut[gi + 1]] - self._row_base[gi]
                    if recheck:
                        miss = self._still_missing(gi, miss, seq)
                    k = self._admit(gi, miss, seq, steal=steal, batch=rows[gi]) if miss.numel() else 0
                skipped, read = (skipped + 1, read) if k < 0 else (skipped, read + k)
        return read, skipped

    def _stamp_hits(self, rows: Sequence[torch.Tensor], flat: torch.Tensor | None,
                    seq: int) -> tuple[int, torch.Tensor, list[int]]:
        """The resident rows of ``rows`` stamped ``seq``; returns (rows needed, the others in
        :attr:`row_base`'s numbering, where each group's begin among them)."""
        flat, counts = self._flat_rows(rows, flat)
        if not flat.numel():
            return 0, flat, [0] * (len(self.groups) + 1)
        local = self._map.index_select(0, flat)
        hit = local >= 0
        gslot = local.to(torch.int64) + torch.repeat_interleave(self._slot_base[:-1], counts)
        hs = torch.masked_select(gslot, hit)  # (masked_select: t[mask] is 2.5x slower)
        if hs.numel():
            # A planned or running batch needs them (never evicted while it does), and they were
            # needed again: the clock passes them over once (second chance).
            # (index_select/_copy_/_fill_, not t[idx]: that gathers 16k slots in 160 us, not 71)
            self._stamp.index_copy_(0, hs, torch.clamp(self._stamp.index_select(0, hs), min=seq))
            self._ref.index_fill_(0, hs, True)
        missed = torch.masked_select(flat, ~hit)
        cut = torch.searchsorted(missed, self._row_base).tolist() if missed.numel() else [0] * (len(self.groups) + 1)
        return flat.numel(), missed, cut

    def _still_missing(self, gi: int, miss: torch.Tensor, seq: int) -> torch.Tensor:
        """Of rows ``miss`` of group ``gi`` (missing at :meth:`_stamp_hits`), those still not
        resident; the others (a step admitted them since) are stamped ``seq`` as hits are."""
        g = self.groups[gi]
        local = g.row_slot.index_select(0, miss)
        now = local >= 0
        if not bool(now.any()):
            return miss
        hs = torch.masked_select(local, now).to(torch.int64)
        g.stamp.index_copy_(0, hs, torch.clamp(g.stamp.index_select(0, hs), min=seq))
        g.ref.index_fill_(0, hs, True)
        return torch.masked_select(miss, ~now)

    def _admit(self, gi: int, miss: torch.Tensor, seq: int, *, steal: bool, batch: torch.Tensor) -> int:
        """Rows ``miss`` (sorted, distinct, none resident) of group ``gi`` read into slots and
        stamped ``seq``; returns their number, or -1 when ``not steal`` and no slot is free for
        them (then nothing is read). ``batch``: all of the batch's rows of the group."""
        g = self.groups[gi]
        m = miss.numel()
        # A write-back arena takes clean slots while at least half of them are (the trainer
        # cleans every slot well before: dlrm_cxl.lookahead.WorkingCopyBound), else any slot,
        # a dirty one written back first: the working copy's pages it lands in become the
        # process's until MemoryPool.trim_working_copy (and a clean-only clock would scan the
        # whole group for nothing).
        mostly_dirty = self.write_back and 2 * self._ndirty[gi] > g.cfg.slots
        victims = clock_victims(g, m, self._floor, clean_only=self.write_back and not mostly_dirty)
        if victims is None and self.write_back and not mostly_dirty:
            victims = clock_victims(g, m, self._floor, clean_only=False)
        if victims is None:
            if not steal:
                return -1
            # Nothing free enough: rows of the planned batch furthest ahead (never this batch's).
            stamp = g.stamp
            key = torch.where(stamp < self._floor, stamp,
                              torch.where(stamp == seq, NEVER, (1 << 62) - stamp))
            mine = g.row_slot.index_select(0, batch).to(torch.int64)
            key[mine[mine >= 0]] = NEVER  # (this batch's resident rows, whatever their stamp)
            victims = torch.topk(key, m, largest=False, sorted=False).indices
            if bool((key[victims] == NEVER).any()):  # (begin() checked the count: not reached)
                raise CacheTooSmallError(f"table {g.cfg.name!r}: no free cache slot")
            stolen = int((stamp[victims] >= self._floor).sum())
            if stolen:
                self.stats.prefetch_stolen += stolen
                self._took_planned_slots()
        victims, _ = torch.sort(victims)  # (slots in order: the reads below go to ascending addresses)
        old = g.slot_row[victims]
        was = old >= 0
        if self.write_back:
            d = g.dirty[victims]
            if bool(d.any()):
                self._write_back_slots(gi, victims[d], old[d])
                nd = int(d.sum())
                self.stats.dirty_evictions += nd
                self._ndirty[gi] -= nd
                g.dirty[victims] = False
        if bool(was.any()):
            g.row_slot[old[was]] = -1
            self.stats.evictions += int(was.sum())
        # Rows still at their initial value are created in their slots, not read (their bits
        # cleared now, before the step changes them: memory_pool/fresh.py).
        new = self._fresh[gi].take(miss) if self._fresh[gi] is not None else None
        read, into = (miss, victims) if new is None else (miss[~new], victims[~new])
        # (a journal's or a run's newest value straight into the slot: Replayer.peek)
        peeked = self._peek(gi, read) if self._peek is not None and read.numel() else None
        if peeked is None and self._ready is not None and read.numel():
            self._ready(gi, read)
        if self._advise is not None and read.numel():  # (a file's pages asked for at once)
            self._advise(gi, read if peeked is None or peeked[0] is None else read[~peeked[0][0]])
        for i, (h, s) in enumerate(zip(g.homes, g.slots)):
            got = peeked[i] if peeked is not None else None
            hr, hi = (read, into) if got is None else (read[~got[0]], into[~got[0]])
            s.index_copy_(0, hi, h.index_select(0, hr))  # (read is sorted: the home read in ascending order)
            self.stats.bytes_read_home += hr.numel() * s.shape[1] * 4
            if got is not None:
                s.index_copy_(0, into[got[0]], got[1].view(s.dtype).view(-1, s.shape[1]))
                self.stats.rows_from_log += got[1].shape[0]
            if new is not None:
                self._fresh[gi].create(i, miss[new], s, victims[new])
        self.stats.rows_created += 0 if new is None else int(new.sum())
        g.slot_row[victims] = miss
        g.row_slot[miss] = victims.to(torch.int32)
        g.stamp[victims] = seq
        # A prefetched row counts as needed by its batch now (begin does not look it up again
        # when the whole batch was prefetched); a row the step itself reads, not (as before the
        # prefetch-complete rule: its begin looked up the hits before it read the misses).
        g.ref[victims] = not steal
        return m

    def _took_planned_slots(self) -> None:
        """(The lock held.) Slots a planned batch needs were taken: no batch counts as
        prefetched whole any more (its begin looks its rows up again)."""
        self._takings += 1
        self._complete.clear()

    lock = property(lambda self: self._lock)  # (held to read or write slots: CacheMember too)

    def invalidate(self, gi: int) -> None:
        """Forget every cached row of group ``gi`` (its home was replaced: a bulk load)."""
        g = self.groups[gi]
        with self._lock:
            self._took_planned_slots()
            g.row_slot.fill_(-1)
            g.slot_row.fill_(-1)
            g.stamp.fill_(-1)
            g.ref.fill_(False)
            g.dirty.fill_(False)
            self._ndirty[gi] = 0
            g.hand, g.untouched = 0, True

    # -- write-back arenas (journaled homes; see the module)
    @property
    def dirty_slots(self) -> int:
        """Slots newer than their home, every group (0 in a write-through arena)."""
        with self._lock:   # (the steps ended since, settled)
            return sum(self._ndirty)

    @property
    def dirty_fraction(self) -> float:
        """The largest fraction of a group's slots that are dirty, among groups that evict and
        whose home holds at least :data:`DIRTY_FROM_HOME_BYTES` (0 in a write-through arena)."""
        if not self.write_back:
            return 0.0
        with self._lock:
            # (a group holding all its rows never evicts: how dirty it is does not matter; nor
            # for a small table, whose dirty rows evicted fall in few pages of its home)
            return max((n / g.cfg.slots for n, g in zip(self._ndirty, self.groups)
                        if g.cfg.slots < g.cfg.rows and g.cfg.home_bytes >= DIRTY_FROM_HOME_BYTES), default=0.0)

    @contextlib.contextmanager
    def paused(self):
        """No admission, eviction or write of the arena while inside (its lock held)."""
        with self._lock:
            yield
