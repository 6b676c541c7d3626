"""A write-back cache arena's dirty slots going home (``memory_pool/cache_arena.py``, "Write-back
on journaled tiers"): a dirty row evicted or flushed is written to its home, and listed until
the trainer takes it (``take_spilled``) to give the working copy's pages back."""

from __future__ import annotations

import torch

__all__ = ["WriteBackSlots"]


class WriteBackSlots:
    """The part of :class:`~memory_pool.cache_arena.CacheArena` that writes dirty slots home
    (its ``groups``, ``_lock``, ``_ready``, ``_spilled``, ``_ndirty``, ``stats``)."""

    def _write_back_slots(self, gi: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows ``rows`` of group ``gi``, every member, from their slots ``slots`` to the home."""
        g = self.groups[gi]
        rows, order = torch.sort(rows)  # (ascending addresses in the home)
        slots = slots[order]
        if self._ready is not None:
            # (a row a refresh made pending again -- its copy from a run given back -- is taken
            # first: else a later read would take the run's older value over this one)
            self._ready(gi, rows)
        self._spilled[gi].append(rows)
        for h, s in zip(g.homes, g.slots):
            h.index_copy_(0, rows, s.index_select(0, slots))
            self.stats.bytes_written_home += rows.numel() * s.shape[1] * 4

    def wrote_home(self, gi: int, rows: torch.Tensor) -> None:
        """The pool wrote rows ``rows`` of group ``gi`` into the home (the lock held): listed for
        :meth:`take_spilled` in a write-back arena."""
        if self.write_back:
            self._spilled[gi].append(rows)

    def flush(self, gi: int | None = None) -> int:
        """Write every dirty row of group ``gi`` (None: of every group) to its home, and keep it
        cached, clean: before a read of the whole home (``Table.view``: the digest, a state dict,
        export). Returns the rows written. No step may be running (its rows are not final)."""
        n = 0
        with self._lock:
            for i in (range(len(self.groups)) if gi is None else [gi]):
                g = self.groups[i]
                d = g.dirty.nonzero().squeeze(1)
                if d.numel():
                    self._write_back_slots(i, d, g.slot_row[d])
                    g.dirty[d] = False
                    n += d.numel()
                self._ndirty[i] = 0
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

    def mark_clean(self) -> None:
        """Every slot equals its home now (``MemoryPool.trim_working_copy`` wrote every committed
        row into the images and mapped them afresh, with no step running): no slot is dirty."""
        with self._lock:
            self._dirty.fill_(False)
            self._ndirty = [0] * len(self.groups)
