"""A write-back cache arena's dirty slots going home (:class:`WriteBackSlots`), and the arena's
lock, which settles the steps that ended since it was last taken (:class:`SettlingLock`).

**A direct home (shm): write-back, flushed at every recovery point.** On a direct tier the
journal holds no after-images: recovery rolls the home back to the newest recovery point with
the ``UNDO`` records logged since, then replays the steps recorded after it
(``checkpointing.undo``). So what the home must hold is decided per recovery window, not per
step, and a step's rows need not go home at its end:

* *At a recovery point the home is exact.* Before the point's commit (its ``END``) is written,
  every dirty slot is written home (:meth:`flush`, called through ``MemoryPool.flush_caches`` by
  the checkpointer, on the trainer's thread, after the step's end and before the next step
  begins). A crash before that ``END`` rolls back to the window before, whose records still
  cover every row the flush wrote (each was touched in that window).
* *Within a window the rollback still restores its start.* The home holds each row's value at
  the window's start, or a later one whose before-image is already logged: a row's first touch
  in the window is logged before its slot first changes (the write-ahead barrier,
  ``persist``), and only a dirty slot is ever written home (an eviction, a flush).
* *A row's before-image is read from the home.* A row first touched in a window is clean in
  the cache (flushed at the window's start, unchanged since), so its home holds its current
  value and the undo log gathers it with its row size's group, one gather over the pool's arena
  (``MemoryPool.row_gathers(before_images=True)``); every other reader goes through the cache.
* *Each row goes home once a window*, not once a step: on `kaggle` behind a quarter cache,
  window 4, 11.8k rows a step went home against 16.1k written through (the README's tiering
  section). The flush takes the slots marked since from a list the steps' ends keep (a scan of
  every slot's mark cost 4-6 ms of a 10-17 ms flush), and writes them in home order. Past a
  sixteenth of the slots (no recovery point for long: ``--checkpoint none``) the list is dropped
  for the scan until the next flush, so it never holds more than that.

Why not before windows: with a recovery point every step, a dirty slot of committed step ``k``
written home at an eviction in step ``j > k`` would change the home outside any record, so
every step wrote its rows through (write-through, still what real pmem does: its flush would
also need cache-line flushes).

**A journaled home (emulated pmem, power-sim): write-back.** There the home is the pool's
*working copy*, a private copy-on-write mapping of the table images: volatile, not the durable
state (every window's commit journals the after-images of the rows it changed, read through the
cache: ``Table.current_rows``). Writing every step's rows through into it cost a copy-on-write
fault (~12.5 us) and a page of anonymous memory per row alone in its page: ~10k a step on
`kaggle`, the whole gap to in-memory speed. The clock evicts clean slots while at least half of
a group's are; a dirty row evicted is written to the home first. Those rows are listed
(:meth:`take_spilled`): the trainer gives the working copy back at recovery points by writing
only them into the images before mapping the images afresh (a *refresh*), and keeps the dirty
slots of big tables few (``DIRTY_FROM_HOME_BYTES``): where 40 % of one's slots are dirty, with
the checkpointer drained, the pool writes every committed journal row into the images and maps
them afresh (a *trim*, ``MemoryPool.trim_working_copy``); every slot then equals its home, and
:meth:`mark_clean` says so (``dlrm_cxl.lookahead.WorkingCopyBound``). Most slots are made clean
without one, once a background compaction has put their value home (:meth:`clean_through`). A
crash loses nothing: what a dirty slot holds is either a committed after-image in the journal or
part of the window that recovery replays.
"""

from __future__ import annotations

import collections
import threading
import time

import torch

from .rowsets import isin_sorted
from .threads import intra_op_threads

__all__ = ["WriteBackSlots", "SettlingLock"]


class SettlingLock:
    """The arena's lock (reentrant). Whoever takes it first settles the steps that began or ended
    since (``settle()``, with the lock held): they hand their bookkeeping over instead of waiting
    for the lock. The prefetch thread, at nice 19, holds the lock while it admits a
    group's rows, and the step's thread waited for it ~1.8 ms a step at each end on `kaggle`
    behind a quarter cache (emulated pmem, `tools/profile_overhead.py`)."""

    def __init__(self, settle):
        self._lock = threading.RLock()
        self._settle = settle
        self._depth = 0   # (only the thread holding the lock changes it)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._depth += 1
        if self._depth == 1:
            try:
                self._settle()
            except BaseException:
                self.release()
                raise
        return True

    def release(self) -> None:
        self._depth -= 1
        self._lock.release()

    def __enter__(self) -> "SettlingLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class WriteBackSlots:
    """The part of :class:`~memory_pool.cache_arena.CacheArena` that writes dirty slots home
    (its ``groups``, ``_lock``, ``_ready``, ``_spilled``, ``_ndirty``, ``stats``), and settles
    the steps that began and ended (its ``_running``, ``_floor``, ``_complete``, ``_dirty``,
    ``_slot_base``)."""

    def _init_ends(self) -> None:
        self._ended: collections.deque = collections.deque()   # (seq, slots to mark dirty, rows begun)
        self._lock = SettlingLock(self._settle_ended)
        self._dirty_list = [] if self.flushed_at_recovery_points else None
        self._last_end = -1   # the newest batch whose end is settled
        self._changed = None  # per slot, the batch that last changed it (a journaled home's arena: clean_through)

    @property
    def lists_spilled(self) -> bool:
        """Whether the rows written into the home are listed for :meth:`take_spilled`: a journaled
        home's write-back arena, whose working copy the trainer gives back with a refresh (a
        direct home's is exact at every recovery point: nothing to give back)."""
        return self.write_back and not self.flushed_at_recovery_points

    def _ended_step(self, seq: int, gslot: torch.Tensor | None, *, began: int | None = None) -> None:
        """Batch ``seq``'s step ended (its rows written through, or ``gslot`` -- its slots in one
        numbering -- to be marked dirty), or, with ``began`` (its rows), began on rows the
        prefetch made resident: settled by whoever takes the lock next, in order, before anything
        reads the dirty marks or takes a slot. Until then an ended batch counts as running: its
        slots are taken by nobody, so none of them can be evicted unmarked. (No lock: an append.)"""
        self._ended.append((seq, gslot, began))

    def settled_stats(self) -> dict:
        """``stats.as_dict()``, the steps begun and ended since the lock was last taken counted
        (what a report reads: ``dlrm_cxl.lookahead``, the benchmarks)."""
        with self._lock:
            return self.stats.as_dict()

    def _settle_ended(self) -> None:
        """(The lock held.) The steps begun and ended, in order: a begin's floor, pruning and
        stats; an end's slots dirty, then the floor past it."""
        while self._ended:
            seq, gslot, began = self._ended.popleft()
            if began is not None:
                self._floor = self._running = seq
                self._complete = {s: r for s, r in self._complete.items() if s > seq}
                st = self.stats
                st.steps += 1
                st.rows_needed += began
                st.hits += began
                continue
            self._last_end = seq
            if gslot is not None and gslot.numel():
                with intra_op_threads(1):   # (small ops: as in begin)
                    if self._changed is not None:
                        self._changed.index_fill_(0, gslot, seq)
                    new = torch.masked_select(gslot, ~self._dirty.index_select(0, gslot))
                    self._dirty.index_fill_(0, new, True)
                    if self._dirty_list is not None:
                        self._dirty_list.append(new)
                        if len(self._dirty_list) >= 64:
                            d = torch.unique(torch.cat(self._dirty_list))
                            d = d.masked_select(self._dirty.index_select(0, d))
                            # (past a sixteenth of the slots: the flush scans the marks instead)
                            self._dirty_list = [d] if 16 * d.numel() <= self._dirty.numel() else None
                    per = torch.bincount(torch.searchsorted(self._slot_base, new, right=True) - 1,
                                         minlength=len(self.groups)).tolist()
                self._ndirty = [a + b for a, b in zip(self._ndirty, per)]
            if self._running == seq:
                self._running = None
                self._floor = seq + 1

    def _write_back_slots(self, gi: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows ``rows`` of group ``gi``, every member, from their slots ``slots`` to the home."""
        g = self.groups[gi]
        rows, order = torch.sort(rows)  # (ascending addresses in the home)
        slots = slots[order]
        if self._ready is not None:
            # (a row a refresh made pending again -- its copy from a run given back -- is taken
            # first: else a later read would take the run's older value over this one)
            self._ready(gi, rows)
        if self.lists_spilled:
            self._spilled[gi].append(rows)
        for h, s in zip(g.homes, g.slots):
            h.index_copy_(0, rows, s.index_select(0, slots))
            self.stats.bytes_written_home += rows.numel() * s.shape[1] * 4

    def wrote_home(self, gi: int, rows: torch.Tensor) -> None:
        """The pool wrote rows ``rows`` of group ``gi`` into the home (the lock held): listed for
        :meth:`take_spilled` where it :attr:`lists_spilled`."""
        if self.lists_spilled:
            self._spilled[gi].append(rows)

    def _flush_whole(self) -> int:
        """(The lock held.) :meth:`flush` of every group at once (a direct home's recovery point):
        the dirty slots from the list the steps' ends kept (no scan of every slot's mark: 4-6 ms
        on `kaggle` at a quarter), then one gather and one scatter per member, in home order."""
        if self._dirty_list is None:
            d = self._dirty.nonzero().squeeze(1)
        else:
            d = torch.unique(torch.cat(self._dirty_list)) if self._dirty_list else torch.empty(0, dtype=torch.int64)
            d = d.masked_select(self._dirty.index_select(0, d))   # (evicted since: written home then)
        self._dirty_list = []
        if not d.numel():
            return 0
        gi = torch.searchsorted(self._slot_base, d, right=True) - 1
        flat = self._slot_row.index_select(0, d) + self._row_base.index_select(0, gi)   # (_flat_rows' numbering)
        local = d - self._slot_base.index_select(0, gi)
        # (in the weights' home order: neighbouring rows share pages and TLB entries)
        _, order = torch.sort(flat + self._whole[0][2].index_select(0, gi))
        self.stats.bytes_written_home += self._whole_to_home(flat.index_select(0, order), gi.index_select(0, order),
                                                             local.index_select(0, order))
        self._dirty.index_fill_(0, d, False)
        self._ndirty = [0] * len(self.groups)
        return int(d.numel())

    def flush(self, gi: int | None = None) -> int:
        """Write every dirty row of group ``gi`` (None: of every group) to its home, and keep it
        cached, clean: before a read of the whole home (``Table.view``: the digest, a state dict,
        export), and at each recovery point of a direct home (``MemoryPool.flush_caches``).
        Returns the rows written. No step may be running (its rows are not final)."""
        n = 0
        t0 = time.perf_counter()
        with self._lock:
            if gi is None and self.flushed_at_recovery_points and self._whole is not None:
                n = self._flush_whole()   # (a direct home's recovery point: every group at once)
            else:
                for i in (range(len(self.groups)) if gi is None else [gi]):
                    g = self.groups[i]
                    d = g.dirty.nonzero().squeeze(1)
                    if d.numel():
                        self._write_back_slots(i, d, g.slot_row[d])
                        g.dirty[d] = False
                        n += d.numel()
                    self._ndirty[i] = 0
                if gi is None and self.flushed_at_recovery_points:
                    self._dirty_list = []
        self.stats.write_seconds += time.perf_counter() - t0
        self.stats.flushes += n
        return n

    def take_spilled(self) -> list[torch.Tensor]:
        """Per group, the sorted distinct rows written into the home since the last call (a
        journaled working copy's own pages: ``MemoryPool.trim_working_copy(names, written)`` writes them into
        the images before it maps them afresh, and from then on no older journal record is
        written over them: ``Compaction.refresh``), forgotten here. Except the rows cached
        again and changed since: their home holds an older value than their dirty slot, which
        is what reads them until it is evicted (and written home again) or a trim writes every
        committed row."""
        with self._lock:
            out = []
            for g, x in zip(self.groups, self._spilled):
                rows = torch.unique(torch.cat(x)) if x else torch.empty(0, dtype=torch.int64)
                slot = g.row_slot.index_select(0, rows)
                cached = (slot >= 0).nonzero().squeeze(1)
                if cached.numel():
                    newer = torch.zeros(rows.numel(), dtype=torch.bool)
                    newer[cached] = g.dirty.index_select(0, slot[cached].to(torch.int64))
                    rows = rows[~newer]
                out.append(rows)
            self._spilled = [[] for _ in self.groups]
        return out

    @property
    def last_ended(self) -> int:
        """The newest batch (``seq``) whose step has ended (-1: none): a slot it or an earlier
        one changed last is at most this in :meth:`clean_through`'s terms."""
        with self._lock:
            return self._last_end

    def clean_through(self, seq: int, pend) -> int:
        """A journaled home's compaction has put home the newest committed value of the rows
        changed by batches up to ``seq``: the dirty slots no later batch changed hold exactly
        that value, and become clean -- an eviction then drops them instead of writing them into
        the working copy, and the trainer needs no trim to keep the clock's clean slots
        (``dlrm_cxl.lookahead.WorkingCopyBound``). ``pend(group, rows)`` (rows sorted) makes
        those rows read from where the compaction put them, not from the working copy
        (``MemoryPool.pend_compacted``), and returns the mask of rows it did that for; only
        those are made clean, and they leave the spilled list (:meth:`take_spilled`): the
        working copy's value of a row evicted before it was cached and changed again is older,
        and a refresh must not write it home. Call order: no step running, no compaction
        running (the caller holds the pool's images). Returns the slots made clean."""
        n = 0
        with self._lock:
            for gi, g in enumerate(self.groups):
                if not self._ndirty[gi]:
                    continue
                a, b = int(self._slot_base[gi]), int(self._slot_base[gi + 1])
                sl = (g.dirty & (self._changed[a:b] <= seq)).nonzero().squeeze(1)
                if not sl.numel():
                    continue
                rows, order = torch.sort(g.slot_row.index_select(0, sl))
                ok = pend(gi, rows)
                sl, rows = sl.index_select(0, order).masked_select(ok), rows.masked_select(ok)
                g.dirty.index_fill_(0, sl, False)
                self._ndirty[gi] -= sl.numel()
                if self._spilled[gi] and rows.numel():
                    x = torch.unique(torch.cat(self._spilled[gi]))
                    self._spilled[gi] = [x.masked_select(~isin_sorted(x, rows))]
                n += sl.numel()
            self.stats.cleaned += n
        return n

    def mark_clean(self) -> None:
        """Every slot equals its home now (``MemoryPool.trim_working_copy`` wrote every committed
        row into the images and mapped them afresh, with no step running): no slot is dirty."""
        with self._lock:
            self._dirty.fill_(False)
            self._ndirty = [0] * len(self.groups)
