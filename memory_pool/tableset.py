"""The tables of an open pool and the memory they live in: one arena (``arena.py``) holding a
region per table in the pool's tier (``tiers.py``), and the DRAM budget their row caches share
(``cache.py``). ``MemoryPool`` holds one :class:`TableSet`; its compaction and its replay read it
as a mapping of table names to tables.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

from . import fileio
from .arena import Arena, page_round
from .cache import RowCache
from .errors import PoolCorruptError, PoolFullError, TableExistsError, TableNotFoundError
from .fresh import FreshRows, InitSpec
from .header import table_file
from .table import Table, TableConfig, TableHost
from .tiers import Tier, open_region
from .validation import validate_init, validate_table_config

__all__ = ["TableSet"]

ARENA_ROOM = 1 << 40   # bytes of address space reserved beyond a pool's tables (1 TiB)


class TableSet(Mapping):
    """The tables of an open pool by name, and the memory they live in (see the module).

    ``host``: what each :class:`Table` may ask of the pool (:class:`~memory_pool.table.TableHost`);
    ``cfgs``: the tables the pool's header lists (the arena reserves room for them and as much
    again, for tables created later); ``where``: the pool's directory (named in errors);
    ``storage_dir``: where the table files are; ``dram_cache_bytes``: the DRAM budget (None:
    every table is served from its home)."""

    def __init__(self, host: TableHost, cfgs: list[TableConfig], *, where: Path, tier: Tier, storage_dir: Path,
                 read_only: bool, dram_cache_bytes: int | None):
        self._host = host
        self._where = where
        self._tier = tier
        self._storage_dir = storage_dir
        self._read_only = read_only
        self._dram_cache_bytes = dram_cache_bytes
        self._dram_left = dram_cache_bytes
        self._by_name: dict[str, Table] = {}
        self._rows = True   # (open_all: False when the pool was opened without its rows)
        self._pool_id = ""
        self._fresh_saved = False   # (save_fresh)
        # Each table's initializer, as the header records it (add), and the rows still at their
        # initial value (memory_pool/fresh.py): loaded by a writer's open_all, saved by close.
        self.inits: dict[str, dict] = {}
        self.fresh = FreshRows()
        if self._keeps_fresh_file:
            self.fresh.keep(storage_dir)
        # One address range for every table (see arena.py); room for tables created later. Only
        # reserved (PROT_NONE, MAP_NORESERVE: no memory, no commit charge), so it is generous:
        # 16 GiB of room made a new pool refuse its tables past 16 GiB (a 35 GB `kaggle` with
        # 256-dim rows: PoolFullError on its 12th table); x86-64 gives a process 128 TiB.
        need = sum(page_round(c.nbytes) for c in cfgs)
        self.arena: Arena | None = Arena(need + max(need, ARENA_ROOM))

    def __getitem__(self, name: str) -> Table:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def open_all(self, cfgs: list[TableConfig], *, rows: bool = True, pool_id: str = "",
                 inits: dict | None = None) -> None:
        """Attach the tables of an existing pool (their files must exist); none without ``rows``.
        ``inits``: the header's initializer of each table."""
        self._rows, self._pool_id, self.inits = rows, pool_id, dict(inits or {})
        if rows and self._tier.has_files:
            # (a writer's: before anything can change a row, FreshRows.load removes its file durably)
            specs = {n: InitSpec.from_dict(d) for n, d in self.inits.items()}
            self.fresh = FreshRows.load(self._storage_dir, pool_id, {c.name: c.num_embeddings for c in cfgs},
                                        {n: sp for n, sp in specs.items() if sp is not None},
                                        remove=not self._read_only, keep=self._keeps_fresh_file)
            # A kept file read intact needs no save at the first transaction (save_fresh(once)):
            # it is still true. The rows this open clears in memory are in the journal records it
            # replays, which every later open replays too, until a compaction moves START or the
            # applied mark -- and those save the file first. (0.14 s, two fsyncs, on the first
            # step of every resume and every `recover` of a journaled pool.)
            self._fresh_saved = self.fresh.kept and self.fresh.loaded
        total = sum(c.nbytes for c in cfgs)
        dram_cache_bytes = self._dram_cache_bytes
        # When the tables of an existing pool do not all fit the DRAM budget, it is split in
        # proportion to their sizes, so every table gets a cache of the same fraction of its
        # rows (the budget covers each cache's map and metadata too).
        split = dram_cache_bytes is not None and total > dram_cache_bytes
        for cfg in cfgs if rows else ():
            share = dram_cache_bytes * cfg.nbytes // total if split else None
            self._by_name[cfg.name] = self._attach(cfg, create=False, share=share)
        if split:
            self._dram_left = 0

    def table(self, name: str) -> Table:
        """Table ``name`` (``MemoryPool.table``)."""
        if not self._rows:
            raise TableNotFoundError(f"pool {self._where} was opened with rows=False: no table is mapped",
                                     hint="open it with rows=True (the default) to read its tables")
        try:
            return self._by_name[name]
        except KeyError:
            raise TableNotFoundError(f"no table {name!r} in pool {self._where} (has: {', '.join(self._by_name) or 'none'})") from None

    def _attach(self, cfg: TableConfig, *, create: bool, share: int | None = None) -> Table:
        tier = self._tier
        file = table_file(self._storage_dir, cfg.name) if tier.has_files else None
        if not create and file is not None and not file.exists():
            raise PoolCorruptError(f"{self._where}: table file {file} is missing")
        region = open_region(self.arena, tier, file, cfg.num_embeddings, cfg.embedding_dim, cfg.dtype,
                             create=create, read_only=self._read_only)
        cache_rows = 0
        if share is not None:
            cache_rows = RowCache.slots_for_budget(share, cfg.num_embeddings, cfg.row_bytes)
        elif self._dram_left is not None:
            # Tables created in this session get what is left of the budget: a table that fits
            # what is left is served directly; a larger one gets a cache of what is left --
            # the cache's row map and slot metadata included, so it never exceeds the budget.
            # A budget too small for even the map serves the table from its home, uncached.
            if cfg.nbytes <= self._dram_left:
                self._dram_left -= cfg.nbytes
            else:
                cache_rows = RowCache.slots_for_budget(self._dram_left, cfg.num_embeddings, cfg.row_bytes)
                self._dram_left = 0
        return Table(self._host, cfg, region, cache_rows)

    def add(self, cfg: TableConfig, *, init: str, scale: float | None, seed: int, capacity: int | None,
            lock: threading.RLock, write_header: Callable[[], None]) -> Table:
        """A new table (``MemoryPool.create_table``): its file made, filled and durable, then
        listed, under the header's ``lock``, by ``write_header``. On failure nothing of it is left."""
        name = cfg.name
        validate_table_config(cfg)
        validate_init(init)
        if name in self._by_name:
            raise TableExistsError(f"table {name!r} already exists in pool {self._where}")
        cap = capacity
        if cap is not None and self.used_bytes() + cfg.nbytes > cap:
            raise PoolFullError(
                f"table {name!r} needs {cfg.nbytes} bytes; pool has {cap - self.used_bytes()} of {cap} left")
        dram_left = self._dram_left
        # The initializer recorded with the table (the header lists it below): a row still at its
        # initial value is then created from it instead of read (memory_pool/fresh.py).
        spec = InitSpec(init, seed, (1.0 / cfg.num_embeddings) ** 0.5 if scale is None else float(scale)) \
            if init == "uniform" else InitSpec(init)
        table = self._attach(cfg, create=True)
        try:
            if init != "zeros":
                table.fill_(init, scale=scale, seed=seed)
            if self._tier.files_in_pool_dir:
                # The image and its name durable before the header lists it: a power loss
                # after the header's write must not leave a table file that is missing or short.
                fileio.fsync(table.region.fd)
                fileio.fsync_dir(table.region.path.parent)
            with lock:  # (no other header write lists the table before this one, or misses it after)
                self._by_name[cfg.name] = table
                self.inits[name] = asdict(spec)
                write_header()
        except BaseException:
            with lock:
                self._dram_left = dram_left
                self._by_name.pop(cfg.name, None)
                self.inits.pop(name, None)
            table.close()
            if self._tier.has_files:
                try:
                    fileio.unlink(table.region.path)
                except OSError:
                    pass
            raise
        if cfg.dtype == "float32":
            self.fresh.add(name, cfg.num_embeddings, spec)
        return table

    def used_bytes(self) -> int:
        return sum(t.config.nbytes for t in self._by_name.values())

    def describe(self) -> list[dict]:
        return [
            {**asdict(t.config), "bytes": t.config.nbytes, "cached": t.cached,
             "cache_rows": t.cache_rows}
            for t in self._by_name.values()
        ]

    @property
    def _keeps_fresh_file(self) -> bool:
        """A journaled tier's writer keeps ``fresh.bits`` while the pool is open (memory_pool/fresh.py)."""
        return self._tier.has_files and self._tier.journaled and not self._read_only

    def save_fresh(self, *, once: bool = False) -> None:
        """Save the bitmaps now, where the file is kept (``FreshRows.save``): before a move of
        the journal's START or of the applied mark, and (``once``: unless saved already, or no table has
        a bitmap yet) at a writer's first transaction -- a pool made by this process has no file yet."""
        if once and (self._fresh_saved or not self.fresh.any):
            return
        self._fresh_saved = True
        if self.fresh.kept and self._rows:
            self.fresh.save(self._storage_dir, self._pool_id)

    def flush_caches(self) -> int:
        """At a recovery point, before its commit: the dirty slots of every DRAM cache arena that
        is flushed at recovery points (a direct home's: ``memory_pool/cache_writeback.py``)
        written home, each arena once. No step may be running. Returns the rows written."""
        arenas = {id(a): a for a in (t.recovery_point_cache for t in self.values()) if a is not None}
        return sum(a.flush() for a in arenas.values())

    def close(self) -> None:
        """Save the rows still at their initial value (a writer: ``FreshRows.save``, durable before
        the pool's close lets the emulated power go), then release every table's region; the arena
        goes with the last reference to it."""
        if self._rows and not self._read_only and self._tier.has_files and self._by_name:
            try:
                self.fresh.save(self._storage_dir, self._pool_id)
            except OSError:
                # (a save that failed and whose file could not be removed either: the file
                # saved last still holds -- START moved only after it -- and the rows changed
                # since are in the journal, which the next open clears: memory_pool/fresh.py)
                pass
        for t in self._by_name.values():
            t.close()
        self.arena = None
