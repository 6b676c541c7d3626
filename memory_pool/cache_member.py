"""How a pool table reads and writes its rows while a DRAM cache arena caches them
(memory_pool/cache_arena.py): :class:`CacheMember`, the table's side of the arena."""

from __future__ import annotations

import torch

__all__ = ["CacheMember"]


class CacheMember:
    """How a pool table reads and writes its rows while a :class:`CacheArena` caches them
    (``Table.use_cache``): reads of cached rows come from their slots, the rest from the home
    (nothing is admitted: only steps admit rows); a write to the home refreshes the row's slot.
    The interface of :class:`memory_pool.cache.RowCache`."""

    def __init__(self, arena, group: int, member: int):  # (arena: a CacheArena)
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

    def read(self, ids: torch.Tensor, ready=None) -> tuple[torch.Tensor, int, int]:
        """Rows ``ids`` (duplicates allowed). Returns (rows, bytes from DRAM, bytes from home).
        ``ready(rows)``: called with the rows read from the home, before they are read (the
        pool's on-demand rows applied to it; the rows the cache holds need none)."""
        out, b_dram, b_home = self._read(ids, ready)
        rb = out.shape[1] * out.element_size() if out.dim() == 2 else 4
        self.hits += b_dram // max(rb, 1)
        self.misses += b_home // max(rb, 1)
        return out, b_dram, b_home

    def write_through(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Rows ``ids`` were just written to the home: refresh their slots."""
        a = self.arena
        g = a.groups[self.group]
        with a.lock:  # (never beside an admission or eviction)
            a.wrote_home(self.group, ids)
            slot = g.row_slot.index_select(0, ids).to(torch.int64)
            cached = slot >= 0
            if bool(cached.any()):
                g.slots[self.member][slot[cached]] = values[cached].to(torch.float32)

    @property
    def holds_newer(self) -> bool:
        """Whether a cached row may be newer than its home (a write-back arena): then the home
        must be read through :meth:`current`, or :meth:`flush`ed first."""
        return self.arena.write_back

    @property
    def flushed_at_recovery_points(self) -> bool:
        """Whether every dirty slot goes home at each recovery point (a direct home's arena)."""
        return self.arena.flushed_at_recovery_points

    def current(self, ids: torch.Tensor, ready=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids``' current values (cached ones from their slots), not counted as reads
        (``ready``: as :meth:`read`'s), into ``out`` (``[ids, dim]``, contiguous) if given."""
        return self._read(ids, ready, out)[0]

    def newer_into(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The cached rows among ``ids`` written into their places in ``out`` (``[ids, dim]``):
        their slots' values, each row's newest (a slot got it at its admission, from the
        journal or a run where the home is older; ``Table.snapshot``). Returns which rows
        those were (a bool mask over ``ids``): the others are the caller's to read."""
        with self.arena.lock:
            slot, hit = self._slots(ids)
            self._cached_into(slot, hit, out)
        return hit

    def _slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(The arena's lock held.) Each row's slot (int64, -1: not cached) and whether it has one."""
        slot = self.arena.groups[self.group].row_slot.index_select(0, ids).to(torch.int64)
        return slot, slot >= 0

    def _cached_into(self, slot: torch.Tensor, hit: torch.Tensor, out: torch.Tensor) -> None:
        """(The arena's lock held.) The rows with a slot (``hit``) copied from it into ``out``."""
        at = hit.nonzero().squeeze(1)
        if at.numel():
            out.index_copy_(0, at, self.arena.groups[self.group].slots[self.member].index_select(0, slot.index_select(0, at)))

    def _read(self, ids: torch.Tensor, ready, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int, int]:
        """The cached rows of ``ids`` from their slots, the others from the home, ``ready(those
        rows)`` first, into ``out`` if given (the journal's after-images go straight into their
        record: no temporary of a window's rows and no second copy of them). Returns (rows,
        bytes from DRAM, bytes from home)."""
        a = self.arena
        g = a.groups[self.group]
        with a.lock:  # (never beside an admission or eviction)
            slot, hit = self._slots(ids)
            s, h = g.slots[self.member], g.homes[self.member]
            rb = s.shape[1] * 4
            if bool(hit.all()):
                return torch.index_select(s, 0, slot, out=out) if out is not None else s.index_select(0, slot), \
                    ids.numel() * rb, 0
            # (only the rows not cached are read from the home, and only they need an on-demand
            # replay's or a run's value applied there first: the journal's after-image gathers
            # read ~12k rows a step on `kaggle`, nearly all cached -- reading the home for all of
            # them took each run row back into the working copy, a page fault and a page read)
            miss = (~hit).nonzero().flatten()
            if ready is not None:
                ready(ids[miss])
            if out is None:
                out = torch.empty(ids.numel(), s.shape[1], dtype=s.dtype)
            out.index_copy_(0, miss, h.index_select(0, ids.index_select(0, miss)))
            self._cached_into(slot, hit, out)
            return out, (ids.numel() - miss.numel()) * rb, miss.numel() * rb

    def flush(self) -> None:
        """Dirty rows of the table's group written to the home (:meth:`CacheArena.flush`)."""
        if self.arena.write_back:
            self.arena.flush(self.group)

    def reset(self, home: torch.Tensor) -> "CacheMember":
        """The whole table was replaced at home (a bulk load): nothing cached is valid."""
        self.arena.invalidate(self.group)
        return self
