"""Where a table's bytes live, and how they are made durable: one region class per kind.

==========  ==============================================  ==========================================
tier        home of the rows (the working copy)             what survives, and how it is persisted
==========  ==============================================  ==========================================
dram        anonymous memory of this process                nothing
shm         a file in /dev/shm, mapped shared               a crash of the trainer (not reboot/power):
                                                            every store is already outside the process
pmem (DAX)  a file on a DAX mount, mapped shared            power loss, once flushed: libpmem
                                                            ``pmem_persist`` of exactly the rows
pmem (emu)  a file in the pool directory, mapped *private*  power loss, once persisted: the bytes go to
power-sim   (copy-on-write) over the table image            the pool's journal (``journal.py``); a
                                                            crash of any kind drops the rest
==========  ==============================================  ==========================================

Emulated pmem persists bytes, not pages, like the real thing: the working copy is a private
mapping of the image file (stores never reach the file on their own, so the kernel's page
write-back never writes a 4 KiB page for a 256-byte row), ``persist`` appends the rows to a
sequential checksummed journal with one ``fdatasync`` per group, and a compactor writes them back
into the image in the background. ``power-sim`` is the same mechanism under the name the crash
tests use; on a DAX mount ``pmem`` is real and flushes cache lines instead.

Every region is a slice of the pool's :class:`~memory_pool.arena.Arena`, so all tables of a pool
form one flat range that fbgemm's table-batched kernels index with per-table offsets.
"""


from __future__ import annotations

import ctypes
import mmap
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from . import fileio
from .durable import pwrite_all, raise_if_full
from ._native import libpmem
from .arena import Arena, adjacent_runs
from .errors import InvalidConfigError, PoolCorruptError, PoolFullError

__all__ = ["TIERS", "Tier", "tier_of", "resolve_tier", "DEFAULT_TIER", "Region", "FileRegion", "open_region", "shm_root", "detect_dax",
           "prefetch_if_cold"]

def shm_root() -> Path:
    return Path(os.environ.get("DLRM_CXL_SHM_DIR", "/dev/shm"))


def detect_dax(path: str | os.PathLike) -> bool:
    """True when ``path`` sits on a filesystem mounted with the ``dax`` option."""
    m = fileio.mount_entry(path)
    return m is not None and any(o == "dax" or o.startswith("dax=") and o != "dax=never" for o in m[2])


@dataclass(frozen=True)
class Tier:
    """What a tier is, in one place: every other module asks this object, never a tier's name.

    ``name``: the tier as the header and ``--tier`` spell it. ``durability``: what survives, as
    the banner (and ``describe``) prints it. ``journaled``: rows are persisted through the pool's
    journal (emulated pmem, power-sim); otherwise a region persists them itself or not at all.
    ``has_files``: the rows live in table files (all but dram); ``files_in_shm``: those files,
    and the journal, live in the pool's own shm region, not in the pool directory.
    ``journal_mapped`` / ``journal_synced`` / ``journal_direct``: how the journal writes (RAM
    tiers: copied into a mapping of the segment, never synced; others: direct, synced).
    ``applied_mark``: write-back passes keep an applied mark in RAM (emulated pmem).
    ``power_loss``: the emulated power loss (memory_pool/fileio.py): ``"always"`` (power-sim),
    ``"on request"`` (emulated pmem, under ``fileio.ENV``) or ``"never"``. ``reopenable``: a
    pool of it can be opened again by another process (dram: never; shm: while its region
    exists). ``dax``: real on a DAX mount with libpmem, emulated elsewhere (pmem);
    ``real_pmem``: this is the real one (rows flushed with cache-line flushes)."""

    name: str
    durability: str
    journaled: bool
    has_files: bool
    files_in_shm: bool
    journal_mapped: bool
    journal_synced: bool
    journal_direct: bool
    applied_mark: bool
    power_loss: str
    reopenable: bool
    dax: bool = False
    real_pmem: bool = False

    @property
    def files_in_pool_dir(self) -> bool:
        """Table files in the pool directory: durable media, synced before the header names them."""
        return self.has_files and not self.files_in_shm

    @property
    def may_lose_power(self) -> bool:
        """A crashed writer of this tier may have left an emulated power loss to power on."""
        return self.power_loss != "never"

    def emulates_power_loss(self) -> bool:
        """Whether a writable pool of this tier runs under the emulated power loss now."""
        return self.power_loss == "always" or (self.power_loss == "on request" and os.environ.get(fileio.ENV) == "1")


def _tier(name: str, durability: str, *, journaled: bool = False, files: str = "pool", applied_mark: bool = False,
          power_loss: str = "never", dax: bool = False, real_pmem: bool = False) -> Tier:
    in_ram = files != "pool"   # (shm, dram: a sync means nothing there)
    return Tier(name, durability, journaled=journaled, has_files=files != "none", files_in_shm=files == "shm",
                journal_mapped=in_ram, journal_synced=not in_ram, journal_direct=not in_ram,
                applied_mark=applied_mark, power_loss=power_loss, reopenable=files != "none", dax=dax,
                real_pmem=real_pmem)


_BY_NAME = {
    "dram": _tier("dram", "none: rows live in this process and are lost when it ends", files="none"),
    "shm": _tier("shm", "survives a trainer crash (memory outside the process); lost at reboot or power loss",
                 files="shm"),
    "pmem": _tier("pmem", "survives power loss once persisted (emulated pmem: byte-granular journal with group "
                          "commit on an ordinary filesystem; any crash keeps exactly what was persisted)",
                  journaled=True, applied_mark=True, power_loss="on request", dax=True),
    "power-sim": _tier("power-sim", "emulated power loss: at any crash only persisted stores survive "
                                    "(byte-granular journal)", journaled=True, power_loss="always"),
}
_REAL_PMEM = _tier("pmem", "survives power loss once persisted (real pmem: libpmem cache flushes on a DAX mount)",
                   dax=True, real_pmem=True)
TIERS = tuple(_BY_NAME)
AUTO = "auto"
DEFAULT_TIER = "pmem"   # what "auto" resolves to: durable beats fast


def tier_of(name: str, *, real_pmem: bool = False) -> Tier:
    """The :class:`Tier` named ``name``; ``real_pmem`` (pmem only): on a DAX mount with libpmem."""
    tier = _BY_NAME.get(name)
    if tier is None:
        raise InvalidConfigError(f"unknown tier {name!r}; expected one of {TIERS + (AUTO,)}")
    return _REAL_PMEM if real_pmem and tier.dax else tier


def resolve_tier(tier: str) -> str:
    """A tier's name as ``create`` takes it (``auto`` included), resolved and checked."""
    if tier == AUTO:
        # Durable beats fast: a fault-tolerant trainer wants rows that survive power loss.
        # pmem is real when the directory is on a DAX mount, emulated (msync) otherwise.
        return DEFAULT_TIER
    if tier not in TIERS:
        raise InvalidConfigError(f"tier must be one of {TIERS + (AUTO,)}, got {tier!r}")
    return tier


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


# Rows written back in runs of at least this many bytes on average go with pwrite (one call per
# run); shorter runs through a shared mapping (one page fault per page): FileRegion.write_back.
_LONG_RUN = 64 << 10
_PAGE = 4096  # the page a fault reads (will_need)
READ_AHEAD_PIECE = 4 << 20  # bytes a read_ahead asks for per call (read_ahead: why)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def _resident(addr: int, offsets: list[int]) -> float:
    """Fraction of the pages at ``addr + offsets`` that are in the page cache (``mincore``: for a
    file mapping it looks the page up in the file's cache, mapped here or not)."""
    vec, hits = ctypes.c_ubyte(), 0
    for off in offsets:
        if _libc.mincore((addr + off) & ~(_PAGE - 1), _PAGE, ctypes.byref(vec)) == 0 and vec.value & 1:
            hits += 1
    return hits / max(1, len(offsets))


def prefetch_if_cold(fd: int, addr: int, row_bytes: int, parts: list, *, sample: int = 64) -> int:
    """Before a replay into a private mapping (at ``addr``) of the image ``fd``, or a write-back
    through a shared one (``FileRegion._will_store``): when the pages the rows of ``parts`` land
    in are mostly not in the page cache (a reboot, a power loss, a trim), ask the kernel for them
    all now (``POSIX_FADV_WILLNEED`` per run of pages): read at the disk's queue depth, not one
    synchronous read per fault. Returns the pages asked for (0: cached; a few ``mincore`` calls
    decide). Measured on `kaggle` (1.16 M rows on 438k pages, not cached): opening took
    10.0-11.4 s, 6.6-6.9 s with this; on cached pages the calls cost ~0.5 s, hence only if cold."""
    ids = torch.cat([p[0] for p in parts])
    if ids.numel() == 0:
        return 0
    step = max(1, ids.numel() // sample)
    if _resident(addr, (ids[::step][:sample] * row_bytes).tolist()) >= 0.5:
        return 0
    start = ids * row_bytes
    pages = torch.unique(torch.cat([start // _PAGE, (start + row_bytes - 1) // _PAGE]))
    firsts, lasts = adjacent_runs(pages)
    try:
        for a, b in zip(firsts, lasts):
            os.posix_fadvise(fd, a * _PAGE, (b - a + 1) * _PAGE, os.POSIX_FADV_WILLNEED)
    except OSError:
        return 0  # advice only: a file system that refuses it replays as before
    return pages.numel()


class Region:
    """Rows of one table: ``tensor`` is a live [rows, dim] view of them inside the pool's arena."""

    tier = "dram"
    journaled = False   # persisted through the pool's journal (emulated pmem, power-sim)
    keep_cached = False  # its image stays cached through trims (dlrm_cxl.fused.bind_cached: why)

    def __init__(self, arena: Arena, rows: int, dim: int, dtype: str):
        self.rows, self.dim, self.dtype = rows, dim, dtype
        self.row_bytes = dim * torch.empty((), dtype=_DTYPES[dtype]).element_size()
        self.nbytes = rows * self.row_bytes
        self.arena = arena
        self.offset = arena.place(self.nbytes) if arena is not None else None
        self.tensor: torch.Tensor
        self._dirty = torch.zeros(0, dtype=torch.bool)
        self._lock = threading.Lock()

    def _view(self) -> torch.Tensor:
        return self.arena.tensor(self.offset, self.nbytes, _DTYPES[self.dtype]).view(self.rows, self.dim)

    # Dirty rows: written since the last persist (journaled and real-pmem regions track them).
    def mark_dirty(self, ids: torch.Tensor) -> None:
        if self._dirty.numel():
            with self._lock:
                self._dirty[ids] = True

    def take_dirty(self) -> torch.Tensor:
        """The dirty rows (sorted), cleared. Only for rows that need no persisting any more (a bulk
        load replaced them durably); a persist uses :meth:`dirty_rows`, then :meth:`clear_dirty`."""
        if not self._dirty.numel():
            return torch.empty(0, dtype=torch.int64)
        with self._lock:
            ids = torch.nonzero(self._dirty).flatten()
            self._dirty.zero_()
        return ids

    def dirty_rows(self) -> torch.Tensor:
        """The dirty rows (sorted), left dirty: they stay so until the transaction that persists
        them is durable (``persistence.persist_rows`` clears them then), so that a persist that
        fails (a full disk) leaves them for the retry."""
        if not self._dirty.numel():
            return torch.empty(0, dtype=torch.int64)
        with self._lock:
            return torch.nonzero(self._dirty).flatten()

    def clear_dirty(self, ids: torch.Tensor) -> None:
        """Rows ``ids`` are durable: no longer dirty."""
        if self._dirty.numel():
            with self._lock:
                self._dirty[ids] = False

    def restore_rows(self, ids: torch.Tensor, raw: torch.Tensor) -> None:
        """Set rows ``ids`` to ``raw`` ([n, row_bytes] uint8): recovery's write path."""
        self.tensor.view(torch.uint8).view(self.rows, self.row_bytes).index_copy_(0, ids, raw)
        self.mark_dirty(ids)

    def flush_rows(self, ids: torch.Tensor) -> int:
        """Flush rows to a directly persistent medium (real pmem); others: none."""
        return 0

    def read_randomly(self) -> None:
        """No readahead on the rows' faults (``FileRegion``'s private working copy); others: none."""

    def trim(self, *, remap: bool = True) -> None:
        """Give back the process's pages of a journaled working copy (``FileRegion``); others: none
        (on shm and real pmem the mapping is the medium itself)."""

    def will_need(self, ids: torch.Tensor) -> int:
        """Start reading the pages of rows ``ids`` from the medium, without waiting (``FileRegion``'s
        private working copy); others: nothing to do. Returns the read requests made."""
        return 0

    def read_ahead(self) -> None:
        """Start reading the whole image into the page cache, without waiting (``FileRegion``)."""

    def close(self) -> None:
        self.tensor = torch.empty(0)


class DramRegion(Region):
    tier = "dram"

    def __init__(self, arena, rows, dim, dtype):
        super().__init__(arena, rows, dim, dtype)
        if self.offset is None:
            self.tensor = torch.zeros(rows, dim, dtype=_DTYPES[dtype])
        else:
            arena.map_anon(self.offset, self.nbytes)
            self.tensor = self._view()


class FileRegion(Region):
    """A table file mapped into the arena: shared (shm, real pmem) or private (journaled tiers,
    read-only opens: stores stay in this process and never reach the file)."""

    def __init__(self, arena, path: Path, rows, dim, dtype, *, tier: str, create: bool, read_only: bool,
                 shared: bool, journaled: bool):
        super().__init__(arena, rows, dim, dtype)
        self.tier = tier
        self.path = Path(path)
        self.read_only = read_only
        self.shared = shared and not read_only
        self.journaled = journaled
        self._home = None  # (mmap, view): the image mapped shared, for the write-back (home())
        self._random = False  # read_randomly() was called: no readahead on home() either
        self.pages_prefetched = 0  # image pages asked for before write-backs into them (_will_store)
        flags = os.O_RDONLY if read_only else os.O_RDWR
        if create:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        self.fd = fileio.open(self.path, flags, 0o644)
        try:
            if create:
                try:
                    # Reserve every block now, so that a full disk fails here, at creation,
                    # and never later as a SIGBUS in the middle of an in-place update (or of a
                    # journal write-back).
                    fileio.fallocate(self.fd, 0, self.nbytes)
                except OSError as exc:
                    raise_if_full(exc, f"allocating {self.nbytes} bytes for {self.path}")
            size = os.fstat(self.fd).st_size
            if size != self.nbytes:
                raise PoolCorruptError(
                    f"table file {self.path} has {size} bytes, expected {self.nbytes} "
                    f"({rows} rows x {self.row_bytes} bytes): truncated or foreign file")
            if self.offset is None:
                raise PoolFullError(f"the pool's address range is full; table {self.path.name} does not fit",
                                    hint="open the pool again: the range is sized for all its tables")
            arena.map_file(self.offset, self.fd, self.nbytes, shared=self.shared, writable=not read_only)
        except BaseException:
            fileio.close(self.fd)
            if create:
                try:
                    fileio.unlink(self.path)
                except OSError:
                    pass
            raise
        self.tensor = self._view()
        self.addr = self.tensor.data_ptr() if self.nbytes else 0
        if journaled and not read_only:
            self._dirty = torch.zeros(rows, dtype=torch.bool)

    @contextmanager
    def home(self):
        """The image file itself, mapped shared and writable (a writable open), as a
        ``[rows, row_bytes]`` uint8 tensor valid inside the ``with``: stores go to the file's
        page cache (durable after :meth:`sync`). The private working copy shows them on pages
        this process has not written itself.

        Why (compaction's write-back): a store through the mapping costs one page fault per
        page, whatever the number of rows in it; ``pwrite`` costs a system call, and a Python
        call, per run of adjacent rows. Measured on `small` (1.4M rows in 757k runs on 106k
        pages): 1.95 s of CPU with ``pwrite``, 0.47 s through the mapping. On a cached page
        with a row alone in it the two cost the same (1.8-1.9 us here). The blocks of an image
        are allocated and written when it is created (``posix_fallocate``, then its rows), so
        a store here overwrites allocated blocks and needs no space (ext4, xfs): a full disk
        does not turn into a SIGBUS. On a copy-on-write file system (btrfs), which allocates on
        every overwrite, a store into a full disk can: there, ``pwrite`` would have reported it
        as an error."""
        if not self.nbytes:
            yield torch.empty(0, self.row_bytes, dtype=torch.uint8)
            return
        # Kept mapped until the next sync (or close; only the write-back's thread uses it):
        # between compactions the journal is written back in several passes (MemoryPool.apply),
        # and a page that several passes hit faults once, not once per pass.
        if self._home is None:
            mm = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if self._random:
                # (the rows written back are scattered over an image mostly not in the page
                # cache: each fault reads its own page, not a readahead window -- measured on
                # `kaggle` behind a DRAM cache: 8.6 GB read from the device a step without this)
                mm.madvise(mmap.MADV_RANDOM)
            self._home = (mm, torch.frombuffer(mm, dtype=torch.uint8).view(self.rows, self.row_bytes))
        yield self._home[1]

    def write_back(self, ids: torch.Tensor, raw: torch.Tensor) -> int:
        """Write rows (sorted, distinct ids; raw [n, row_bytes] uint8) into the image file. Not
        synced: see :meth:`sync`. Long runs of adjacent rows (a load) go with ``pwrite``;
        scattered rows (a compaction) are stored through :meth:`home`, one page fault per page
        instead of one system call per run."""
        if ids.numel() == 0:
            return 0
        rb = self.row_bytes
        is_break = ids[1:] != ids[:-1] + 1
        if ids.numel() * rb < (int(is_break.sum()) + 1) * _LONG_RUN:
            with self.home() as home:
                self._will_store(home, [(ids,)])
                if fileio.needs_notes(self.fd):  # a store no system call sees: noted (fileio)
                    fileio.note_rows(self.fd, ids.numpy(), rb, home.index_select(0, ids).numpy())
                home.index_copy_(0, ids, raw)
            return ids.numel() * rb
        breaks = (torch.nonzero(is_break).flatten() + 1).tolist()  # (a list only for the few long runs)
        data = raw.contiguous().numpy()
        starts = [0, *breaks]
        ends = [*breaks, ids.numel()]
        first = ids[starts].tolist() if len(starts) > 1 else [int(ids[0])]
        try:
            for a, b, row in zip(starts, ends, first):
                pwrite_all(self.fd, data[a:b], row * rb)
        except OSError as exc:
            raise_if_full(exc, f"writing back rows of {self.path}")
        return ids.numel() * rb

    def write_back_in_order(self, parts) -> int:
        """Write ``[(ids, raw)]`` into the image file one part after the other (a row in several
        parts ends up with its last value; ids distinct within a part). Not synced."""
        n = 0
        with self.home() as home:
            self._will_store(home, parts)
            for ids, raw in parts:
                if fileio.needs_notes(self.fd):  # a store no system call sees: noted (fileio)
                    fileio.note_rows(self.fd, ids.numpy(), self.row_bytes, home.index_select(0, ids).numpy())
                home.index_copy_(0, ids, raw)
                n += ids.numel() * self.row_bytes
        return n

    def _will_store(self, home: torch.Tensor, parts) -> None:
        """Before rows ``[(ids, ...)]`` are stored through :meth:`home`: each page not in the page
        cache would be read by its fault, one synchronous read after the other. Where they are
        mostly not cached (an image whose pages a DRAM cache's trims and refreshes gave back,
        ``MemoryPool.trim_working_copy``), ask for them all first, read at the disk's queue depth
        (``prefetch_if_cold``, sampled on this shared mapping: the image's own page cache).
        Measured on `kaggle` behind a 2.2 GB DRAM cache on emulated pmem: the trims' write-back
        passes 8.7 -> 3.5 s over 90 steps, 5.9k -> 7.8-8.0k samples/s."""
        self.pages_prefetched += prefetch_if_cold(self.fd, home.data_ptr(), self.row_bytes, parts)

    def start_writeback(self, first_row: int, end_row: int) -> None:
        """Start the device on rows ``[first_row, end_row)`` written to the image (a bulk load)."""
        fileio.start_writeback(self.fd, first_row * self.row_bytes, (end_row - first_row) * self.row_bytes)

    def sync(self, *, drop_cache: bool = False) -> None:
        """fdatasync the image. ``drop_cache`` (after a bulk, sequential write: creation, a
        load): also drop its clean page cache. Why: a file written sequentially is cached in
        large folios (up to MBs on recent kernels), and a later 256-byte write-back into one
        dirties -- and writes -- the whole folio (2,000 scattered rows of a 102 MB image wrote
        102 MB). Faulted in again by the working copy and the compactor's small writes, they come
        back as 4 KiB folios: the write-back stays page-granular (7.9 MB for those rows)."""
        # Unmapped first: fdatasync write-protects every dirty page it writes, walking each
        # page's mappings; with the writable mapping still there that walk cost 3.8 s of CPU
        # for a `kaggle` compaction (1.8 GB of dirty pages), against a fraction without it.
        self.unmap_home()
        try:
            fileio.fdatasync(self.fd)
        except OSError as exc:
            raise_if_full(exc, f"syncing {self.path}")
        if drop_cache:
            self.drop_cache()

    def drop_cache(self, *, write_out: bool = False) -> None:
        """Drop the image's clean page cache; ``write_out``: its dirty pages written out first,
        waited for. Hints, as :meth:`start_writeback`: nothing is durable before :meth:`sync`."""
        if write_out:
            fileio.start_writeback(self.fd, 0, 0, wait=True)
        try:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            pass

    def remap(self) -> None:
        """Map the file afresh at the region's place in the arena (after a bulk load wrote the
        image itself: this process then sees the new rows, and drops any copy-on-write pages of
        the old ones)."""
        self.arena.map_file(self.offset, self.fd, self.nbytes, shared=self.shared, writable=not self.read_only)

    def read_randomly(self) -> None:
        """No readahead on the working copy's faults (the misses of a DRAM cache in front)."""
        self._random = True
        if self.nbytes and self.offset is not None:
            self.arena.advise_random(self.offset, self.nbytes)

    def trim(self, *, remap: bool = True) -> None:
        """Give back this process's memory for the table (journaled tiers): the image mapped
        afresh over the working copy (its copy-on-write pages go, and ``MADV_RANDOM``: a later
        fault reads its own page, not a readahead window), then the image's clean page cache
        dropped. The caller guarantees that the image's page cache, or a run for a row pending
        again (``Overlay.repend``), holds every row's current value: nothing reads differently.
        ``remap=False``: no page of the working copy was written since it was mapped (a refresh
        with nothing written), so its pages are dropped where they are (``MADV_DONTNEED``), and
        the mapping a write-back stores through is left alone (no compaction waited for)."""
        if not self.nbytes or self.shared or self.read_only or (self.keep_cached and not remap):
            return  # (kept cached: a home kept in memory on purpose, counted in the budget)
        if not remap and self.arena.drop_pages(self.offset, self.nbytes):
            return  # (clean pages reclaimed as they lay: the fadvise below starts the write-out of
            #          every dirty page of the file and waited for the device's queue, seconds)
        if remap:
            self.unmap_home()  # (a page still mapped there is not dropped from the page cache)
            self.remap()
            self.read_randomly()
        if not self.keep_cached:
            self.drop_cache()

    def read_ahead(self) -> None:
        """``POSIX_FADV_WILLNEED`` on the whole image: the kernel queues sequential reads and
        returns (~5 ms for 2 GB here). Pages read this way are cached as 4 KiB folios (the
        kernel's forced read-ahead allocates the mapping's minimum order), so a later
        write-back of scattered rows stays page-granular (measured: 2,000 rows of a 102 MB
        image wrote 7.9 MB after it, as after faults; 107 MB when the pwrite's own large folios
        were kept): reading ahead after :meth:`sync` ``(drop_cache=True)`` keeps what that drop
        is for."""
        if not self.nbytes or self.shared:  # (shared: shm, real pmem -- memory)
            return
        # In pieces: the kernel reads at most the device's read-ahead window per call (8 MiB
        # here, /sys/block/*/queue/read_ahead_kb), so one call over `kaggle`'s 40 MB state
        # image cached its first 8 MB only; 4 MiB at a time, 10 ms of calls for all of it.
        try:
            for off in range(0, self.nbytes, READ_AHEAD_PIECE):
                os.posix_fadvise(self.fd, off, min(READ_AHEAD_PIECE, self.nbytes - off), os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):
            pass

    def will_need(self, ids: torch.Tensor) -> int:
        """``POSIX_FADV_WILLNEED`` on the pages of rows ``ids`` (sorted), adjacent pages in one
        request: the kernel queues every read at once and returns, so that the faults of the
        copy that follows wait on reads already in flight, many at a time, instead of one after
        the other (a DRAM cache's misses, ``MADV_RANDOM``: random 4 KiB reads of this VM's disk,
        12k/s one at a time, 32k/s sixteen at a time). Pages already cached cost a lookup."""
        if not ids.numel() or not self.nbytes or self.shared or self.keep_cached:
            # (shared: shm, real pmem -- memory; kept cached: read ahead whole, its pages stay,
            # and a call per run of pages would cost ~2 us each for nothing)
            return 0
        rb = self.row_bytes
        at = ids * rb
        pages = torch.unique(torch.cat([at // _PAGE, (at + rb - 1) // _PAGE]))
        starts, ends = adjacent_runs(pages)
        fd, will = self.fd, os.POSIX_FADV_WILLNEED
        for a, b in zip(starts, ends):
            os.posix_fadvise(fd, a * _PAGE, (b - a + 1) * _PAGE, will)
        return len(starts)

    def unmap_home(self) -> None:
        """Drop :meth:`home`'s mapping (before a sync, and at close)."""
        if self._home is not None:
            mm = self._home[0]
            self._home = None  # the view goes first: it holds the mapping's buffer
            try:
                mm.close()
            except BufferError:
                pass  # a view escaped: unmapped when it goes

    def close(self) -> None:
        self.tensor = torch.empty(0)
        self.unmap_home()
        try:
            fileio.close(self.fd)
        except OSError:
            pass


class PmemRegion(FileRegion):
    """pmem on a DAX mount with libpmem: stores go to persistent memory through the CPU caches;
    persisting rows is a cache-line flush of exactly those rows (``pmem_persist``). When libpmem
    says the mapping is not real pmem after all, ``pmem_msync`` (page-granular) is used."""

    def __init__(self, arena, path, rows, dim, dtype, *, lib, create: bool, read_only: bool):
        super().__init__(arena, path, rows, dim, dtype, tier="pmem", create=create, read_only=read_only,
                         shared=True, journaled=False)
        self.libpmem = lib
        self.is_pmem = bool(self.nbytes and lib.is_pmem(self.addr, self.nbytes))
        if not read_only:
            self._dirty = torch.zeros(rows, dtype=torch.bool)

    def flush_rows(self, ids):
        if self.read_only or ids.numel() == 0:
            return 0
        rows = torch.unique(ids)
        rb = self.row_bytes
        for r in rows.tolist():
            self.libpmem.persist(self.addr + r * rb, rb, self.is_pmem)
        self.clear_dirty(rows)
        return rows.numel() * rb


def libpmem_missing() -> InvalidConfigError:
    return InvalidConfigError(
        "use_libpmem=True but libpmem is not available (not installed, or DLRM_CXL_NO_LIBPMEM=1)",
        hint="apt-get install libpmem1, or pass use_libpmem=None to fall back to msync")


def open_region(arena: Arena, tier: Tier, path: Path | None, rows: int, dim: int, dtype: str, *, create: bool,
                read_only: bool = False) -> Region:
    if not tier.has_files:
        return DramRegion(arena, rows, dim, dtype)
    if tier.real_pmem:
        return PmemRegion(arena, path, rows, dim, dtype, lib=libpmem(), create=create, read_only=read_only)
    # The working copy: the file mapped shared (shm), or privately over a journaled image.
    return FileRegion(arena, path, rows, dim, dtype, tier=tier.name, create=create, read_only=read_only,
                      shared=not tier.journaled, journaled=tier.journaled)
