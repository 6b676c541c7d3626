"""A pool's directory: its layout, making one (``MemoryPool.create``), opening one
(``MemoryPool.open``: the checks, the lock, the emulated power loss a crashed writer left, the
journal), and deleting one (:func:`destroy_pool`).

Layout of a pool directory::

    DIR/pool.json       header: magic, format version, pool id, tier, tables, meta, crc32
    DIR/LOCK            the writer lock (flock; released by the kernel when the writer dies)
    DIR/tables/*.bin    table rows, row-major (pmem, power-sim)
    /dev/shm/dlrm-cxl-<pool id>/tables/*.bin   table rows for the shm tier
    <storage_dir>/journal/   the persistence journal (rows persisted on a journaled tier, and
                        the checkpointer's records on every tier); in the same tier as the rows
    <storage_dir>/runs/      the row overlay's runs (large journaled pools: memory_pool/overlay.py)
    <storage_dir>/ckpt/      the checkpointer's marker files
    /dev/shm/dlrm-cxl-applied.<pool id>.<key>   emulated pmem: how far the images' page cache
                        is up to date (persistence.AppliedMark; lost with the page cache)
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Mapping

from . import fileio
from ._native import libpmem
from .durable import atomic_write
from .errors import InvalidConfigError, PoolExistsError, PoolFormatError, PoolLockedError, PoolVolatileError
from .header import FORMAT_VERSION, HEADER, JOURNAL_DIR, MAGIC, TABLES_DIR, header_bytes, read_header
from .journal import Journal
from .lifecycle import REGION_PREFIX, owns_region, record_owner
from .persistence import AppliedMark
from .replay import REPLAY_MODES
from .tiers import Tier, libpmem_missing, resolve_tier, shm_root, tier_of
from .validation import env_mib, is_int, json_copy
from .writer_lock import LOCK_FILE, take_lock

__all__ = ["resolve_tier", "segment_bytes", "check_libpmem_request", "make_pool_dir", "open_pool_dir", "close_pool_dir", "power_on",
           "open_journal", "destroy_pool"]


def segment_bytes() -> int:
    """Journal segment size: 64 MiB, or ``DLRM_CXL_SEGMENT_MB`` (tests and crash torture: small
    segments are sealed, written back and dropped within a few steps)."""
    env = env_mib("DLRM_CXL_SEGMENT_MB")
    return 64 << 20 if env is None else max(4096, env)


def check_libpmem_request(tier: str, use_libpmem: bool | None) -> None:
    if use_libpmem is True and tier_of(tier).dax and libpmem() is None:
        raise libpmem_missing()


def make_pool_dir(path, *, tier: str, capacity_bytes: int | None, dram_cache_bytes: int | None,
                  use_libpmem: bool | None, meta: Mapping | None) -> tuple[Path, dict, int]:
    """Make a new, empty pool at directory ``path`` (``MemoryPool.create``): its directory, its
    table directory (the shm region for the shm tier) and its header, written last. Returns the
    path, the header and the writer lock's descriptor (held); on failure, nothing it made is
    left and the lock is released."""
    path = Path(path)
    tier = resolve_tier(tier)
    kind = tier_of(tier)
    for name, v in (("capacity_bytes", capacity_bytes), ("dram_cache_bytes", dram_cache_bytes)):
        if v is not None and (not is_int(v) or v < 0):
            raise InvalidConfigError(f"{name} must be None or an int >= 0, got {v!r}")
    check_libpmem_request(tier, use_libpmem)
    segment_bytes()  # a bad DLRM_CXL_SEGMENT_MB is refused before anything is made
    meta = json_copy(dict(meta or {}), "meta")
    if (path / HEADER).exists():
        raise PoolExistsError(f"{path} already holds a pool")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise PoolExistsError(f"{path} exists and is not an empty directory")
    made_dir = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    lock_fd = take_lock(path)
    pool_id = uuid.uuid4().hex
    storage = (shm_root() / f"{REGION_PREFIX}{pool_id}") if kind.files_in_shm else path
    try:
        if (path / HEADER).exists():  # a concurrent create won the race
            raise PoolExistsError(f"{path} already holds a pool")
        (storage / TABLES_DIR).mkdir(parents=True, exist_ok=True)
        if kind.files_in_shm:
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
            if kind.files_in_shm:
                shutil.rmtree(storage, ignore_errors=True)
            shutil.rmtree(path / TABLES_DIR, ignore_errors=True)
            for leftover in (path / f".{HEADER}.tmp", path / LOCK_FILE):
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
    return path, header, lock_fd


def open_pool_dir(path: Path, *, read_only: bool, consistent: bool, dram_cache_bytes: int | None,
                  use_libpmem: bool | None, rows: bool, replay: str) -> tuple[dict, int | None]:
    """The header of the pool at ``path`` and the lock ``MemoryPool.open`` holds (the writer lock,
    a reader's shared lock with ``consistent``, or None), once the arguments and the pool's tier
    allow it to be opened and the emulated power loss a crashed writer left is over."""
    if dram_cache_bytes is not None and (not is_int(dram_cache_bytes) or dram_cache_bytes < 0):
        raise InvalidConfigError(f"dram_cache_bytes must be None or an int >= 0, got {dram_cache_bytes!r}")
    header = read_header(path)
    check_libpmem_request(header["tier"], use_libpmem)
    kind = tier_of(header["tier"])
    if not kind.reopenable:
        raise PoolVolatileError(f"{path} is a dram pool: its rows lived in the process that created it")
    if kind.files_in_shm and not Path(header["storage_dir"]).is_dir():
        raise PoolVolatileError(
            f"{path}: shm region {header['storage_dir']} is gone (the machine was restarted?)",
            hint="shm pools survive a trainer crash, not a reboot; use --tier pmem for that")
    if not rows and not read_only:
        raise InvalidConfigError("rows=False opens a pool read-only: pass read_only=True")
    if replay not in REPLAY_MODES:
        raise InvalidConfigError(f"replay must be one of {REPLAY_MODES}, got {replay!r}")
    if read_only:
        lock_fd = take_lock(path, shared=True) if consistent else None
    else:
        lock_fd = take_lock(path)
    if kind.may_lose_power and fileio.pending(path):  # (one a crashed writer may have left)
        header = power_on(path, header, locked=lock_fd is not None and not read_only)
    return header, lock_fd


def power_on(path: Path, header: dict, *, locked: bool) -> dict:
    """The emulated power loss a crashed writer left (memory_pool/fileio.py): what it never
    synced is taken back, before anything of the pool is read. Needs the writer lock (a
    reader takes it for the moment; beside a live writer there was no power loss)."""
    probe = None
    if not locked:
        try:
            probe = take_lock(path)
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


def close_pool_dir(path: Path, storage_dir: Path, pool_id: str, *, watched: bool, lock_fd: int | None) -> None:
    """What ``MemoryPool.close`` does last, its files closed: a watched writer's emulated power
    loss, then the writer lock released."""
    if watched:
        # Closing is a moment the power may go: what this process never synced is taken back
        # now (fileio.power_on), so the files a closed pool leaves are exactly its durable
        # state. A process that dies instead leaves its undo log to the next open.
        fileio.unwatch(storage_dir)
        if lock_fd is not None:
            fileio.power_on(storage_dir)
            AppliedMark(pool_id, lambda: [], path).remove()
    if lock_fd is not None:
        os.close(lock_fd)  # releases the flock


def open_journal(storage_dir: Path, tier: Tier, *, read_only: bool) -> Journal:
    """The pool's journal, opened, with the unfinished tail of persisted rows dropped."""
    # The pool's journal: rows persisted on a journaled tier, and the checkpointer's
    # records on every tier. Synced except where a sync means nothing (shm is RAM and
    # survives only a trainer crash; a dram pool survives nothing); there, records are
    # copied into a mapping of the segment instead of written (see "Mapped segments").
    journal = Journal(storage_dir / JOURNAL_DIR, sync=tier.journal_synced, mapped=tier.journal_mapped,
                      direct=tier.journal_direct, read_only=read_only, segment_bytes=segment_bytes())
    try:
        if tier.journaled and not read_only and all(r.tag < 0 for r in journal.tail) and (
                journal.tail or journal.torn_bytes):
            # An unfinished transaction of persisted rows (or a torn record): never vouched
            # for, never replayed. Drop it so that the next transaction does not end up
            # sealing it. (Records of training steps are the checkpointer's: its recovery
            # reports and drops them.)
            journal.truncate_tail()
    except BaseException:
        journal.close()  # (as the pool's close would)
        raise
    return journal


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
        fd = take_lock(path)
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
