"""The memory pool: a directory of embedding tables in one tier, with a checksummed header
(``header.py``), one table object per table (``table.py``), an arena holding them all
(``arena.py``) and a journal (``journal.py``).

Layout of a pool directory::

    DIR/pool.json       header: magic, format version, pool id, tier, tables, meta, crc32
    DIR/LOCK            the writer lock (flock; released by the kernel when the writer dies)
    DIR/tables/*.bin    table rows, row-major (pmem, power-sim)
    /dev/shm/dlrm-cxl-<pool id>/tables/*.bin   table rows for the shm tier
    <storage_dir>/journal/   the persistence journal (rows persisted on a journaled tier, and
                        the checkpointer's records on every tier); in the same tier as the rows
    <storage_dir>/ckpt/      the checkpointer's marker files
    /dev/shm/dlrm-cxl-applied.<pool id>.<key>   emulated pmem: how far the images' page cache
                        is up to date (persistence.AppliedMark; lost with the page cache)

Exactly one writer at a time holds ``LOCK``; read-only opens take no lock and map the files
privately, so they never change them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Mapping

import torch

from . import fileio
from .durable import atomic_write
from ._native import libpmem
from .cache import RowCache
from .header import FORMAT_VERSION, HEADER, MAGIC, RUNS_FORMAT_VERSION, header_bytes, read_header
from .table import PoolStats, Table, TableConfig
from .validation import env_mib, is_int, json_copy, validate_init, validate_table_config
from .errors import (
    InvalidConfigError,
    PoolCorruptError,
    PoolExistsError,
    PoolFormatError,
    PoolFullError,
    PoolLockedError,
    PoolReadOnlyError,
    PoolVolatileError,
    TableExistsError,
    TableNotFoundError,
)
from .lifecycle import REGION_PREFIX, owns_region, record_owner
from .writer_lock import take_lock
from .arena import Arena, page_round
from .journal import Journal
from .overlay import MANIFEST, RUNS_DIR
from .persistence import AppliedMark, persist_rows
from .tiers import TIERS, detect_dax, durability_of, is_journaled, libpmem_missing, open_region, shm_root
from .compaction import Compaction
from .replay import REPLAY_MODES, Replayer
from .gather import RowGather, copy_row_gathers, row_gathers, rows_per_pair
from .kjt_lookup import lookup_kjt

__all__ = ["MemoryPool", "RowGather", "Table", "TableConfig", "PoolStats", "destroy_pool", "MAGIC", "FORMAT_VERSION",
           "HEADER", "read_header", "REPLAY_MODES"]


# --------------------------------------------------------------------------- pool


def _resolve_tier(tier: str, path: Path) -> str:
    if tier == "auto":
        # Durable beats fast: a fault-tolerant trainer wants rows that survive power loss.
        # pmem is real when the directory is on a DAX mount, emulated (msync) otherwise.
        return "pmem"
    if tier not in TIERS:
        raise InvalidConfigError(f"tier must be one of {TIERS + ('auto',)}, got {tier!r}")
    return tier


def _segment_bytes() -> int:
    """Journal segment size: 64 MiB, or ``DLRM_CXL_SEGMENT_MB`` (tests and crash torture: small
    segments are sealed, written back and dropped within a few steps)."""
    env = env_mib("DLRM_CXL_SEGMENT_MB")
    return 64 << 20 if env is None else max(4096, env)


def _check_libpmem_request(tier: str, use_libpmem: bool | None) -> None:
    if use_libpmem is True and tier == "pmem" and libpmem() is None:
        raise libpmem_missing()


class MemoryPool:
    """A pool of embedding tables. Create with :meth:`create`, reopen with :meth:`open`.

    Use as a context manager; ``close`` releases the mappings and the writer lock. A pool
    opened ``read_only`` takes no lock and can sit beside a writer.
    """

    def __init__(self, path: Path, header: dict, *, read_only: bool, lock_fd: int | None,
                 dram_cache_bytes: int | None, use_libpmem: bool | None, rows: bool = True,
                 replay: str = "eager"):
        self.path = Path(path)
        self._rows = rows
        self._compaction: Compaction | None = None   # write-back, sync, runs, START (memory_pool/compaction.py)
        self._replayer: Replayer | None = None       # the journal's rows into the working copy (memory_pool/replay.py)
        self._header = header
        self.read_only = read_only
        self._lock_fd = lock_fd
        self._closed = False
        self._use_libpmem = use_libpmem
        self.dram_cache_bytes = dram_cache_bytes
        self._dram_left = dram_cache_bytes
        t_open = time.perf_counter()
        self.stats = PoolStats()
        self._tables: dict[str, Table] = {}
        self._watched = False   # emulated power loss on (set below, once the tier is known)
        # The header's lock: every read-modify-write of self._header and of its temporary file
        # (set_meta, create_table, and the compactor's thread writing format version 3 before
        # the overlay's first manifest) holds it, or one of two racing writers loses its update.
        self._meta_lock = threading.RLock()
        self.journal: Journal | None = None
        try:
            cfgs = [TableConfig(t["name"], t["num_embeddings"], t["embedding_dim"], t["dtype"])
                    for t in header["tables"]]
            total = sum(c.nbytes for c in cfgs)
            # One address range for every table (see arena.py); room for tables created later.
            need = sum(page_round(c.nbytes) for c in cfgs)
            self._arena = Arena(need + max(need, 16 << 30))
            self._real_pmem = (self.tier == "pmem" and use_libpmem is not False and libpmem() is not None
                               and detect_dax(self.storage_dir))
            self.journaled = is_journaled(self.tier, self._real_pmem)
            # Emulated power loss (memory_pool/fileio.py): power-sim always, emulated pmem when
            # the crash tests ask for it. From here on every file operation of the pool is watched.
            self._watched = self.journaled and not read_only and rows and (
                self.tier == "power-sim" or os.environ.get(fileio.ENV) == "1")
            if self._watched:
                fileio.watch(self.storage_dir)
            runs_dir = self.storage_dir / RUNS_DIR
            has_runs = self.journaled and rows and (runs_dir / MANIFEST).exists()
            # The pool's journal: rows persisted on a journaled tier, and the checkpointer's
            # records on every tier. Synced except where a sync means nothing (shm is RAM and
            # survives only a trainer crash; a dram pool survives nothing); there, records are
            # copied into a mapping of the segment instead of written (see "Mapped segments").
            in_ram = self.tier in ("shm", "dram")
            self.journal = Journal(self.storage_dir / "journal", sync=not in_ram, mapped=in_ram,
                                   direct=not in_ram, read_only=read_only, segment_bytes=_segment_bytes())
            if self.journaled and not read_only and all(r.tag < 0 for r in self.journal.tail) and (
                    self.journal.tail or self.journal.torn_bytes):
                # An unfinished transaction of persisted rows (or a torn record): never vouched
                # for, never replayed. Drop it so that the next transaction does not end up
                # sealing it. (Records of training steps are the checkpointer's: its recovery
                # reports and drops them.)
                self.journal.truncate_tail()
            # The committed rows of the journal go into this process's private working copy:
            # memory copies, no system call per row (the image is brought up to date later, by
            # compaction; the journal keeps them until then, so this is idempotent). Not marked
            # dirty: they are durable already. Rows that the images' page cache already holds
            # (below the applied mark: a crash of the trainer, not of the machine) are skipped.
            mark = AppliedMark(header["pool_id"], lambda: [self.storage_dir / "journal"] + [
                self.storage_dir / "tables" / f"{t['name']}.bin" for t in self._header["tables"]], self.path) \
                if self.journaled and self.tier == "pmem" else None
            self._compaction = Compaction(
                self.journal, self._tables, self.stats, storage_dir=self.storage_dir, journaled=self.journaled,
                rows=rows, mark=mark, has_runs=has_runs, table_names=[t["name"] for t in header["tables"]],
                apply_pending=lambda **kw: self._replayer.apply_pending(**kw), runs_format=self._runs_format)
            self._replayer = Replayer(self.journal, self._tables, self.stats, self._compaction)
            plan, window = self._replayer.plan({t["name"] for t in header["tables"]}, self.path,
                                               on_demand=replay == "on-demand") \
                if self.journaled and rows else ({}, None)
            # When the tables of an existing pool do not all fit the DRAM budget, it is split in
            # proportion to their sizes, so every table gets a cache of the same fraction of its
            # rows (the budget covers each cache's map and metadata too).
            split = dram_cache_bytes is not None and total > dram_cache_bytes
            for cfg in cfgs if rows else ():
                share = dram_cache_bytes * cfg.nbytes // total if split else None
                self._tables[cfg.name] = self._attach(cfg, create=False, share=share)
            self._replayer.start(plan, window, runs_dir=runs_dir if has_runs else None, read_only=read_only,
                                 replay=replay)
            if split:
                self._dram_left = 0
            self.stats.open_seconds = time.perf_counter() - t_open
        except BaseException:
            self.close()
            raise

    # -- the journal: persist (memory_pool/persistence.py), compaction (memory_pool/compaction.py)
    def persist_rows(self, pairs) -> int:
        """Make ``[(table, ids)]`` durable now (trusted ids), in one group commit on a
        journaled tier. Returns the row bytes persisted."""
        self._check_writable()
        self._compaction.check()  # (a failed background compaction is reported here first)
        self.ready(pairs)
        return persist_rows(self.journal if self.journaled else None, pairs)

    def compact(self, before_seq: int | None = None, *, wait: bool = True) -> Future | None:
        """Write journal segments back into the table images and drop them: every segment
        whose records all precede ``before_seq`` (default: every complete segment). With
        ``wait=False`` it runs on a background thread (one at a time; None if one is running).
        The order of a compaction: ``Compaction.compact``."""
        self._check_writable()
        if self.journal is None:
            return None
        return self._compaction.compact(before_seq, wait=wait)

    @property
    def keeps_applied_mark(self) -> bool:
        """Opening after a crash of the trainer trusts the images' page cache (emulated pmem):
        write-back passes between compactions (:meth:`apply`) shorten its replay. Not on
        ``power-sim``, which replays everything as after a power loss."""
        return self._compaction.keeps_applied_mark

    def apply(self, *, min_bytes: int = 1, wait: bool = False) -> Future | None:
        """Write the sealed journal segments not yet written back into the table images,
        unsynced, and move the applied mark after them (``Compaction.apply``). The checkpointer
        calls this after every commit (cheap when there is nothing to do)."""
        self._check_writable()
        return self._compaction.apply(min_bytes=min_bytes, wait=wait)

    @property
    def overlay_bound(self) -> int:
        """Bytes of runs the row overlay keeps (memory_pool/overlay.py); 0: no overlay."""
        return self._compaction.overlay_bound

    def _runs_format(self) -> None:
        # (a compaction, before the overlay's first manifest: see Compaction.compact)
        if self._header.get("format_version") != RUNS_FORMAT_VERSION:
            self._write_header(format_version=RUNS_FORMAT_VERSION)

    @property
    def compacting(self) -> bool:
        """A background compaction is running. Raises the error of one that failed, once (typed:
        see ``Compactor.check``): the checkpointer reads this after every commit, on the journal
        writer's thread, whose error reaches the trainer at its next commit -- a failure nobody
        looked at let the journal grow until the disk filled."""
        self._compaction.check()
        return self._compaction.running

    def wait_compaction(self) -> None:
        """Wait for a background compaction, if one is running (and raise its error)."""
        self._compaction.wait()

    # -- row gathering for the checkpointer (memory_pool/gather.py)
    def gather_rows(self, pairs, buffers: dict | None = None) -> list[torch.Tensor]:
        """Copies of rows ``[(table, ids)]`` (trusted ids), one tensor per pair (views of
        :meth:`gather_row_groups`' buffers)."""
        return self.rows_per_pair(pairs, self.gather_row_groups(pairs, buffers))

    rows_per_pair = staticmethod(rows_per_pair)
    copy_row_gathers = staticmethod(copy_row_gathers)

    def gather_row_groups(self, pairs, buffers: dict | None = None) -> list[tuple[list[int], torch.Tensor]]:
        """Copies of rows ``[(table, ids)]`` (trusted ids), grouped: ``[(indexes into pairs,
        their rows concatenated in that order)]`` (see :meth:`row_gathers`)."""
        return self.copy_row_gathers(self.row_gathers(pairs), buffers)

    def row_gathers(self, pairs) -> list[RowGather]:
        """How to copy rows ``[(table, ids)]`` (trusted ids), grouped (``gather.row_gathers``):
        nothing is copied yet."""
        self._check_open()
        self.ready(pairs)
        return row_gathers(self._arena, pairs)

    def arena_tensor(self, dtype: torch.dtype = torch.float32, *, on_demand: bool = False) -> torch.Tensor:
        """Every table of the pool as one flat tensor (no copy): table ``t`` starts at element
        ``t.arena_offset // dtype.itemsize``. What fbgemm's table-batched kernels take.

        Rows a replay on demand has not applied yet are applied first, unless ``on_demand``: the
        caller then calls :meth:`ready` with the rows of every batch before it reads them."""
        self._check_open()
        if not on_demand:
            self._replayer.apply_pending()
        return self._arena.flat(dtype)

    # -- replay on demand (memory_pool/replay.py, memory_pool/ondemand.py)
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
        self._replayer.ready_rows(name, ids)

    @contextlib.contextmanager
    def _bulk_load(self, name: str):
        """Around a bulk load of table ``name`` into its image (``Table.load_``, ``fill_``), from
        before its pending rows are forgotten until its reset is committed: no compaction and no
        write-back pass runs. Both write the table's older journal rows (the overlay its run
        rows) into the same image: one running beside the load put them back over the loaded
        rows (1.0 read where 5.0 was loaded, in memory and after a reopen). One running now is
        waited for (and its error raised); one started meanwhile waits for the lock, and then
        finds the reset committed (it skips the rows older than it)."""
        with self._compaction.images_held():
            self._replayer.forget(name)
            yield

    def _note_reset(self, name: str) -> None:
        """Table ``name`` was loaded whole into its image, durably: its reset marker
        (``Compaction.note_reset``). Inside _bulk_load."""
        self._compaction.note_reset(name)

    def _remap(self, table: "Table") -> None:
        r = table._region
        self._arena.map_file(r.offset, r.fd, r.nbytes, shared=r.shared, writable=not r.read_only)

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
        path = Path(path)
        tier = _resolve_tier(tier, path)
        for name, v in (("capacity_bytes", capacity_bytes), ("dram_cache_bytes", dram_cache_bytes)):
            if v is not None and (not is_int(v) or v < 0):
                raise InvalidConfigError(f"{name} must be None or an int >= 0, got {v!r}")
        _check_libpmem_request(tier, use_libpmem)
        _segment_bytes()  # a bad DLRM_CXL_SEGMENT_MB is refused before anything is made
        meta = json_copy(dict(meta or {}), "meta")
        if (path / HEADER).exists():
            raise PoolExistsError(f"{path} already holds a pool")
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise PoolExistsError(f"{path} exists and is not an empty directory")
        made_dir = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        lock_fd = cls._lock(path)
        pool_id = uuid.uuid4().hex
        storage = (shm_root() / f"{REGION_PREFIX}{pool_id}") if tier == "shm" else path
        try:
            if (path / HEADER).exists():  # a concurrent create won the race
                raise PoolExistsError(f"{path} already holds a pool")
            (storage / "tables").mkdir(parents=True, exist_ok=True)
            if tier == "shm":
                # Names the pool that owns the region, so that `dlrm-cxl gc` can tell a region
                # whose directory was deleted by hand (rm -rf) from one in use.
                record_owner(storage, path.resolve(), pool_id)
            header = {
                "magic": MAGIC,
                "format_version": FORMAT_VERSION,
                "pool_id": pool_id,
                "tier": tier,
                "storage_dir": str(storage.resolve()),
                "capacity_bytes": capacity_bytes,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "tables": [],
                "meta": meta,
            }
            # The header is the pool's commit marker: written last, atomically and durably.
            atomic_write(path / HEADER, header_bytes(header))
        except BaseException:
            # Undo what this call made (we hold the lock), so that a retry finds no debris.
            if not (path / HEADER).exists():
                if tier == "shm":
                    shutil.rmtree(storage, ignore_errors=True)
                shutil.rmtree(path / "tables", ignore_errors=True)
                for leftover in (path / f".{HEADER}.tmp", path / "LOCK"):
                    try:
                        leftover.unlink()
                    except OSError:
                        pass
                if made_dir:
                    try:
                        path.rmdir()
                    except OSError:
                        pass
            os.close(lock_fd)
            raise
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
        if dram_cache_bytes is not None and (not is_int(dram_cache_bytes) or dram_cache_bytes < 0):
            raise InvalidConfigError(f"dram_cache_bytes must be None or an int >= 0, got {dram_cache_bytes!r}")
        header = read_header(path)
        _check_libpmem_request(header["tier"], use_libpmem)
        if header["tier"] == "dram":
            raise PoolVolatileError(f"{path} is a dram pool: its rows lived in the process that created it")
        if header["tier"] == "shm" and not Path(header["storage_dir"]).is_dir():
            raise PoolVolatileError(
                f"{path}: shm region {header['storage_dir']} is gone (the machine was restarted?)",
                hint="shm pools survive a trainer crash, not a reboot; use --tier pmem for that")
        if not rows and not read_only:
            raise InvalidConfigError("rows=False opens a pool read-only: pass read_only=True")
        if replay not in REPLAY_MODES:
            raise InvalidConfigError(f"replay must be one of {REPLAY_MODES}, got {replay!r}")
        if read_only:
            lock_fd = cls._lock(path, shared=True) if consistent else None
        else:
            lock_fd = cls._lock(path)
        if header["tier"] in ("pmem", "power-sim") and fileio.pending(path):
            header = cls._power_on(path, header, locked=lock_fd is not None and not read_only)
        # On failure __init__ closes what it opened, the lock included.
        return cls(path, header, read_only=read_only, lock_fd=lock_fd,
                   dram_cache_bytes=dram_cache_bytes, use_libpmem=use_libpmem, rows=rows, replay=replay)

    @classmethod
    def _power_on(cls, path: Path, header: dict, *, locked: bool) -> dict:
        """The emulated power loss a crashed writer left (memory_pool/fileio.py): what it never
        synced is taken back, before anything of the pool is read. Needs the writer lock (a
        reader takes it for the moment; beside a live writer there was no power loss)."""
        probe = None
        if not locked:
            try:
                probe = cls._lock(path)
            except PoolLockedError:
                return header
        try:
            fileio.power_on(path)
            # A power loss is a reboot: the applied mark in RAM (pmem) vouches for nothing now.
            AppliedMark(header["pool_id"], lambda: [], path).remove()
        finally:
            if probe is not None:
                os.close(probe)
        return read_header(path)

    @staticmethod
    def _lock(path: Path, *, shared: bool = False) -> int | None:
        """The writer lock (exclusive), or a reader's shared lock. Both non-blocking
        (memory_pool/writer_lock.py)."""
        return take_lock(path, shared=shared)

    def _attach(self, cfg: TableConfig, *, create: bool, share: int | None = None) -> Table:
        tier = self.tier
        file = None if tier == "dram" else self.storage_dir / "tables" / f"{cfg.name}.bin"
        if not create and file is not None and not file.exists():
            raise PoolCorruptError(f"{self.path}: table file {file} is missing")
        region = open_region(self._arena, tier, file, cfg.num_embeddings, cfg.embedding_dim, cfg.dtype,
                             create=create, read_only=self.read_only, real_pmem=self._real_pmem)
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
        return Table(self, cfg, region, cache_rows)

    # -- description
    tier = property(lambda self: self._header["tier"])
    pool_id = property(lambda self: self._header["pool_id"])

    @property
    def storage_dir(self) -> Path:
        """Where the table files (and the checkpointer's files) live: the shm region for the
        shm tier, else the pool directory itself -- wherever it is now, so that a pool that was
        moved, copied, or created through a relative path opens its own files."""
        if self.tier == "shm":
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
    def libpmem_used(self) -> bool:
        return self.real_pmem

    @property
    def durability(self) -> str:
        return durability_of(self.tier, real_pmem=self.real_pmem, libpmem_used=self.libpmem_used)

    def tables(self) -> list[str]:
        return list(self._tables)

    def __contains__(self, name: str) -> bool:
        return name in self._tables

    def table(self, name: str) -> Table:
        self._check_open()
        if not self._rows:
            raise TableNotFoundError(f"pool {self.path} was opened with rows=False: no table is mapped",
                                     hint="open it with rows=True (the default) to read its tables")
        try:
            return self._tables[name]
        except KeyError:
            raise TableNotFoundError(f"no table {name!r} in pool {self.path} (has: {', '.join(self._tables) or 'none'})") from None

    def used_bytes(self) -> int:
        return sum(t.config.nbytes for t in self._tables.values())

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
            "tables": [
                {**asdict(t.config), "bytes": t.config.nbytes, "cached": t.cached,
                 "cache_rows": t._cache.capacity if t._cache else 0}
                for t in self._tables.values()
            ],
            "meta": self.meta,
            "overlay": self._compaction.overlay.describe() if self._compaction.overlay is not None else None,
        }

    # -- changes
    def create_table(self, name: str, num_embeddings: int, embedding_dim: int, *, dtype: str = "float32",
                     init: str = "zeros", scale: float | None = None, seed: int = 0) -> Table:
        """Add a table. Its file is fully allocated now, so a full disk fails here (pool unchanged)."""
        self._check_writable()
        cfg = TableConfig(name, num_embeddings, embedding_dim, dtype)
        validate_table_config(cfg)
        validate_init(init)
        if name in self._tables:
            raise TableExistsError(f"table {name!r} already exists in pool {self.path}")
        cap = self.capacity_bytes
        if cap is not None and self.used_bytes() + cfg.nbytes > cap:
            raise PoolFullError(
                f"table {name!r} needs {cfg.nbytes} bytes; pool has {cap - self.used_bytes()} of {cap} left")
        dram_left = self._dram_left
        table = self._attach(cfg, create=True)
        try:
            if init != "zeros":
                table.fill_(init, scale=scale, seed=seed)
            if table._region.tier in ("pmem", "power-sim"):
                # The image and its name durable before the header lists it: a power loss
                # after the header's write must not leave a table file that is missing or short.
                fileio.fsync(table._region.fd)
                fileio.fsync_dir(table._region.path.parent)
            with self._meta_lock:  # (no other header write lists the table before this one, or misses it after)
                self._tables[name] = table
                self._write_header()
        except BaseException:
            with self._meta_lock:
                self._dram_left = dram_left
                self._tables.pop(name, None)
            table._region.close()
            if table._region.tier != "dram":
                try:
                    fileio.unlink(table._region.path)
                except OSError:
                    pass
            raise
        return table

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
            header = {**self._header, **changes, "tables": [asdict(t.config) for t in self._tables.values()]}
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
        t0 = time.perf_counter()
        # (dirty until the transaction is durable: a failed persist leaves them to its retry)
        n = persist_rows(self.journal if self.journaled else None,
                         [(t, t._region.dirty_rows()) for t in self._tables.values()])
        st = self.stats
        st.persist_calls += 1
        st.bytes_persisted += n
        st.persist_seconds += time.perf_counter() - t0
        return n

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
        for t in self._tables.values():
            t._region.close()
            t._region.arena = None
            t._cache = None
        # The pool and its tables refer to each other, so they wait for the cyclic GC; the arena
        # (the working copy: on `kaggle` several GB) must not: with no reference left here it is
        # unmapped now, or when the last view a caller still holds is gone.
        self._arena = None
        if self._watched:
            # Closing is a moment the power may go: what this process never synced is taken
            # back now (fileio.power_on), so the files a closed pool leaves are exactly its
            # durable state. A process that dies instead leaves its undo log to the next open.
            fileio.unwatch(self.storage_dir)
            self._watched = False
            if self._lock_fd is not None:
                fileio.power_on(self.storage_dir)
                AppliedMark(self._header["pool_id"], lambda: [], self.path).remove()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

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


def destroy_pool(path) -> None:
    """Delete a pool directory and its shm region (if any). Takes the writer lock first.

    A directory without a pool header (and not empty) is refused, not deleted: ``--fresh`` on a
    mistyped ``--pool`` must never remove someone's files. A pool with a damaged header is a pool.
    """
    path = Path(path)
    if path.is_dir() and not (path / HEADER).exists() and any(path.iterdir()):
        raise PoolFormatError(f"{path} is not a pool (no {HEADER}); refusing to delete it",
                              hint="check --pool; only pool directories are deleted")
    try:
        header = read_header(path)
    except PoolFormatError:
        header = None
    if header is not None:
        fd = MemoryPool._lock(path)
        try:
            # Only an shm pool has files outside its directory, in its own region named after
            # its id; the storage_dir of other tiers is where the pool was created, which for a
            # copied or moved pool is another pool's directory and must not be touched.
            storage = Path(header.get("storage_dir", path))
            if owns_region(header, storage):
                shutil.rmtree(storage, ignore_errors=True)
            if header.get("pool_id"):
                AppliedMark(header["pool_id"], list).remove()
        finally:
            os.close(fd)
    shutil.rmtree(path, ignore_errors=True)
