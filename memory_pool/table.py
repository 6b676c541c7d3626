"""A table of the pool: :class:`TableConfig` (what it is) and :class:`Table` (the object that owns
its rows' memory, through a region of the pool's tier), plus the pool's :class:`PoolStats`.

``Table`` has two surfaces. The public API validates everything (``read``, ``write``,
``lookup``, ``persist``, ``fill_``, ``load_``). The trusted fast path is for callers that have
validated ids against the table already -- the trainer, the checkpointer, recovery:
``gather_rows``, ``scatter_rows``, ``pooled_rows``, ``restore_raw``, ``mark_dirty``,
``take_dirty``, ``arena_offset``. The pool's own modules (persist, replay, compaction, the
overlay) reach the rows' memory and files through :attr:`Table.region`.

**Table and pool.** A table never sees the pool object, nor imports its module: the pool hands
each table a :class:`TableHost` at construction, the few things a table asks of it -- its
counters, "is it open (writable)?", "apply the rows an on-demand replay has not applied yet",
"persist these rows", and the two ends of a bulk load. The pool reaches a table only through its
public members (``region``, ``cache_rows``, ``close``, the fast path). The call orders:

* every row path: ``host.ready_rows(name, ids)``, then the rows are read or written in place;
* ``persist``: the rows written since the last persist (``region.dirty_rows()``) go to
  ``host.persist_rows``, which clears them once their transaction is durable;
* a bulk load (``fill_``, ``load_``): ``with host.bulk_load(name):`` (no compaction or write-back
  pass meanwhile; the table's pending rows forgotten) the rows go into the image; on a journaled
  tier then ``region.sync(drop_cache=True)``, ``region.remap()``, ``region.take_dirty()`` and
  ``host.note_reset(name)`` (the reset marker: the table's older journal rows stop counting).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .cache import RowCache
from .errors import InvalidIdsError
from .initializers import INIT_BLOCK_ROWS, uniform_chunks
from .tiers import Region, torch_dtype
from .validation import validate_ids, validate_init, validate_offsets, validate_values

__all__ = ["TableConfig", "Table", "TableHost", "PoolStats"]


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
    compactions: int = 0
    applies: int = 0                # write-back passes of sealed journal segments between compactions (unsynced)
    trims: int = 0                  # working copies given back (MemoryPool.trim_working_copy)
    refreshes: int = 0              # their clean pages given back alone (MemoryPool.trim_working_copy(names, written))
    rows_replayed: int = 0          # journal rows written into the working copy (at the open, or on demand)
    open_seconds: float = 0.0       # the open itself: header, journal scan, replay (eager) or its index (on demand)
    rows_deferred: int = 0          # rows an on-demand replay left to apply when first needed (journal and runs)
    journal_rows_at_open: int = 0   # journal rows the open replayed or deferred (a DRAM cache's first trim: lookahead)
    run_rows_deferred: int = 0      # of rows_deferred, rows of the row overlay's runs (memory_pool/overlay.py)
    run_rows_replayed: int = 0      # rows of the row overlay's runs written into the working copy (by reads, an eager open, a compaction)
    rows_handed_over: int = 0       # an open's journal rows no step needed, left unapplied: pending from where a trim put them
    bytes_to_runs: int = 0          # bytes of run files the row overlay wrote (memory_pool/overlay.py)
    pages_prefetched: int = 0       # image pages asked for before a replay or a write-back into them (0: cached)
    compact_seconds: float = 0.0    # wall time of the compactions and applies (on their background thread)
    compact_cpu_seconds: float = 0.0  # CPU of the compactor's thread (not torch's worker threads)
    bytes_preread: int = 0          # journal bytes background compactions read in first (JournalReader.preread)
    preread_seconds: float = 0.0    # their wall time (the steps kept every intra-op thread: dlrm_cxl/cores.py)

    def as_dict(self) -> dict:
        return asdict(self)

    def counted_persist(self, persist: Callable[[], int]) -> int:
        """``persist()`` (a persist of the pool or of one table: it returns the row bytes
        persisted), counted here (``persist_calls``, ``bytes_persisted``, ``persist_seconds``)."""
        t0 = time.perf_counter()
        n = persist()
        self.persist_calls += 1
        self.bytes_persisted += n
        self.persist_seconds += time.perf_counter() - t0
        return n


@dataclass(frozen=True)
class TableHost:
    """What a :class:`Table` may ask of the pool it belongs to (see the module): the pool builds
    one (``MemoryPool.__init__``) and passes it to each of its tables at construction.

    ``stats``: the pool's counters. ``check_open()`` / ``check_writable()``: raise unless the
    pool is open (and writable). ``ready_rows(name, ids=None)``: apply the rows among ``ids`` of
    table ``name`` (None: all of them) that an on-demand replay has not applied yet -- before any
    read or write of them. ``persist_rows([(table, ids)])``: make rows durable now (trusted ids;
    returns the row bytes; ``MemoryPool.persist_rows``). ``bulk_load(name)``: a context manager
    around a bulk load of table ``name`` into its image, from before its pending rows are
    forgotten until its reset is committed: no compaction or write-back pass runs meanwhile.
    ``note_reset(name)``: the table was loaded whole into its image, durably (a journaled tier
    commits a reset marker). ``real_pmem``: rows persist by cache-line flushes (real pmem).
    ``written(name, ids=None)``: rows ``ids`` (None: any) are about to change; ``exposed(name)``:
    the table's memory is handed out writable (both: ``FreshRows``, memory_pool/fresh.py).
    ``peek_rows(name, ids)``: the rows among ``ids`` not applied yet, and their values, read
    but not applied (``Replayer.peek``). ``initial_rows(name, lo, hi)``: which of rows
    ``lo..hi-1`` still hold their initial value, and its spec (``FreshRows.initial``)."""

    stats: PoolStats
    check_open: Callable[[], None]
    check_writable: Callable[[], None]
    ready_rows: Callable[..., None]
    persist_rows: Callable[[list], int]
    bulk_load: Callable[[str], AbstractContextManager]
    note_reset: Callable[[str], None]
    real_pmem: bool = False
    written: Callable[..., None] = lambda name, ids=None: None   # rows about to change (memory_pool/fresh.py)
    exposed: Callable[[str], None] = lambda name: None          # memory handed out writable (Table.view)
    peek_rows: Callable[..., tuple | None] = lambda name, ids: None  # pending rows' values (Replayer.peek)
    initial_rows: Callable[..., tuple | None] = lambda name, lo, hi: None  # rows still initial (FreshRows)


class Table:
    """One embedding table of a pool. Get it with :meth:`MemoryPool.table`.

    ``read`` returns copies; ``write`` updates rows in place in the table's home tier.
    """

    def __init__(self, host: TableHost, cfg: TableConfig, region: Region, cache_rows: int):
        self._host = host   # the pool's side (see TableHost): the table sees nothing else of it
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

    @property
    def cache_rows(self) -> int:
        """Rows the table's DRAM row cache holds (0: no cache)."""
        return self._cache.capacity if self._cache is not None else 0

    @property
    def region(self) -> Region:
        """The :class:`~memory_pool.tiers.Region` holding the rows (their memory, their file):
        for the pool's own modules (persist, replay, compaction, the overlay). Not a user API:
        what goes through it bypasses validation, the row cache, dirty tracking and the
        on-demand replay."""
        return self._region

    def close(self) -> None:
        """Release the rows' region and the row cache (the pool's ``close``)."""
        self._region.close()
        self._region.arena = None
        self._cache = None

    def __repr__(self) -> str:
        return (f"Table({self.name!r}, rows={self.num_embeddings}, dim={self.embedding_dim}, "
                f"dtype={self.config.dtype}, tier={self._region.tier}, cached={self.cached})")

    def view(self) -> torch.Tensor:
        """The live [rows, dim] tensor over the table's home memory (no copy).

        Writing through it bypasses the cache, dirty tracking and the undo log: use
        :meth:`write` unless you know why. Invalid after the pool is closed. After an on-demand
        open, the journal's rows of the whole table are applied first; behind a write-back DRAM
        cache (journaled tiers), its rows newer than the home are written home first.
        """
        self._host.check_open()
        self._host.ready_rows(self.name)
        self._host.exposed(self.name)  # (what is written through it is not seen: no row is "fresh")
        if self._cache is not None:
            self._cache.flush()  # (a write-back cache's newer rows first: the view is the table)
        return self._region.tensor

    def snapshot(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo..hi-1``'s values, a copy, read without changing the pool: a write-back DRAM
        cache's rows from their slots (each its row's newest value); of the others, those still
        at their initial value made from the initializer (``FreshRows.initial``), the rest read
        from the home and then a pending replay's or the row overlay's newer value taken
        (:meth:`pending_values`). What :meth:`view` shows, without what it does first
        -- every pending row applied into the working copy, the cache flushed, the table's
        fresh rows forgotten -- so a digest of a table beyond DRAM reads each row once and
        writes none (`kaggle` behind a 2.2 GB cache: the view took the runs' rows into the
        working copy, 36 s and GBs of copy-on-write pages, before 88 s of hashing)."""
        self._host.check_open()
        ids = torch.arange(lo, hi, dtype=torch.int64)
        init = self._host.initial_rows(self.name, lo, hi)
        out = torch.empty(hi - lo, self.embedding_dim, dtype=self.dtype)
        # The cache's rows first: a slot holds its row's newest value, so neither the home nor
        # a pending value is read for it (on `kaggle` behind the cache every trained row was
        # cached after 600 steps, and reading their home pages took 32 s of the closing digest's
        # 55, all of it overwritten).
        held = self._cache.newer_into(ids, out) if self.cache_holds_newer else None
        need = ~held if held is not None else None
        if init is not None:
            # Rows still at their initial value are made, not read: on `kaggle` behind the cache
            # most rows were never trained, and reading them faulted in the whole image.
            fresh = torch.from_numpy(init[0])
            make = fresh if need is None else fresh & need
            need = ~fresh if need is None else need & ~fresh
            at = make.nonzero().squeeze(1)
            if at.numel():
                out.index_copy_(0, at, init[1].values(ids.index_select(0, at), self.embedding_dim))
        # (their pages asked for at once first: a home behind a DRAM cache is mapped MADV_RANDOM,
        # and a fault there reads its own page, one after the other -- `train`'s closing digest
        # of `kaggle` after 2,700 steps behind the cache read its home that way for minutes)
        if need is None:
            self._region.will_need(ids)
            out.copy_(self._region.tensor[lo:hi])
        else:
            at = need.nonzero().squeeze(1)
            if at.numel():
                rows = ids.index_select(0, at)
                self._region.will_need(rows)
                out.index_copy_(0, at, self._region.tensor.index_select(0, rows))
        got = self.pending_values(ids) if ids.numel() else None
        if got is not None:
            # (a row both pending and cached: the slot's is the newer, taken at its admission)
            take = got[0] if held is None else got[0] & ~held
            vals = got[1].view(out.dtype).view(-1, out.shape[1])
            at = take.nonzero().squeeze(1)
            if at.numel():
                out.index_copy_(0, at, vals[take[got[0]]])
        return out

    # -- hot path (callers have validated)
    # (every row path first applies the rows of ids an on-demand replay has not applied yet)
    def _gather(self, ids: torch.Tensor) -> torch.Tensor:
        st = self._host.stats
        if self._cache is None:
            self._host.ready_rows(self.name, ids)
            out = self._region.tensor.index_select(0, ids)
            st.bytes_read_home += out.numel() * out.element_size()
            return out
        h0, m0 = self._cache.hits, self._cache.misses
        out, b_dram, b_home = self._cache.read(ids, self._ready)  # (it readies the rows it reads from home)
        st.cache_hits += self._cache.hits - h0
        st.cache_misses += self._cache.misses - m0
        st.bytes_read_dram += b_dram
        st.bytes_read_home += b_home
        return out

    def _scatter(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        self._host.ready_rows(self.name, ids)  # (or a pending journal value would overwrite these later)
        self._host.written(self.name, ids)
        self._region.tensor.index_copy_(0, ids, values)
        self._region.mark_dirty(ids)
        if self._cache is not None:
            self._cache.write_through(ids, values)
        self._host.stats.bytes_written += values.numel() * values.element_size()

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
        self._host.ready_rows(self.name, ids)
        self._host.written(self.name, ids)
        self._region.restore_rows(ids, raw)
        if self._cache is not None:
            self._cache.write_through(ids, raw.view(self.dtype).view(ids.numel(), self.embedding_dim))

    def current_rows(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (int64, valid) as they are now, where a write-back DRAM cache holds rows
        newer than the home (the checkpointer's gathers, ``persist``); not counted as reads.
        ``out``: where to write them (``[ids, dim]``, contiguous; returned)."""
        if self._cache is not None and self._cache.holds_newer:
            return self._cache.current(ids, self._ready, out)  # (it readies the rows it reads from home)
        self._host.ready_rows(self.name, ids)
        if out is not None:
            return torch.index_select(self._region.tensor, 0, ids, out=out)
        return self._region.tensor.index_select(0, ids)

    def _ready(self, ids: torch.Tensor) -> None:
        self._host.ready_rows(self.name, ids)

    def pending_values(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows among ``ids`` (valid, sorted, distinct) whose newest value an on-demand
        replay or the row overlay has not applied to the home yet: ``(mask over ids, values
        [hits, row_bytes] uint8)``, read and left pending; None when none is. For a DRAM cache's
        misses (``CacheArena``'s ``peek``): every later read or write of the home readies them."""
        return self._host.peek_rows(self.name, ids)

    @property
    def cache_holds_newer(self) -> bool:
        """Whether the table's cache may hold rows newer than its home (a write-back arena on a
        journaled tier): its home is then read through :meth:`current_rows`."""
        return self._cache is not None and self._cache.holds_newer

    @property
    def home_holds_untouched_rows(self) -> bool:
        """Whether the home holds the current value of every row the current recovery window
        has not touched yet (the rows whose before-images the undo log gathers): no cache, a
        write-through one, or a write-back one flushed at every recovery point (a direct home:
        ``memory_pool/cache_writeback.py``)."""
        return self._cache is None or not self._cache.holds_newer or self._cache.flushed_at_recovery_points

    @property
    def recovery_point_cache(self):
        """The cache arena to flush at each recovery point (``MemoryPool.flush_caches``), or None."""
        return self._cache.arena if self._cache is not None and self._cache.flushed_at_recovery_points else None

    def use_cache(self, cache) -> None:
        """Serve the rows through ``cache`` from now on (a ``memory_pool.cache_arena.CacheMember``:
        the DRAM cache arena fbgemm's fused kernels run on), instead of the table's own row cache."""
        self._cache = cache

    def mark_dirty(self, ids: torch.Tensor) -> None:
        """Note rows changed in place by a trusted writer (e.g. a fused kernel): the next
        ``persist()`` covers them."""
        self._host.written(self.name, ids)
        self._region.mark_dirty(ids)

    def take_dirty(self) -> torch.Tensor:
        """Rows written since the last persist (sorted), forgotten by the table: the caller now
        owns making them durable, and must :meth:`mark_dirty` them again if that fails."""
        return self._region.take_dirty()

    @property
    def arena_offset(self) -> int | None:
        """Byte offset of row 0 in the pool's arena (see :meth:`MemoryPool.arena_tensor`);
        None when the table is not in the arena."""
        return self._region.offset

    def _pooled(self, ids: torch.Tensor, offsets: torch.Tensor, per_sample_weights=None) -> torch.Tensor:
        if self._cache is None:
            self._host.ready_rows(self.name, ids)
            self._host.stats.bytes_read_home += ids.numel() * self.config.row_bytes
            return F.embedding_bag(ids, self._region.tensor, offsets, mode="sum",
                                   per_sample_weights=per_sample_weights)
        rows = self._gather(ids)
        return F.embedding_bag(torch.arange(ids.numel()), rows, offsets, mode="sum",
                               per_sample_weights=per_sample_weights)

    # -- public API
    def read(self, ids) -> torch.Tensor:
        """Rows ``ids`` as a new [len(ids), dim] tensor. Duplicates are allowed."""
        self._host.check_open()
        return self._gather(validate_ids(ids, self.config))

    def write(self, ids, values: torch.Tensor) -> None:
        """Set rows ``ids`` to ``values`` in place. Ids must be distinct; nothing changes on error."""
        self._host.check_writable()
        ids = validate_ids(ids, self.config)
        values = validate_values(values, ids.numel(), self.config)
        if ids.numel() and torch.unique(ids).numel() != ids.numel():
            raise InvalidIdsError(f"table {self.name!r}: duplicate ids in write (which value wins would be arbitrary)",
                                  hint="deduplicate ids (torch.unique) and combine their values first")
        self._scatter(ids, values)

    def lookup(self, ids, offsets) -> torch.Tensor:
        """Sum-pooled bags: ``offsets`` [B] (start of each bag in ``ids``) -> [B, dim]."""
        self._host.check_open()
        ids = validate_ids(ids, self.config)
        offsets = validate_offsets(offsets, ids.numel(), self.config)
        return self._pooled(ids, offsets)

    def persist(self, ids=None) -> int:
        """Make rows ``ids`` (default: every row written since the last persist) durable."""
        self._host.check_writable()

        def persist() -> int:
            # (dirty until the transaction is durable: a failed persist leaves them to its retry)
            rows = self._region.dirty_rows() if ids is None else torch.unique(validate_ids(ids, self.config))
            return self._host.persist_rows([(self, rows)])

        return self._host.stats.counted_persist(persist)

    def fill_(self, init: str = "uniform", *, scale: float | None = None, seed: int = 0) -> None:
        """Initialise every row: ``zeros``, or ``uniform`` in [-scale, scale) (TorchRec's
        default scale is sqrt(1/num_embeddings)), block by block so huge tables need no
        table-sized temporary. Deterministic in ``seed``: the same values on every tier, however
        many threads generate them (``memory_pool.initializers``)."""
        self._host.check_writable()
        validate_init(init)
        if init == "zeros":
            chunks = ((a, None) for a in range(0, self.num_embeddings, INIT_BLOCK_ROWS))
        else:
            s = (1.0 / self.num_embeddings) ** 0.5 if scale is None else scale
            region = self._region
            # A direct tier's float32 rows are generated where they live (no copy); a journaled
            # tier's go to its image file from buffers, and other dtypes are converted.
            in_place = not region.journaled and region.tensor.dtype == torch.float32 and region.tensor.is_contiguous()
            chunks = uniform_chunks(self.num_embeddings, self.embedding_dim, seed, s,
                                    dest=region.tensor if in_place else None)
        self._load_chunks(chunks, INIT_BLOCK_ROWS)

    def read_ahead(self) -> None:
        """Start reading the table's home into memory, without waiting: on a journaled tier
        the first steps' copy-on-write faults then find its pages cached instead of reading
        them one at a time (a hint for a table meant to be resident; a no-op elsewhere)."""
        self._host.check_writable()
        self._region.read_ahead()

    def load_(self, values: torch.Tensor) -> None:
        """Replace every row with ``values`` [rows, dim], durably (a bulk write: on a journaled
        tier it goes straight to the table image, not through the journal)."""
        self._host.check_writable()
        values = validate_values(values, self.num_embeddings, self.config)
        step = 1 << 18
        self._load_chunks(((a, values[a:a + step]) for a in range(0, self.num_embeddings, step)), step)

    def _load_chunks(self, chunks, chunk_rows: int) -> None:
        region = self._region
        # Every row is replaced: no journal (or run) value may land later, and no compaction or
        # write-back pass writes the table's older rows into the image until the reset is
        # committed (TableHost.bulk_load forgets its pending rows, and holds them off).
        self._host.written(self.name)
        with self._host.bulk_load(self.name):
            t = region.tensor
            for a, vals in chunks:
                b = min(a + chunk_rows, self.num_embeddings)
                if vals is None:
                    vals = torch.zeros(b - a, self.embedding_dim)
                vals = vals.to(t.dtype).contiguous()
                if region.journaled:
                    region.write_back(torch.arange(a, b), vals.view(torch.uint8).view(b - a, -1))
                    # (the device starts on these pages now, while the next ones are generated:
                    # the sync below then waits for the tail, not for all of them)
                    region.start_writeback(a, b)
                elif vals.data_ptr() != t[a:b].data_ptr():  # (not generated in place)
                    t[a:b] = vals
            if region.journaled:
                # The image holds the new rows durably; map it afresh so this process sees them
                # (and drops any copy-on-write pages of the old ones).
                region.sync(drop_cache=True)
                region.remap()
                region.take_dirty()
                self._host.note_reset(self.name)
            elif self._host.real_pmem:
                region.flush_rows(torch.arange(self.num_embeddings))
        if self._cache is not None:
            self._cache = self._cache.reset(region.tensor)  # (nothing it cached is valid now)
