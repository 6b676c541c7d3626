"""The memory pool: a directory of embedding tables in one tier, with a checksummed header.

Layout of a pool directory::

    DIR/pool.json       header: magic, format version, pool id, tier, tables, meta, crc32
    DIR/LOCK            the writer lock (flock; released by the kernel when the writer dies)
    DIR/tables/*.bin    table rows, row-major (pmem, power-sim)
    /dev/shm/dlrm-cxl-<pool id>/tables/*.bin   table rows for the shm tier
    <storage_dir>/...   files of the checkpointer (undo log, dense snapshots, commit record);
                        ``storage_dir`` is in the same tier as the rows

Exactly one writer at a time holds ``LOCK``; read-only opens take no lock and map the files
privately, so they never change them.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import threading
import time
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F

from ._fs import atomic_write
from ._native import libpmem
from .cache import RowCache
from .errors import (
    InvalidConfigError,
    InvalidIdsError,
    InvalidValuesError,
    PoolCorruptError,
    PoolExistsError,
    PoolFormatError,
    PoolFullError,
    PoolLockedError,
    PoolReadOnlyError,
    PoolVersionError,
    PoolVolatileError,
    TableExistsError,
    TableNotFoundError,
)
from .lifecycle import record_owner
from .arena import Arena, page_round
from .journal import Journal, RecordType, decode_rows, encode_rows
from .tiers import (TIERS, Region, detect_dax, durability_of, is_journaled, libpmem_missing, open_region, shm_root,
                    torch_dtype)

__all__ = ["MemoryPool", "Table", "TableConfig", "PoolStats", "destroy_pool", "MAGIC", "FORMAT_VERSION"]

MAGIC = "dlrm-cxl-pool"
FORMAT_VERSION = 2   # 2: journal (byte-granular persistence), arena layout of the checkpointer
HEADER = "pool.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class TableConfig:
    """What a table is; the :class:`Table` object owns its memory."""

    name: str
    num_embeddings: int
    embedding_dim: int
    dtype: str = "float32"

    @property
    def row_bytes(self) -> int:
        return self.embedding_dim * torch_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.num_embeddings * self.row_bytes


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _validate_table_config(cfg: TableConfig) -> None:
    if not isinstance(cfg.name, str) or not _NAME_RE.match(cfg.name):
        raise InvalidConfigError(
            f"table name {cfg.name!r} must match {_NAME_RE.pattern}",
            hint="use letters, digits, '_', '.' and '-' (1-128 characters, not starting with '.' or '-')")
    if not _is_int(cfg.num_embeddings) or cfg.num_embeddings < 1:
        raise InvalidConfigError(f"num_embeddings must be a positive int, got {cfg.num_embeddings!r}")
    if not _is_int(cfg.embedding_dim) or cfg.embedding_dim < 1:
        raise InvalidConfigError(f"embedding_dim must be a positive int, got {cfg.embedding_dim!r}")
    try:
        torch_dtype(cfg.dtype)
    except (KeyError, TypeError):
        raise InvalidConfigError(f"dtype must be one of float32, float16, bfloat16; got {cfg.dtype!r}") from None


def _validate_ids(ids, cfg: TableConfig) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidIdsError(f"table {cfg.name!r}: ids are not a tensor: {exc}") from None
        if ids.numel() == 0:
            ids = ids.to(torch.int64)  # [] becomes a float tensor; an empty list is fine
    if ids.dtype not in (torch.int64, torch.int32):
        raise InvalidIdsError(f"table {cfg.name!r}: ids must be int64 or int32, got {ids.dtype}")
    if ids.dim() != 1:
        raise InvalidIdsError(f"table {cfg.name!r}: ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.numel():
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo < 0:
            raise InvalidIdsError(f"table {cfg.name!r}: negative id {lo}")
        if hi >= cfg.num_embeddings:
            raise InvalidIdsError(f"table {cfg.name!r}: id {hi} out of range [0, {cfg.num_embeddings})")
    return ids.to(torch.int64)


def _all_finite(values: torch.Tensor) -> bool:
    # One pass with no temporary (8x faster than isfinite().all()); aminmax propagates NaN.
    lo, hi = torch.aminmax(values)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def _validate_values(values, n: int, cfg: TableConfig) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        raise InvalidValuesError(f"table {cfg.name!r}: values must be a torch.Tensor, got {type(values).__name__}")
    want = torch_dtype(cfg.dtype)
    if values.dtype != want:
        raise InvalidValuesError(f"table {cfg.name!r}: values dtype {values.dtype}, table dtype {want}")
    if tuple(values.shape) != (n, cfg.embedding_dim):
        raise InvalidValuesError(
            f"table {cfg.name!r}: values shape {tuple(values.shape)}, expected ({n}, {cfg.embedding_dim})")
    if n and not _all_finite(values):
        raise InvalidValuesError(f"table {cfg.name!r}: values contain NaN or inf")
    return values


def _validate_offsets(offsets, n: int, cfg: TableConfig) -> torch.Tensor:
    """Bag starts for ``n`` ids: 1-D ints, first 0, non-decreasing, none past ``n``."""
    try:
        offsets = torch.as_tensor(offsets)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidIdsError(f"table {cfg.name!r}: offsets are not a tensor: {exc}") from None
    if offsets.dtype not in (torch.int64, torch.int32) or offsets.dim() != 1:
        raise InvalidIdsError(
            f"table {cfg.name!r}: offsets must be a 1-D int tensor, got {offsets.dtype} of shape {tuple(offsets.shape)}",
            hint="offsets[b] is the index in ids where bag b starts: 1-D, int64, starting at 0")
    if offsets.numel():
        o = offsets.to(torch.int64)
        if int(o[0]) != 0 or int(o[-1]) > n or bool((o[1:] < o[:-1]).any()):
            raise InvalidIdsError(
                f"table {cfg.name!r}: offsets must start at 0, never decrease and not exceed len(ids)={n}",
                hint="offsets[b] is the index in ids where bag b starts: 1-D, int64, starting at 0")
    return offsets.to(torch.int64)


# --------------------------------------------------------------------------- stats


@dataclass
class PoolStats:
    """Counters since the pool was opened. Bytes are payload bytes (rows), not pages."""

    cache_hits: int = 0
    cache_misses: int = 0
    bytes_read_dram: int = 0
    bytes_read_home: int = 0
    bytes_written: int = 0
    persist_calls: int = 0
    bytes_persisted: int = 0
    persist_seconds: float = 0.0
    bytes_written_back: int = 0     # rows written from the journal into the table images
    bytes_compacted: int = 0        # journal bytes dropped after write-back

    def as_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- table


class Table:
    """One embedding table of a pool. Get it with :meth:`MemoryPool.table`.

    ``read`` returns copies; ``write`` updates rows in place in the table's home tier.
    """

    def __init__(self, pool: "MemoryPool", cfg: TableConfig, region: Region, cache_rows: int):
        self.pool = pool
        self.config = cfg
        self._region = region
        self._cache = RowCache(region.tensor, cache_rows) if cache_rows else None

    # -- description
    name = property(lambda self: self.config.name)
    num_embeddings = property(lambda self: self.config.num_embeddings)
    embedding_dim = property(lambda self: self.config.embedding_dim)
    dtype = property(lambda self: torch_dtype(self.config.dtype))

    @property
    def cached(self) -> bool:
        """True when the table exceeds its DRAM budget and reads go through a row cache."""
        return self._cache is not None

    def __repr__(self) -> str:
        return (f"Table({self.name!r}, rows={self.num_embeddings}, dim={self.embedding_dim}, "
                f"dtype={self.config.dtype}, tier={self._region.tier}, cached={self.cached})")

    def view(self) -> torch.Tensor:
        """The live [rows, dim] tensor over the table's home memory (no copy).

        Writing through it bypasses the cache, dirty tracking and the undo log: use
        :meth:`write` unless you know why. Invalid after the pool is closed.
        """
        self.pool._check_open()
        return self._region.tensor

    # -- hot path (callers have validated)
    def _gather(self, ids: torch.Tensor) -> torch.Tensor:
        st = self.pool.stats
        if self._cache is None:
            out = self._region.tensor.index_select(0, ids)
            st.bytes_read_home += out.numel() * out.element_size()
            return out
        h0, m0 = self._cache.hits, self._cache.misses
        out, b_dram, b_home = self._cache.read(ids)
        st.cache_hits += self._cache.hits - h0
        st.cache_misses += self._cache.misses - m0
        st.bytes_read_dram += b_dram
        st.bytes_read_home += b_home
        return out

    def _scatter(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        self._region.tensor.index_copy_(0, ids, values)
        self._region.mark_dirty(ids)
        if self._cache is not None:
            self._cache.write_through(ids, values)
        self.pool.stats.bytes_written += values.numel() * values.element_size()

    # -- trusted fast path: for callers that validated ids against this table (the trainer,
    #    the checkpointer, recovery). No checks; documented so no one reaches for _private.
    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64, valid) as a new tensor, through the cache when there is one."""
        return self._gather(ids)

    def scatter_rows(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Set rows ``ids`` (int64, valid, distinct) to ``values`` in place (cache kept coherent)."""
        self._scatter(ids, values)

    def pooled_rows(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Sum-pooled bags of valid ``ids`` with bag starts ``offsets`` -> [B, dim]."""
        return self._pooled(ids, offsets)

    def restore_raw(self, ids: torch.Tensor, raw: torch.Tensor) -> None:
        """Set rows ``ids`` to raw bytes ``raw`` [n, row_bytes] (recovery's write path)."""
        self._region.restore_rows(ids, raw)
        if self._cache is not None:
            self._cache.write_through(ids, raw.view(self.dtype).view(ids.numel(), self.embedding_dim))

    def mark_dirty(self, ids: torch.Tensor) -> None:
        """Note rows changed in place by a trusted writer (e.g. a fused kernel): the next
        ``persist()`` covers them."""
        self._region.mark_dirty(ids)

    def take_dirty(self) -> torch.Tensor:
        """Rows written since the last persist (sorted), forgotten by the table."""
        return self._region.take_dirty()

    @property
    def arena_offset(self) -> int | None:
        """Byte offset of row 0 in the pool's arena (see :meth:`MemoryPool.arena_tensor`);
        None when the table is not in the arena."""
        return self._region.offset

    def _pooled(self, ids: torch.Tensor, offsets: torch.Tensor, per_sample_weights=None) -> torch.Tensor:
        if self._cache is None:
            self.pool.stats.bytes_read_home += ids.numel() * self.config.row_bytes
            return F.embedding_bag(ids, self._region.tensor, offsets, mode="sum",
                                   per_sample_weights=per_sample_weights)
        rows = self._gather(ids)
        return F.embedding_bag(torch.arange(ids.numel()), rows, offsets, mode="sum",
                               per_sample_weights=per_sample_weights)

    # -- public API
    def read(self, ids) -> torch.Tensor:
        """Rows ``ids`` as a new [len(ids), dim] tensor. Duplicates are allowed."""
        self.pool._check_open()
        return self._gather(_validate_ids(ids, self.config))

    def write(self, ids, values: torch.Tensor) -> None:
        """Set rows ``ids`` to ``values`` in place. Ids must be distinct; nothing changes on error."""
        self.pool._check_writable()
        ids = _validate_ids(ids, self.config)
        values = _validate_values(values, ids.numel(), self.config)
        if ids.numel() and torch.unique(ids).numel() != ids.numel():
            raise InvalidIdsError(f"table {self.name!r}: duplicate ids in write (which value wins would be arbitrary)",
                                  hint="deduplicate ids (torch.unique) and combine their values first")
        self._scatter(ids, values)

    def lookup(self, ids, offsets) -> torch.Tensor:
        """Sum-pooled bags: ``offsets`` [B] (start of each bag in ``ids``) -> [B, dim]."""
        self.pool._check_open()
        ids = _validate_ids(ids, self.config)
        offsets = _validate_offsets(offsets, ids.numel(), self.config)
        return self._pooled(ids, offsets)

    def persist(self, ids=None) -> int:
        """Make rows ``ids`` (default: every row written since the last persist) durable."""
        self.pool._check_writable()
        t0 = time.perf_counter()
        ids = self._region.take_dirty() if ids is None else torch.unique(_validate_ids(ids, self.config))
        n = self.pool._persist_rows([(self, ids)])
        st = self.pool.stats
        st.persist_calls += 1
        st.bytes_persisted += n
        st.persist_seconds += time.perf_counter() - t0
        return n

    def fill_(self, init: str = "uniform", *, scale: float | None = None, seed: int = 0,
              chunk_rows: int = 1 << 18) -> None:
        """Initialise every row: ``zeros``, or ``uniform`` in [-scale, scale] (TorchRec's
        default scale is sqrt(1/num_embeddings)), chunk by chunk so huge tables need no
        table-sized temporary. Deterministic in ``seed``."""
        self.pool._check_writable()
        _validate_init(init)
        if init == "zeros":
            chunks = ((a, None) for a in range(0, self.num_embeddings, chunk_rows))
        else:
            s = (1.0 / self.num_embeddings) ** 0.5 if scale is None else scale
            g = torch.Generator().manual_seed(seed)
            chunks = ((a, torch.rand(min(chunk_rows, self.num_embeddings - a), self.embedding_dim, generator=g)
                       * (2 * s) - s) for a in range(0, self.num_embeddings, chunk_rows))
        self._load_chunks(chunks, chunk_rows)

    def load_(self, values: torch.Tensor) -> None:
        """Replace every row with ``values`` [rows, dim], durably (a bulk write: on a journaled
        tier it goes straight to the table image, not through the journal)."""
        self.pool._check_writable()
        values = _validate_values(values, self.num_embeddings, self.config)
        step = 1 << 18
        self._load_chunks(((a, values[a:a + step]) for a in range(0, self.num_embeddings, step)), step)

    def _load_chunks(self, chunks, chunk_rows: int) -> None:
        region = self._region
        t = region.tensor
        for a, vals in chunks:
            b = min(a + chunk_rows, self.num_embeddings)
            if vals is None:
                vals = torch.zeros(b - a, self.embedding_dim)
            vals = vals.to(t.dtype).contiguous()
            if region.journaled:
                region.write_back(torch.arange(a, b), vals.view(torch.uint8).view(b - a, -1))
            else:
                t[a:b] = vals
        if region.journaled:
            # The image holds the new rows durably; map it afresh so this process sees them
            # (and drops any copy-on-write pages of the old ones).
            region.sync()
            self.pool._remap(self)
            region.take_dirty()
        elif self.pool.tier == "pmem":
            region.flush_rows(torch.arange(self.num_embeddings))
        if self._cache is not None:
            self._cache = RowCache(region.tensor, self._cache.capacity)


def _validate_init(init) -> None:
    if init not in ("zeros", "uniform"):
        raise InvalidConfigError(f"init must be 'zeros' or 'uniform', got {init!r}")


# --------------------------------------------------------------------------- header


def _header_bytes(doc: dict) -> bytes:
    body = {k: v for k, v in doc.items() if k != "crc32"}
    crc = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return (json.dumps({**body, "crc32": crc}, indent=1, sort_keys=True) + "\n").encode()


def read_header(path: Path) -> dict:
    """Parse and verify ``DIR/pool.json``; typed errors for every way it can be wrong."""
    hp = Path(path) / HEADER
    if not Path(path).is_dir():
        raise PoolFormatError(f"{path} is not a pool: no such directory")
    try:
        raw = hp.read_bytes()
    except FileNotFoundError:
        raise PoolFormatError(f"{path} is not a pool: {HEADER} is missing") from None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise PoolCorruptError(f"{hp}: header is not valid JSON ({exc}): truncated or damaged") from None
    if doc.get("magic") != MAGIC:
        raise PoolFormatError(f"{hp}: wrong magic {doc.get('magic')!r}, expected {MAGIC!r}: not a dlrm-cxl pool")
    body = {k: v for k, v in doc.items() if k != "crc32"}
    crc = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    if doc.get("crc32") != crc:
        raise PoolCorruptError(f"{hp}: header checksum mismatch (stored {doc.get('crc32')}, computed {crc})")
    if doc.get("format_version") != FORMAT_VERSION:
        raise PoolVersionError(
            f"{hp}: pool format version {doc.get('format_version')}, this dlrm-cxl reads version {FORMAT_VERSION}")
    return doc


# --------------------------------------------------------------------------- pool


def _resolve_tier(tier: str, path: Path) -> str:
    if tier == "auto":
        # Durable beats fast: a fault-tolerant trainer wants rows that survive power loss.
        # pmem is real when the directory is on a DAX mount, emulated (msync) otherwise.
        return "pmem"
    if tier not in TIERS:
        raise InvalidConfigError(f"tier must be one of {TIERS + ('auto',)}, got {tier!r}")
    return tier


def _json_copy(obj, what: str):
    try:
        return json.loads(json.dumps(obj, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidConfigError(f"{what}: not JSON-serialisable ({exc})",
                                 hint="meta values must be str, int, finite float, bool, None, lists or dicts") from None


def _check_libpmem_request(tier: str, use_libpmem: bool | None) -> None:
    if use_libpmem is True and tier == "pmem" and libpmem() is None:
        raise libpmem_missing()


class MemoryPool:
    """A pool of embedding tables. Create with :meth:`create`, reopen with :meth:`open`.

    Use as a context manager; ``close`` releases the mappings and the writer lock. A pool
    opened ``read_only`` takes no lock and can sit beside a writer.
    """

    def __init__(self, path: Path, header: dict, *, read_only: bool, lock_fd: int | None,
                 dram_cache_bytes: int | None, use_libpmem: bool | None):
        self.path = Path(path)
        self._header = header
        self.read_only = read_only
        self._lock_fd = lock_fd
        self._closed = False
        self._use_libpmem = use_libpmem
        self.dram_cache_bytes = dram_cache_bytes
        self._dram_left = dram_cache_bytes
        self.stats = PoolStats()
        self._tables: dict[str, Table] = {}
        self._meta_lock = threading.Lock()
        self._compactor: ThreadPoolExecutor | None = None
        self._compaction: Future | None = None
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
            # The pool's journal: rows persisted on a journaled tier, and the checkpointer's
            # records on every tier. Synced except where a sync means nothing (shm is RAM and
            # survives only a trainer crash; a dram pool survives nothing).
            self.journal = Journal(self.storage_dir / "journal", sync=self.tier not in ("shm", "dram"),
                                   read_only=read_only)
            if self.journaled and not read_only and all(r.tag < 0 for r in self.journal.tail) and (
                    self.journal.tail or self.journal.torn_bytes):
                # An unfinished transaction of persisted rows (or a torn record): never vouched
                # for, never replayed. Drop it so that the next transaction does not end up
                # sealing it. (Records of training steps are the checkpointer's: its recovery
                # reports and drops them.)
                self.journal.truncate_tail()
            replay = self._replay_plan() if self.journaled else {}
            # When the tables of an existing pool do not all fit the DRAM budget, it is split in
            # proportion to their sizes, so every table gets a cache of the same fraction of its
            # rows (the budget covers each cache's map and metadata too).
            split = dram_cache_bytes is not None and total > dram_cache_bytes
            for cfg in cfgs:
                share = dram_cache_bytes * cfg.nbytes // total if split else None
                self._tables[cfg.name] = self._attach(cfg, create=False, share=share,
                                                      replay=replay.get(cfg.name))
            if split:
                self._dram_left = 0
        except BaseException:
            self.close()
            raise

    # -- the journal: replay at open, persist, compaction
    def _replay_plan(self) -> dict[str, list]:
        """ROWS records of every complete transaction, per table, in journal order."""
        plan: dict[str, list] = {}
        for txn in self.journal.txns:
            for ref in txn.records:
                if ref.type == RecordType.ROWS:
                    name, ids, raw = decode_rows(self.journal.read(ref))
                    plan.setdefault(name, []).append((ids, raw))
        unknown = set(plan) - {t["name"] for t in self._header["tables"]}
        if unknown:
            raise PoolCorruptError(f"{self.path}: the journal holds rows of unknown tables {sorted(unknown)}")
        return plan

    @staticmethod
    def _latest(parts: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenate (ids, raw) parts in order; keep the last value of every row; sort by row."""
        ids = torch.cat([p[0] for p in parts])
        raw = torch.cat([p[1] for p in parts])
        # The last occurrence of each id wins: stable sort, then the last of each equal run.
        order = torch.sort(ids, stable=True).indices
        sid = ids[order]
        last = torch.ones(sid.numel(), dtype=torch.bool)
        if sid.numel() > 1:
            last[:-1] = sid[1:] != sid[:-1]
        keep = order[last]
        return ids[keep], raw[keep]

    def persist_rows(self, pairs) -> int:
        """Make ``[(table, ids)]`` durable now (trusted ids), in one group commit on a
        journaled tier. Returns the row bytes persisted."""
        self._check_writable()
        return self._persist_rows(pairs)

    def _persist_rows(self, pairs) -> int:
        """Make rows durable per the tier: journal (ROWS + one group commit), cache-line flush
        (real pmem), or nothing (dram, shm: stores are already where they survive)."""
        pairs = [(t, ids) for t, ids in pairs if ids.numel()]
        if self.journaled:
            if not pairs:
                return 0
            n = 0
            for t, ids in pairs:
                rows = t._region.tensor.index_select(0, ids)
                self.journal.append(RecordType.ROWS, -1, encode_rows(t.name, ids, rows))
                t._region.clear_dirty(ids)
                n += ids.numel() * t.config.row_bytes
            self.journal.end(-1, {"kind": "persist"})
            return n
        return sum(t._region.flush_rows(ids) for t, ids in pairs)

    def _absorb(self, refs) -> None:
        """Compaction: write the ROWS of journal records back into the table images, newest
        value per row, sorted and coalesced; durable (fdatasync) before the records are dropped."""
        parts: dict[str, list] = {}
        for ref in refs:
            if ref.type == RecordType.ROWS:
                name, ids, raw = decode_rows(self.journal.read(ref))
                parts.setdefault(name, []).append((ids, raw))
        for name, p in parts.items():
            region = self._tables[name]._region
            ids, raw = self._latest(p)
            self.stats.bytes_written_back += region.write_back(ids, raw)
        for name in parts:
            self._tables[name]._region.sync()

    def compact(self, before_seq: int | None = None, *, wait: bool = True) -> Future | None:
        """Write journal segments back into the table images and drop them: every segment
        whose records all precede ``before_seq`` (default: every complete segment). With
        ``wait=False`` it runs on a background thread (one at a time; None if one is running)."""
        self._check_writable()
        if self.journal is None:
            return None
        if before_seq is None:
            self.journal.rotate()
        seq = self.journal.next_seq if before_seq is None else before_seq

        def run():
            self.stats.bytes_compacted += self.journal.reclaim(seq, self._absorb if self.journaled else None)

        if wait:
            run()
            return None
        if self._compaction is not None and not self._compaction.done():
            return None
        if self._compactor is None:
            self._compactor = ThreadPoolExecutor(1, thread_name_prefix="journal-compactor")
        self._compaction = self._compactor.submit(run)
        return self._compaction

    def wait_compaction(self) -> None:
        """Wait for a background compaction, if one is running (and raise its error)."""
        if self._compaction is not None:
            self._compaction.result()

    def arena_tensor(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Every table of the pool as one flat tensor (no copy): table ``t`` starts at element
        ``t.arena_offset // dtype.itemsize``. What fbgemm's table-batched kernels take."""
        self._check_open()
        return self._arena.flat(dtype)

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
            if v is not None and (not _is_int(v) or v < 0):
                raise InvalidConfigError(f"{name} must be None or an int >= 0, got {v!r}")
        _check_libpmem_request(tier, use_libpmem)
        meta = _json_copy(dict(meta or {}), "meta")
        if (path / HEADER).exists():
            raise PoolExistsError(f"{path} already holds a pool")
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise PoolExistsError(f"{path} exists and is not an empty directory")
        made_dir = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        lock_fd = cls._lock(path)
        pool_id = uuid.uuid4().hex
        storage = (shm_root() / f"dlrm-cxl-{pool_id}") if tier == "shm" else path
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
            atomic_write(path / HEADER, _header_bytes(header))
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
             use_libpmem: bool | None = None) -> "MemoryPool":
        """Open an existing pool. A writer takes the lock; ``read_only`` takes none."""
        path = Path(path)
        if dram_cache_bytes is not None and (not _is_int(dram_cache_bytes) or dram_cache_bytes < 0):
            raise InvalidConfigError(f"dram_cache_bytes must be None or an int >= 0, got {dram_cache_bytes!r}")
        header = read_header(path)
        _check_libpmem_request(header["tier"], use_libpmem)
        if header["tier"] == "dram":
            raise PoolVolatileError(f"{path} is a dram pool: its rows lived in the process that created it")
        if header["tier"] == "shm" and not Path(header["storage_dir"]).is_dir():
            raise PoolVolatileError(
                f"{path}: shm region {header['storage_dir']} is gone (the machine was restarted?)",
                hint="shm pools survive a trainer crash, not a reboot; use --tier pmem for that")
        lock_fd = None if read_only else cls._lock(path)
        return cls(path, header, read_only=read_only, lock_fd=lock_fd,
                   dram_cache_bytes=dram_cache_bytes, use_libpmem=use_libpmem)

    @staticmethod
    def _lock(path: Path) -> int:
        fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # flock belongs to the open file description: the kernel drops it when the holder
            # dies, even by SIGKILL, so a crashed writer never leaves a stale lock behind.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                holder = (path / "LOCK").read_text().strip()
            except OSError:
                holder = "?"
            raise PoolLockedError(f"{path} is locked by another writer (pid {holder or '?'})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _attach(self, cfg: TableConfig, *, create: bool, share: int | None = None, replay=None) -> Table:
        tier = self.tier
        file = None if tier == "dram" else self.storage_dir / "tables" / f"{cfg.name}.bin"
        if not create and file is not None and not file.exists():
            raise PoolCorruptError(f"{self.path}: table file {file} is missing")
        before_map = None
        if replay and not self.read_only:
            # A writer brings the image up to date with the journal before mapping it (pwrite:
            # no page faults; idempotent, the journal keeps the records until compaction).
            before_map = lambda region: region.write_back(*self._latest(replay))  # noqa: E731
        region = open_region(self._arena, tier, file, cfg.num_embeddings, cfg.embedding_dim, cfg.dtype,
                             create=create, read_only=self.read_only, real_pmem=self._real_pmem,
                             before_map=before_map)
        if replay and self.read_only:
            region.restore_rows(*self._latest(replay))  # into this process's private mapping
            region.take_dirty()
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
            "format_version": FORMAT_VERSION,
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
        }

    # -- changes
    def create_table(self, name: str, num_embeddings: int, embedding_dim: int, *, dtype: str = "float32",
                     init: str = "zeros", scale: float | None = None, seed: int = 0) -> Table:
        """Add a table. Its file is fully allocated now, so a full disk fails here (pool unchanged)."""
        self._check_writable()
        cfg = TableConfig(name, num_embeddings, embedding_dim, dtype)
        _validate_table_config(cfg)
        _validate_init(init)
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
            self._tables[name] = table
            self._write_header()
        except BaseException:
            self._dram_left = dram_left
            self._tables.pop(name, None)
            table._region.close()
            if table._region.tier != "dram":
                try:
                    os.unlink(table._region.path)
                except OSError:
                    pass
            raise
        return table

    def set_meta(self, **items) -> None:
        """Merge ``items`` (JSON-serialisable) into the header's meta, durably."""
        self._check_writable()
        with self._meta_lock:
            meta = dict(self._header["meta"])
            meta.update(_json_copy(items, "set_meta"))
            self._write_header(meta=meta)

    def _write_header(self, **changes) -> None:
        """Write the header for the current tables (plus ``changes``); the in-memory header is
        replaced only once the new one is durable, so a failed write changes nothing."""
        header = {**self._header, **changes, "tables": [asdict(t.config) for t in self._tables.values()]}
        atomic_write(self.path / HEADER, _header_bytes(header))
        self._header = header

    def lookup(self, kjt, tables: Mapping[str, str] | None = None):
        """Sum-pooled lookup of a TorchRec ``KeyedJaggedTensor``.

        Each key is looked up in the table of the same name, or ``tables[key]``. Returns a
        TorchRec ``KeyedTensor`` (like ``EmbeddingBagCollection``), one [B, dim] block per key.
        """
        from torchrec.sparse.jagged_tensor import KeyedTensor

        self._check_open()
        keys = list(kjt.keys())
        tabs = [self.table(tables.get(k, k) if tables else k) for k in keys]
        values, lengths = kjt.values(), kjt.lengths()
        B, K = kjt.stride(), len(keys)
        if lengths.numel() != B * K:
            raise InvalidIdsError(f"lookup: KeyedJaggedTensor has {lengths.numel()} lengths, expected "
                                  f"{K} keys x batch {B}", hint="variable batch size per key is not supported")
        # Offsets of every bag of every key in one pass: cum[j] = start of bag j in values.
        cum = torch.zeros(B * K + 1, dtype=torch.int64)
        torch.cumsum(lengths.to(torch.int64), 0, out=cum[1:])
        key_start = cum[::B] if B else torch.zeros(K + 1, dtype=torch.int64)
        bounds = key_start.tolist()  # K + 1 entries
        if bounds[-1] != values.numel():
            raise InvalidIdsError(f"lookup: lengths sum to {bounds[-1]} but there are {values.numel()} values")
        bag_starts = (cum[:-1].view(K, B) - key_start[:-1, None]) if B else torch.zeros(K, 0, dtype=torch.int64)
        # Validate every id at once against its table's size; on failure, the per-key check
        # names the key and the id.
        if values.dtype not in (torch.int64, torch.int32) or values.dim() != 1:
            raise InvalidIdsError(f"lookup: ids must be 1-D int64 or int32, got {values.dtype} {tuple(values.shape)}")
        values = values.to(torch.int64)
        if values.numel():
            sizes = [t.num_embeddings for t in tabs]
            lo, hi = torch.aminmax(values)
            ok = int(lo) >= 0 and int(hi) < min(sizes)
            if not ok and int(lo) >= 0 and min(sizes) != max(sizes):
                limit = torch.repeat_interleave(torch.tensor(sizes), torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1]))
                ok = not bool((values >= limit).any())
            if not ok:
                for i, t in enumerate(tabs):
                    _validate_ids(values[bounds[i]:bounds[i + 1]], t.config)
        outs = [t._pooled(values[bounds[i]:bounds[i + 1]], bag_starts[i]) for i, t in enumerate(tabs)]
        dims = [t.embedding_dim for t in tabs]
        return KeyedTensor(keys=keys, length_per_key=dims, values=torch.cat(outs, dim=1))

    def persist(self) -> int:
        """Make every row written since the last persist durable (per the tier's durability):
        on a journaled tier, one group commit for all tables."""
        self._check_writable()
        t0 = time.perf_counter()
        n = self._persist_rows([(t, t._region.take_dirty()) for t in self._tables.values()])
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
        if self._compactor is not None:
            self._compactor.shutdown(wait=True)
        if self.journal is not None:
            self.journal.close()
        for t in self._tables.values():
            t._region.close()
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
            if header.get("tier") == "shm" and storage.name == f"dlrm-cxl-{header.get('pool_id')}":
                shutil.rmtree(storage, ignore_errors=True)
        finally:
            os.close(fd)
    shutil.rmtree(path, ignore_errors=True)
