"""The memory pool: a directory of embedding tables in one tier, with a checksummed header
(``header.py``), one table object per table (``table.py``), an arena holding them all
(``arena.py``) and a journal (``journal.py``).

Its directory (layout, making one, the checks of an open, deleting one): ``pooldir.py``. What
an open replays: ``replay.py``; compaction: ``compaction.py``; the checkpointer's row gathers:
``gather.py``.

Exactly one writer at a time holds ``LOCK``; read-only opens take no lock and map the files
privately, so they never change them.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Mapping

import torch

from . import fileio
from .durable import atomic_write
from ._native import libpmem
from .header import (FORMAT_VERSION, HEADER, JOURNAL_DIR, MAGIC, RUNS_FORMAT_VERSION, header_bytes, read_header,
                     table_file)
from .table import PoolStats, Table, TableConfig, TableHost
from .validation import json_copy
from .errors import PoolFormatError, PoolReadOnlyError
from .journal import Journal
from .overlay import MANIFEST, RUNS_DIR
from .persistence import AppliedMark, persist_rows
from .tiers import Tier, detect_dax, tier_of
from .compaction import Compaction
from .replay import REPLAY_MODES, Replayer
from .transaction import Transaction
from .gather import RowGather, RowGathering
from .kjt_lookup import lookup_kjt
from .tableset import TableSet
from .pooldir import close_pool_dir, destroy_pool, make_pool_dir, open_journal, open_pool_dir

__all__ = ["MemoryPool", "RowGather", "Table", "TableConfig", "PoolStats", "destroy_pool", "MAGIC", "FORMAT_VERSION",
           "HEADER", "read_header", "REPLAY_MODES"]


class MemoryPool(RowGathering):
    """A pool of embedding tables. Create with :meth:`create`, reopen with :meth:`open`.

    Use as a context manager; ``close`` releases the mappings and the writer lock. A pool
    opened ``read_only`` takes no lock and can sit beside a writer.
    """

    def __init__(self, path: Path, header: dict, *, read_only: bool, lock_fd: int | None,
                 dram_cache_bytes: int | None, use_libpmem: bool | None, rows: bool = True,
                 replay: str = "eager"):
        self.path = Path(path)
        self._compaction: Compaction | None = None   # write-back, sync, runs, START (memory_pool/compaction.py)
        self._replayer: Replayer | None = None       # the journal's rows into the working copy (memory_pool/replay.py)
        self._header = header
        self.read_only = read_only
        self._lock_fd = lock_fd
        self._closed = False
        self._use_libpmem = use_libpmem
        self.dram_cache_bytes = dram_cache_bytes
        t_open = time.perf_counter()
        self.stats = PoolStats()
        self._tables: TableSet | None = None   # the tables and their memory (memory_pool/tableset.py)
        self._watched = False   # emulated power loss on (set below, once the tier is known)
        # The header's lock: every read-modify-write of self._header and of its temporary file
        # (set_meta, create_table, and the compactor's thread writing format version 3 before
        # the overlay's first manifest) holds it, or one of two racing writers loses its update.
        self._meta_lock = threading.RLock()
        self.journal: Journal | None = None
        try:
            cfgs = [TableConfig(t["name"], t["num_embeddings"], t["embedding_dim"], t["dtype"])
                    for t in header["tables"]]
            self._real_pmem = (tier_of(self.tier).dax and use_libpmem is not False and libpmem() is not None
                               and detect_dax(self.storage_dir))
            tier = tier_of(self.tier, real_pmem=self._real_pmem)
            # What a table may ask of the pool (memory_pool/table.py): nothing else of it.
            host = TableHost(self.stats, check_open=self._check_open, check_writable=self._check_writable,
                             ready_rows=self._ready_rows, persist_rows=self.persist_rows, bulk_load=self._bulk_load,
                             note_reset=self._note_reset, real_pmem=bool(self._real_pmem),
                             written=lambda name, ids=None: self.fresh.written(name, ids), exposed=self._exposed,
                             peek_rows=lambda name, ids: self._replayer.peek(name, ids), initial_rows=lambda *a: self.fresh.initial(*a))
            self._tables = TableSet(host, cfgs, where=self.path, tier=tier, storage_dir=self.storage_dir,
                                    read_only=read_only, dram_cache_bytes=dram_cache_bytes)
            self._arena = self._tables.arena
            self.journaled = tier.journaled
            # Emulated power loss (memory_pool/fileio.py): power-sim always, emulated pmem when
            # the crash tests ask for it. From here on every file operation of the pool is watched.
            self._watched = self.journaled and not read_only and rows and tier.emulates_power_loss()
            if self._watched:
                fileio.watch(self.storage_dir)
            runs_dir = self.storage_dir / RUNS_DIR
            has_runs = self.journaled and rows and (runs_dir / MANIFEST).exists()
            self.journal = open_journal(self.storage_dir, tier, read_only=read_only)
            # (the applied mark: the replay skips the rows the images' page cache holds, see Replayer)
            mark = AppliedMark(header["pool_id"], lambda: [self.storage_dir / JOURNAL_DIR] + [
                table_file(self.storage_dir, t["name"]) for t in self._header["tables"]], self.path) \
                if tier.applied_mark else None
            self._compaction = Compaction(
                self.journal, self._tables, self.stats, storage_dir=self.storage_dir, journaled=self.journaled,
                rows=rows, mark=mark, has_runs=has_runs, table_names=[t["name"] for t in header["tables"]],
                apply_pending=lambda **kw: self._replayer.apply_pending(**kw), runs_format=self._runs_format)
            self._replayer = Replayer(self.journal, self._tables, self.stats, self._compaction)
            plan, window = self._replayer.plan({t["name"] for t in header["tables"]}, self.path,
                                               on_demand=replay == "on-demand") \
                if self.journaled and rows else ({}, None)
            self._tables.open_all(cfgs, rows=rows, pool_id=header["pool_id"], inits=header.get("inits"))
            self._replayer.start(plan, window, runs_dir=runs_dir if has_runs else None, read_only=read_only,
                                 replay=replay)
            self.stats.open_seconds = time.perf_counter() - t_open
        except BaseException:
            self.close()
            raise

    # -- the journal: transactions (memory_pool/transaction.py), persist (memory_pool/persistence.py),
    #    compaction (memory_pool/compaction.py)
    def begin(self, tag: int, doc: dict | None = None) -> Transaction:
        """A new journal transaction tagged ``tag`` (call order: memory_pool.transaction)."""
        self._check_writable()
        self._tables.save_fresh(once=True)  # (a pool made by this process has no file yet: fresh.py)
        return Transaction(self, tag, doc)

    def persist_rows(self, pairs) -> int:
        """Make ``[(table, ids)]`` (trusted ids) durable now, in one group commit; row bytes."""
        self._check_writable()
        self._compaction.check()  # (a failed background compaction is reported here first)
        self._tables.save_fresh(once=True)  # (as begin)
        self.ready(pairs)
        return persist_rows(self.journal if self.journaled else None, pairs)

    def compact(self, before_seq: int | None = None, *, wait: bool = True) -> Future | None:
        """Write journal segments back into the table images and drop them (the order:
        ``Compaction.compact``): every segment whose records all precede ``before_seq`` (default:
        every complete one). ``wait=False``: on a background thread (None if one is running)."""
        self._check_writable()
        if self.journal is None:
            return None
        return self._compaction.compact(before_seq, wait=wait)

    keeps_applied_mark = property(lambda self: self._compaction.keeps_applied_mark)  # (apply passes: Compaction)

    def apply(self, *, min_bytes: int = 1, wait: bool = False) -> Future | None:
        """Write the sealed journal segments not yet written back into the table images,
        unsynced (``Compaction.apply``). The checkpointer calls it after every commit."""
        self._check_writable()
        return self._compaction.apply(min_bytes=min_bytes, wait=wait)

    def bound_working_copy(self, names) -> None:  # (tables behind a DRAM cache: Compaction.bound)
        if self._compaction is not None:
            self._compaction.bound([self.table(n).region for n in names])

    def trim_working_copy(self, names, written: dict | None = None) -> bool:
        """``Compaction.trim`` for tables ``names`` (at a recovery point, nothing in flight); with
        ``written`` (``{name: rows written into the working copy}``), ``Compaction.refresh``."""
        self._check_writable()
        return self.journaled and (self._compaction.trim([self.table(n).region for n in names]) if written is None
                                   else self._compaction.refresh(written))

    def compactions_settled(self):
        """``Compaction.settled`` (a context manager): True with no compaction running inside, False
        where one holds the images now."""
        return self._compaction.settled()

    def pend_compacted(self, names, rows: torch.Tensor) -> torch.Tensor:
        """``Compaction.pend_compacted``: rows ``rows`` of tables ``names`` read the last
        compaction's value from now on; the mask of those that do (inside :meth:`compactions_settled`)."""
        self._check_writable()
        return self._compaction.pend_compacted(names, rows)

    overlay_bound = property(lambda self: self._compaction.overlay_bound)  # (bytes of runs the row overlay keeps; 0: none)

    def _runs_format(self) -> None:  # (a compaction, before the overlay's first manifest: Compaction.compact)
        if self._header.get("format_version") != RUNS_FORMAT_VERSION:
            self._write_header(format_version=RUNS_FORMAT_VERSION)

    @property
    def compacting(self) -> bool:
        """A background compaction runs. Raises a failed one's error, once (``Compaction.check``)."""
        self._compaction.check()
        return self._compaction.running

    @property
    def compactor_computing(self) -> bool:
        """A background compaction runs, past reading its journal in (``compacting`` raises)."""
        return self._compaction.computing

    def wait_compaction(self) -> None:  # (a background one, if running; its error raised)
        self._compaction.wait()

    # -- row gathering for the checkpointer: gather.RowGathering

    def flush_caches(self) -> int:  # (a recovery point's: TableSet.flush_caches)
        return self._tables.flush_caches()

    def arena_tensor(self, dtype: torch.dtype = torch.float32, *, on_demand: bool = False) -> torch.Tensor:
        """Every table of the pool as one flat tensor (no copy): table ``t`` starts at element
        ``t.arena_offset // dtype.itemsize``. What fbgemm's table-batched kernels take.

        Rows a replay on demand has not applied yet are applied first, unless ``on_demand``: the
        caller then calls :meth:`ready` with the rows of every batch before it reads them."""
        self._check_open()
        if not on_demand:
            self._replayer.apply_pending()
        self._exposed()  # (the kernels write rows that no cache admits: FreshRows.exposed)
        return self._arena.flat(dtype)

    fresh = property(lambda self: self._tables.fresh)  # (rows still initial, created not read: fresh.py)

    def _exposed(self, name: str | None = None) -> None:
        self._tables.fresh.exposed(name)

    # -- replay on demand (memory_pool/replay.py, memory_pool/ondemand.py)
    journal_rows_pending = property(lambda self: self._replayer.journal_rows_pending)  # (of rows_pending: Replayer)

    @property
    def rows_pending(self) -> int:
        """Journal (and run) rows an on-demand replay has not applied to the working copy yet."""
        return self._replayer.rows_pending

    def ready(self, pairs) -> None:
        """Apply the journal's (and the runs') rows among ``[(table, ids)]`` (trusted ids) that
        an on-demand replay has not applied yet: call it before reading them through
        :meth:`arena_tensor` (``on_demand=True``). Every other row path of the pool does it itself."""
        self._replayer.ready(pairs)

    def _ready_rows(self, name: str, ids: torch.Tensor | None = None) -> None:
        """:meth:`ready` for rows ``ids`` of table ``name`` (None: all of them): ``TableHost.ready_rows``."""
        self._replayer.ready_rows(name, ids)

    @contextlib.contextmanager
    def _bulk_load(self, name: str):
        """``TableHost.bulk_load``: around a bulk load of table ``name`` into its image
        (``Table.load_``, ``fill_``), from before its pending rows are forgotten until its reset
        is committed: no compaction and no write-back pass runs (``Compaction.images_held``)."""
        with self._compaction.images_held():
            self._replayer.forget(name)
            yield

    def _note_reset(self, name: str) -> None:
        """``TableHost.note_reset``: table ``name`` was loaded whole into its image, durably
        (``Compaction.note_reset``)."""
        self._compaction.note_reset(name)

    # -- construction
    @classmethod
    def create(cls, path, *, tier: str = "auto", capacity_bytes: int | None = None,
               dram_cache_bytes: int | None = None, use_libpmem: bool | None = None,
               meta: Mapping | None = None) -> "MemoryPool":
        """Make a new, empty pool at directory ``path`` (created; must not hold a pool).

        ``capacity_bytes``: most table bytes the pool may hold (None: only the disk limits).
        ``dram_cache_bytes``: DRAM budget; tables beyond it are served through a row cache.
        ``use_libpmem``: None uses libpmem when installed; False never; True requires it.
        """
        path, header, lock_fd = make_pool_dir(path, tier=tier, capacity_bytes=capacity_bytes,
                                        dram_cache_bytes=dram_cache_bytes, use_libpmem=use_libpmem, meta=meta)
        return cls(path, header, read_only=False, lock_fd=lock_fd,
                   dram_cache_bytes=dram_cache_bytes, use_libpmem=use_libpmem)

    @classmethod
    def open(cls, path, *, read_only: bool = False, dram_cache_bytes: int | None = None,
             use_libpmem: bool | None = None, consistent: bool = False, rows: bool = True,
             replay: str = "eager") -> "MemoryPool":
        """Open an existing pool. A writer takes the lock; ``read_only`` takes none.

        ``rows=False`` (read-only): the header and the journal only, no table mapped and no row
        replayed: what a look at the pool's status needs (``meta``, the journal's commits), at
        the cost of a scan of the journal's headers. On `kaggle` a full open replays up to a GB
        of rows into a working copy of several GB, for nothing.

        ``replay="on-demand"``: the journal's committed rows are read and verified, but applied to
        the working copy only when first needed (memory_pool/ondemand.py): after a power loss the
        open does not wait for the random reads of every image page they land in. What the
        trainer uses; ``"eager"`` (the default) applies them all before returning.

        ``consistent`` (read-only): hold a shared lock while open, so that no writer can change
        the pool under this reader, and refuse (PoolLockedError) if a writer is training it now:
        a reader beside a writer could otherwise see rows of a step being applied (shm) or a
        compaction rewriting the image (journaled tiers). What ``inspect``, ``eval`` and
        ``export`` use."""
        path = Path(path)
        header, lock_fd = open_pool_dir(path, read_only=read_only, consistent=consistent,
                                        dram_cache_bytes=dram_cache_bytes, use_libpmem=use_libpmem, rows=rows,
                                        replay=replay)
        # On failure __init__ closes what it opened, the lock included.
        return cls(path, header, read_only=read_only, lock_fd=lock_fd,
                   dram_cache_bytes=dram_cache_bytes, use_libpmem=use_libpmem, rows=rows, replay=replay)

    # -- description
    tier = property(lambda self: self._header["tier"])
    pool_id = property(lambda self: self._header["pool_id"])

    @property
    def storage_dir(self) -> Path:
        """Where the table files (and the checkpointer's files) live: the shm region for the
        shm tier, else the pool directory itself -- wherever it is now, so that a pool that was
        moved, copied, or created through a relative path opens its own files."""
        if tier_of(self.tier).files_in_shm:
            return Path(self._header["storage_dir"])
        return self.path

    capacity_bytes = property(lambda self: self._header["capacity_bytes"])

    @property
    def meta(self) -> dict:
        """Free-form metadata (the trainer keeps its model config here). Read-only view."""
        return json.loads(json.dumps(self._header["meta"]))

    @property
    def real_pmem(self) -> bool:
        """A DAX mount with libpmem: rows are flushed with cache-line flushes, not journaled."""
        return bool(self._real_pmem)

    @property
    def tier_info(self) -> Tier:
        """The pool's :class:`~memory_pool.tiers.Tier`: what survives, how rows persist, where files live."""
        return tier_of(self.tier, real_pmem=self.real_pmem)

    libpmem_used = property(lambda self: self.real_pmem)
    durability = property(lambda self: self.tier_info.durability)

    def tables(self) -> list[str]:
        return list(self._tables)

    def __contains__(self, name: str) -> bool:
        return name in self._tables

    def table(self, name: str) -> Table:
        self._check_open()
        return self._tables.table(name)

    def used_bytes(self) -> int:
        return self._tables.used_bytes()

    def describe(self) -> dict:
        return {
            "path": str(self.path),
            "pool_id": self.pool_id,
            "format_version": self._header.get("format_version", FORMAT_VERSION),
            "tier": self.tier,
            "durability": self.durability,
            "storage_dir": str(self.storage_dir),
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes(),
            "dram_cache_bytes": self.dram_cache_bytes,
            "tables": self._tables.describe(),
            "meta": self.meta,
            "overlay": self._compaction.overlay.describe() if self._compaction.overlay is not None else None,
            "fresh_rows": {n: c for n in self.tables() if (c := self.fresh.count(n))},
        }

    # -- changes
    def create_table(self, name: str, num_embeddings: int, embedding_dim: int, *, dtype: str = "float32",
                     init: str = "zeros", scale: float | None = None, seed: int = 0) -> Table:
        """Add a table. Its file is fully allocated now, so a full disk fails here (pool unchanged)."""
        self._check_writable()
        return self._tables.add(TableConfig(name, num_embeddings, embedding_dim, dtype), init=init, scale=scale,
                                seed=seed, capacity=self.capacity_bytes, lock=self._meta_lock,
                                write_header=self._write_header)

    def set_meta(self, **items) -> None:
        """Merge ``items`` (JSON-serialisable) into the header's meta, durably."""
        self._check_writable()
        with self._meta_lock:
            meta = dict(self._header["meta"])
            meta.update(json_copy(items, "set_meta"))
            self._write_header(meta=meta)

    def _write_header(self, **changes) -> None:
        """Write the header for the current tables (plus ``changes``); the in-memory header is
        replaced only once the new one is durable, so a failed write changes nothing. Under the
        header's lock: the compactor's thread calls it too (format version 3), and two writers
        would each start from the same old header (and share its temporary file)."""
        with self._meta_lock:
            header = {**self._header, **changes, "tables": [asdict(t.config) for t in self._tables.values()],
                      "inits": self._tables.inits}  # (each table's initializer: TableSet.add)
            atomic_write(self.path / HEADER, header_bytes(header))
            self._header = header

    def lookup(self, kjt, tables: Mapping[str, str] | None = None):
        """Sum-pooled lookup of a TorchRec ``KeyedJaggedTensor``: a ``KeyedTensor``, one [B, dim]
        block per key, each key looked up in the table of the same name, or ``tables[key]``
        (memory_pool/kjt_lookup.py)."""
        self._check_open()
        return lookup_kjt(self.table, kjt, tables)

    def persist(self) -> int:
        """Make every row written since the last persist durable (per the tier's durability):
        on a journaled tier, one group commit for all tables."""
        self._check_writable()
        self._compaction.check()  # (a failed background compaction is reported here first)
        self._tables.save_fresh(once=True)  # (as begin)
        # (dirty until the transaction is durable: a failed persist leaves them to its retry)
        return self.stats.counted_persist(lambda: persist_rows(
            self.journal if self.journaled else None, [(t, t.region.dirty_rows()) for t in self._tables.values()]))

    # -- lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise PoolFormatError(f"pool {self.path} is closed", hint="open it again with MemoryPool.open")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise PoolReadOnlyError(f"pool {self.path} was opened read-only")

    def close(self) -> None:
        """Release mappings and the lock. Does not persist: call :meth:`persist` first."""
        if self._closed:
            return
        self._closed = True
        if self._compaction is not None:
            self._compaction.close()  # (its thread stopped, then the overlay closed)
        if self._replayer is not None:
            self._replayer.close()
        if self.journal is not None:
            self.journal.close()
        if self._tables is not None:
            self._tables.close()
        # The pool and its tables refer to each other, so they wait for the cyclic GC; the arena
        # (the working copy: on `kaggle` several GB) must not: with no reference left here it is
        # unmapped now, or when the last view a caller still holds is gone.
        self._arena = None
        watched, lock_fd, self._watched, self._lock_fd = self._watched, self._lock_fd, False, None
        close_pool_dir(self.path, self.storage_dir, self._header["pool_id"], watched=watched, lock_fd=lock_fd)

    def __del__(self) -> None:
        # A pool dropped without close() must not keep its writer lock for the life of the process.
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "MemoryPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemoryPool({str(self.path)!r}, tier={self.tier}, tables={len(self._tables)})"


