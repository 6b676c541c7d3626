"""The configuration and the counters of a DRAM cache arena (memory_pool/cache_arena.py): how a
budget is split into slots per table (:class:`CacheArenaConfig`, frozen, apart from the arena
that owns the memory) and what the cache did (:class:`CacheStats`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from .errors import CacheTooSmallError, InvalidConfigError

__all__ = ["CacheGroupConfig", "CacheArenaConfig", "CacheStats", "MAP_BYTES_PER_ROW", "META_BYTES_PER_SLOT",
           "budget_size"]

MAP_BYTES_PER_ROW = 4        # the int32 row -> slot map
META_BYTES_PER_SLOT = 22     # per slot: its row (int64), its stamp (int64), its clock bit and its dirty bit (bools),
                             # the batch that last changed it (int32)


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
        every table needs; what is left of the budget is split **max-min fair**: every table
        gets the same number of slots more, up to all its rows (water-filling), so that a table
        small enough is cached whole and the big ones share the rest equally. Raises
        :class:`CacheTooSmallError` when the budget does not hold the maps and one batch (the
        hint names the budget that would).

        Why not in proportion to the rows (the first split: every table caching the same
        fraction of its rows): a batch looks up one id per sample in every table, so a 10 M-row
        table and a 100 k-row one each need ~1.3 k distinct rows a step on `kaggle`. At a
        quarter budget the proportional split left the mid-sized tables (3-290 k rows) a
        quarter to two thirds of their rows: they evicted rows they had trained, read them back
        (~1,050 rows a step of ~4,300 misses) and kept the trims coming (their slots dirty),
        while the 10 M-row tables had used 6 % of their slots after 200 steps (docs/tiering-measurements.md)."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise InvalidConfigError(f"the DRAM budget must be an int >= 0 bytes, got {budget_bytes!r}")
        if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
            raise InvalidConfigError(f"batch_rows must be an int >= 1, got {batch_rows!r}")
        need = cls.min_budget(tables, batch_rows)
        if budget_bytes < need:
            raise CacheTooSmallError(
                f"a DRAM budget of {budget_bytes:,} bytes cannot hold one batch: the {len(tables)} tables' row maps "
                f"and {batch_rows:,} rows of each table (all of a smaller table's) take {need:,} bytes",
                hint=f"raise --dram-cache to at least {budget_size(need)} (or lower --batch-size)")
        base = [min(rows, batch_rows) for _, rows, _ in tables]
        cost = [4 * sum(dims) + META_BYTES_PER_SLOT for _, _, dims in tables]
        caps = [rows - b for (_, rows, _), b in zip(tables, base)]
        level = _water_level(caps, cost, budget_bytes - need)
        groups = tuple(CacheGroupConfig(name, rows, tuple(dims), b + min(cap, level))
                       for (name, rows, dims), b, cap in zip(tables, base, caps))
        return cls(groups, budget_bytes)

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


def _water_level(caps: Sequence[int], cost: Sequence[int], budget: int) -> int:
    """The largest ``level`` with ``sum(min(cap, level) * cost) <= budget``: raised table by table,
    from the one that fills first (the smallest ``cap``); the tables not full yet pay for each
    step of it together."""
    level, paying, left = 0, sum(cost), budget
    for i in sorted(range(len(caps)), key=caps.__getitem__):
        step = (caps[i] - level) * paying
        if step > left:
            return level + left // paying
        left -= step
        level, paying = caps[i], paying - cost[i]
    return level


def budget_size(n: int) -> str:
    """``n`` bytes as a ``--dram-cache`` value, rounded up (``3G``, ``512M``)."""
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
    rows_created: int = 0          # of the misses and prefetched rows, created from the initializer, not read
    rows_from_log: int = 0         # ... and (times members) taken from the journal or a run, not the home
    prefetch_skipped: int = 0      # planned batches (x tables) the prefetch left to their step: no free slot
    prefetch_stolen: int = 0       # prefetched rows a step evicted before their batch ran
    evictions: int = 0             # rows dropped from a slot for another
    dirty_evictions: int = 0       # of them, written back to the home first (write-back arenas: no clean slot left)
    flushes: int = 0               # rows written back by flush() (a direct home's recovery points; digest, export)
    cleaned: int = 0               # dirty slots made clean because a compaction put their value home (clean_through)
    bytes_read_home: int = 0
    bytes_written_home: int = 0    # write-through at the end of each step (write-back arenas: evictions, flushes)
    wait_seconds: float = 0.0      # the step's time in begin(): reading misses, waiting for the prefetch's lock
    write_seconds: float = 0.0     # the time writing rows home: each step's write-through, or a flush (recovery points, digest)
    prefetch_seconds: float = 0.0  # the prefetch thread's time reading rows ahead

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hits / self.rows_needed if self.rows_needed else None
        n = max(self.steps, 1)
        d["wait_ms_per_step"] = 1e3 * self.wait_seconds / n
        d["write_ms_per_step"] = 1e3 * self.write_seconds / n
        d["bytes_read_home_per_step"] = self.bytes_read_home / n
        return d
