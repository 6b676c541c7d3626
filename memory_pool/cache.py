"""A DRAM cache of hot rows in front of a table whose home is a slower tier.

Used when a table does not fit the pool's DRAM budget. Policy: LRU at batch granularity — every
lookup is one "tick"; rows touched by a tick are stamped with it, and misses evict the slots
with the oldest stamp, never a slot the current tick already uses. Everything is vectorised
(a [rows] int32 row->slot map costs 4 bytes per row, ~1.5% of a dim-64 fp32 table).

Writes are write-through: the home tier is always current, so durability (persist, the undo
log) never has to reason about dirty cache lines; the cached copy is refreshed in the same call.
If one lookup needs more distinct rows than the cache has slots, the rest are read from home.
"""

from __future__ import annotations

import torch

__all__ = ["RowCache"]


class RowCache:
    def __init__(self, home: torch.Tensor, capacity_rows: int):
        if capacity_rows < 1:
            raise ValueError(f"capacity_rows must be >= 1, got {capacity_rows}")
        self.home = home
        rows, dim = home.shape
        self.capacity = min(capacity_rows, rows)
        self.slots = torch.empty(self.capacity, dim, dtype=home.dtype)
        # (the maps are made at the first lookup: a table the trainer binds to a cache arena
        # instead -- Table.use_cache -- never uses this cache, and filling its maps cost an open
        # of `kaggle` behind the cache 0.14 s)
        self._maps: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.tick = 0
        self.hits = 0
        self.misses = 0

    # DRAM the cache costs: 4 bytes per table row (row->slot map) plus, per slot, the row
    # itself, its owner row (int64) and its stamp (int64).
    MAP_BYTES_PER_ROW = 4
    META_BYTES_PER_SLOT = 16

    @staticmethod
    def slots_for_budget(budget_bytes: int, rows: int, row_bytes: int) -> int:
        """Most slots whose cache (map and metadata included) fits ``budget_bytes``; 0 if none."""
        left = budget_bytes - rows * RowCache.MAP_BYTES_PER_ROW
        return max(0, min(rows, left // (row_bytes + RowCache.META_BYTES_PER_SLOT)))

    @property
    def nbytes(self) -> int:
        return (self.slots.numel() * self.slots.element_size() + self.home.shape[0] * self.MAP_BYTES_PER_ROW
                + self.capacity * self.META_BYTES_PER_SLOT)

    def _made(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._maps is None:
            self._maps = (torch.full((self.home.shape[0],), -1, dtype=torch.int32),   # row -> slot
                          torch.full((self.capacity,), -1, dtype=torch.int64),        # slot -> row
                          torch.zeros(self.capacity, dtype=torch.int64))              # slot's stamp
        return self._maps

    row_slot = property(lambda self: self._made()[0])
    slot_row = property(lambda self: self._made()[1])
    stamp = property(lambda self: self._made()[2])

    def read(self, ids: torch.Tensor, ready=None) -> tuple[torch.Tensor, int, int]:
        """Rows for ``ids`` (duplicates allowed). Returns (rows, bytes from DRAM, bytes from home).
        ``ready(ids)``: called first (the pool's on-demand rows applied to the home)."""
        if ready is not None:
            ready(ids)
        self.tick += 1
        slot = self.row_slot[ids].to(torch.int64)
        hit = slot >= 0
        n_hit = int(hit.sum())
        self.hits += n_hit
        self.misses += ids.numel() - n_hit
        if n_hit:
            self.stamp[slot[hit]] = self.tick
        if n_hit < ids.numel():
            self._admit(torch.unique(ids[~hit]))
            slot = self.row_slot[ids].to(torch.int64)
            hit = slot >= 0
        row_bytes = self.slots.shape[1] * self.slots.element_size()
        if bool(hit.all()):
            return self.slots.index_select(0, slot), ids.numel() * row_bytes, 0
        out = torch.empty(ids.numel(), self.slots.shape[1], dtype=self.slots.dtype)
        out[hit] = self.slots.index_select(0, slot[hit])
        out[~hit] = self.home.index_select(0, ids[~hit])
        n_home = int((~hit).sum())
        return out, (ids.numel() - n_home) * row_bytes, n_home * row_bytes

    def _admit(self, rows: torch.Tensor) -> None:
        free = self.stamp < self.tick  # slots the current tick does not use
        n_free = int(free.sum())
        m = min(rows.numel(), n_free)
        if m == 0:
            return
        rows = rows[:m]
        key = torch.where(free, self.stamp, torch.iinfo(torch.int64).max)
        victims = torch.topk(key, m, largest=False, sorted=False).indices
        old = self.slot_row[victims]
        old = old[old >= 0]
        self.row_slot[old] = -1
        self.slot_row[victims] = rows
        self.row_slot[rows] = victims.to(torch.int32)
        self.slots[victims] = self.home.index_select(0, rows)
        self.stamp[victims] = self.tick

    def reset(self, home: torch.Tensor) -> "RowCache":
        """A new, empty cache of the same capacity over ``home`` (the table was replaced whole)."""
        return RowCache(home, self.capacity)

    # A write-through cache: the home always holds every row's current value.
    holds_newer = False
    flushed_at_recovery_points = False

    def flush(self) -> None:
        """Nothing to write back (write-through)."""

    def write_through(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Refresh cached copies of rows that were just written to home."""
        slot = self.row_slot[ids].to(torch.int64)
        cached = slot >= 0
        if bool(cached.any()):
            self.slots[slot[cached]] = values[cached]
