"""Where a table's bytes live, and how they are made durable: one class per tier.

==========  ===========================================  ============================================
tier        home of the rows                             what survives
==========  ===========================================  ============================================
dram        anonymous memory of this process             nothing
shm         a file in /dev/shm, mapped shared            a crash of the trainer (not reboot/power)
pmem        a file in the pool directory, mapped shared  power loss, once persisted (libpmem on a DAX
                                                         mount; msync/fsync elsewhere)
power-sim   the same file, mapped *private*              exactly what ``persist`` wrote: stores that
                                                         were not persisted are lost at any crash
==========  ===========================================  ============================================

``power-sim`` exists to test that every persist is in the right place: a crash test on ``pmem``
alone cannot catch a missing flush, because the page cache survives a killed process. Its
private copy-on-write mapping keeps unpersisted stores in this process only; ``persist`` copies
exactly the requested rows (or every row written since the last persist) to the file with
``pwrite`` and ``fdatasync``.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import torch

from ._fs import raise_if_full
from ._native import PAGE, libpmem, msync_range
from .errors import InvalidConfigError, PoolCorruptError

__all__ = ["TIERS", "Region", "open_region", "shm_root", "detect_dax", "durability_of"]

TIERS = ("dram", "shm", "pmem", "power-sim")


def shm_root() -> Path:
    return Path(os.environ.get("DLRM_CXL_SHM_DIR", "/dev/shm"))


def detect_dax(path: str | os.PathLike) -> bool:
    """True when ``path`` sits on a filesystem mounted with the ``dax`` option."""
    path = os.path.realpath(path)
    best, dax = "", False
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                mnt, opts = parts[1], parts[3].split(",")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, dax = mnt, any(o == "dax" or o.startswith("dax=") and o != "dax=never" for o in opts)
    except OSError:
        return False
    return dax


def durability_of(tier: str, *, real_pmem: bool = False, libpmem_used: bool = False) -> str:
    if tier == "dram":
        return "none: rows live in this process and are lost when it ends"
    if tier == "shm":
        return "survives a trainer crash (memory outside the process); lost at reboot or power loss"
    if tier == "pmem":
        how = "libpmem cache flushes on a DAX mount" if real_pmem else (
            "pmem_msync (libpmem) on an ordinary filesystem" if libpmem_used else "msync/fsync on an ordinary filesystem")
        return f"survives power loss once persisted ({'real' if real_pmem else 'emulated'} pmem: {how})"
    if tier == "power-sim":
        return "emulated power loss: at any crash only persisted stores survive"
    raise ValueError(f"unknown tier {tier!r}")


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


class Region:
    """Rows of one table in one tier. ``tensor`` is a live [rows, dim] view of them."""

    tier = "dram"

    def __init__(self, rows: int, dim: int, dtype: str):
        self.rows, self.dim, self.dtype = rows, dim, dtype
        self.row_bytes = dim * torch.empty((), dtype=_DTYPES[dtype]).element_size()
        self.nbytes = rows * self.row_bytes
        self.tensor: torch.Tensor

    # Called after rows were changed in place (power-sim tracks them; others need not).
    def mark_dirty(self, ids: torch.Tensor) -> None:
        pass

    def restore_rows(self, ids: torch.Tensor, raw: torch.Tensor) -> None:
        """Set rows ``ids`` to ``raw`` ([n, row_bytes] uint8): recovery's write path."""
        self.tensor.view(torch.uint8).index_copy_(0, ids, raw)
        self.mark_dirty(ids)

    def persist_rows(self, ids: torch.Tensor) -> int:
        """Make the given rows durable; returns bytes persisted."""
        return 0

    def persist_all(self) -> int:
        return 0

    def close(self) -> None:
        self.tensor = torch.empty(0)


class DramRegion(Region):
    tier = "dram"

    def __init__(self, rows, dim, dtype):
        super().__init__(rows, dim, dtype)
        self.tensor = torch.zeros(rows, dim, dtype=_DTYPES[dtype])


class _FileRegion(Region):
    """A table file mapped into memory. Subclasses pick the mapping and the persist method."""

    _access = mmap.ACCESS_WRITE

    def __init__(self, path: Path, rows, dim, dtype, *, create: bool, read_only: bool):
        super().__init__(rows, dim, dtype)
        self.path = Path(path)
        self.read_only = read_only
        flags = os.O_RDONLY if read_only else os.O_RDWR
        if create:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        self.fd = os.open(self.path, flags, 0o644)
        try:
            if create:
                try:
                    # Reserve every block now, so that a full disk fails here, at creation,
                    # and never later as a SIGBUS in the middle of an in-place update.
                    os.posix_fallocate(self.fd, 0, self.nbytes)
                except OSError as exc:
                    raise_if_full(exc, f"allocating {self.nbytes} bytes for {self.path}")
            size = os.fstat(self.fd).st_size
            if size != self.nbytes:
                raise PoolCorruptError(
                    f"table file {self.path} has {size} bytes, expected {self.nbytes} "
                    f"({rows} rows x {self.row_bytes} bytes): truncated or foreign file")
            access = mmap.ACCESS_COPY if read_only else self._access
            self.mm = mmap.mmap(self.fd, self.nbytes, access=access)
        except BaseException:
            os.close(self.fd)
            if create:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
            raise
        # Through a memoryview: the tensor (and every view of it) then holds a buffer export of
        # the mapping, so close() cannot unmap memory a caller still references (a tensor from
        # Table.view() used after pool.close() would otherwise read unmapped memory: SIGSEGV).
        # The mapping then goes when the last such tensor does.
        self.tensor = torch.frombuffer(memoryview(self.mm), dtype=_DTYPES[dtype]).view(rows, dim)
        self.addr = self.tensor.data_ptr()

    def _row_runs(self, ids: torch.Tensor) -> list[tuple[int, int]]:
        """Byte ranges [start, end) covering the given rows, adjacent rows coalesced."""
        if ids.numel() == 0:
            return []
        rows = torch.unique(ids)  # sorted
        if rows.numel() == 1:
            r = int(rows[0])
            return [(r * self.row_bytes, (r + 1) * self.row_bytes)]
        breaks = torch.nonzero(rows[1:] != rows[:-1] + 1).flatten()
        starts = torch.cat([rows[:1], rows[breaks + 1]]).tolist()
        ends = torch.cat([rows[breaks], rows[-1:]]).tolist()
        rb = self.row_bytes
        return [(s * rb, (e + 1) * rb) for s, e in zip(starts, ends)]

    def close(self) -> None:
        self.tensor = torch.empty(0)
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when it does
        except AttributeError:
            pass
        self.mm = None
        try:
            os.close(self.fd)
        except OSError:
            pass


class SharedFileRegion(_FileRegion):
    """shm and pmem: a MAP_SHARED file mapping; stores reach the page cache immediately.

    pmem tracks which rows changed since the last persist (a byte per row): on real persistent
    memory a persist is a cache-line flush of exactly those rows, never of the whole table; with
    msync the kernel already knows the dirty pages, and the count still reports true bytes.
    """

    def __init__(self, path, rows, dim, dtype, *, tier: str, create: bool, read_only: bool,
                 use_libpmem: bool | None = None):
        # Checked before the file is created, so that this error leaves no table file behind.
        lib = libpmem() if use_libpmem is not False else None
        if use_libpmem is True and lib is None:
            raise libpmem_missing()
        super().__init__(path, rows, dim, dtype, create=create, read_only=read_only)
        self.tier = tier
        self.libpmem = lib if tier == "pmem" else None
        self.is_pmem = bool(self.libpmem and self.libpmem.is_pmem(self.addr, self.nbytes))
        self._dirty = torch.zeros(rows if tier == "pmem" else 0, dtype=torch.bool)
        self._lock = threading.Lock()

    def mark_dirty(self, ids):
        if self.tier == "pmem":
            with self._lock:
                self._dirty[ids] = True

    def restore_rows(self, ids, raw):
        if self.is_pmem or self.read_only:
            return super().restore_rows(ids, raw)
        # Through the file, not the mapping: a store to each of ~60k scattered pages of a freshly
        # opened shared mapping takes a page fault (and a journal entry on ext4) per page; pwrite
        # updates the same page cache without them (recovery of a `kaggle` step: 1.3 s -> ~0.1 s).
        data = raw.contiguous().numpy()
        rb = self.row_bytes
        try:
            for i, row in enumerate(ids.tolist()):
                os.pwrite(self.fd, data[i], row * rb)
        except OSError as exc:
            raise_if_full(exc, f"restoring rows of {self.path}")
        self.mark_dirty(ids)

    def _flush(self, start: int, end: int) -> None:
        if self.libpmem is not None:
            self.libpmem.persist(self.addr + start, end - start, self.is_pmem)
        else:
            msync_range(self.addr + start, end - start)

    def persist_rows(self, ids):
        if self.tier == "shm" or self.read_only:
            return 0  # already outside the process: nothing more survives a crash by flushing
        runs = self._row_runs(ids)
        if self.is_pmem:
            for s, e in runs:  # cache-line flushes of exactly these rows
                self._flush(s, e)
        elif runs:
            # msync is page-granular and writes back only dirty pages: one call over the span
            # of the rows costs far less than a system call per run (recovery of a `small` step
            # restores ~30k scattered rows: 0.5 s instead of 7 s).
            self._flush(runs[0][0], runs[-1][1])
        with self._lock:
            self._dirty[ids] = False
        return sum(e - s for s, e in runs)

    def persist_all(self):
        if self.tier == "shm" or self.read_only:
            return 0
        with self._lock:
            dirty = torch.nonzero(self._dirty).flatten()
            self._dirty.zero_()
        if dirty.numel() == 0:
            return 0
        try:
            if self.is_pmem:
                for s, e in self._row_runs(dirty):  # cache-line flushes of the changed rows only
                    self._flush(s, e)
            else:
                # One msync over the mapping: the kernel writes back only its dirty pages, which
                # is cheaper than a system call per run of rows.
                self._flush(0, self.nbytes)
        except BaseException:
            self.mark_dirty(dirty)
            raise
        return dirty.numel() * self.row_bytes


class PowerSimRegion(_FileRegion):
    """Emulated pmem that forgets unpersisted stores: MAP_PRIVATE + explicit pwrite."""

    tier = "power-sim"
    _access = mmap.ACCESS_COPY

    def __init__(self, path, rows, dim, dtype, *, create: bool, read_only: bool):
        super().__init__(path, rows, dim, dtype, create=create, read_only=read_only)
        self._dirty = torch.zeros(rows, dtype=torch.bool)
        self._lock = threading.Lock()

    def mark_dirty(self, ids):
        with self._lock:
            self._dirty[ids] = True

    def _page_runs(self, rows: torch.Tensor) -> list[tuple[int, int]]:
        """Byte ranges of whole pages holding ``rows``, adjacent pages coalesced."""
        if rows.numel() == 0:
            return []
        rb = self.row_bytes
        first = torch.div(rows * rb, PAGE, rounding_mode="floor")
        last = torch.div((rows + 1) * rb - 1, PAGE, rounding_mode="floor")
        pages = torch.unique(torch.cat([first, last]))
        span = (last - first) > 1  # rows wider than a page also cover the pages in between
        if bool(span.any()):
            extra = [torch.arange(int(a) + 1, int(b)) for a, b in zip(first[span], last[span])]
            pages = torch.unique(torch.cat([pages, *extra]))
        breaks = torch.nonzero(pages[1:] != pages[:-1] + 1).flatten()
        starts = torch.cat([pages[:1], pages[breaks + 1]]).tolist()
        ends = torch.cat([pages[breaks], pages[-1:]]).tolist()
        return [(a * PAGE, min((b + 1) * PAGE, self.nbytes)) for a, b in zip(starts, ends)]

    def _write_runs(self, runs) -> int:
        view = memoryview(self.mm)
        total = 0
        try:
            for s, e in runs:
                off = s
                while off < e:
                    off += os.pwrite(self.fd, view[off:e], off)
                total += e - s
            if runs:
                os.fdatasync(self.fd)
        except OSError as exc:
            raise_if_full(exc, f"persisting {self.path}")
        finally:
            view.release()
        return total

    def persist_rows(self, ids):
        if self.read_only:
            return 0
        with self._lock:
            self._dirty[ids] = False
        try:
            return self._write_runs(self._row_runs(ids))
        except BaseException:
            self.mark_dirty(ids)  # not durable after all: a later persist() must retry them
            raise

    def persist_all(self):
        if self.read_only:
            return 0
        with self._lock:
            dirty = torch.nonzero(self._dirty).flatten()
            self._dirty.zero_()
        try:
            # Whole pages, coalesced: a clean row on the same page holds what the file holds
            # already (it was not written since the last persist), so rewriting it is harmless,
            # and one pwrite per run of pages replaces one per run of rows.
            self._write_runs(self._page_runs(dirty))
        except BaseException:
            self.mark_dirty(dirty)
            raise
        return dirty.numel() * self.row_bytes


def libpmem_missing() -> InvalidConfigError:
    return InvalidConfigError(
        "use_libpmem=True but libpmem is not available (not installed, or DLRM_CXL_NO_LIBPMEM=1)",
        hint="apt-get install libpmem1, or pass use_libpmem=None to fall back to msync")


def open_region(tier: str, path: Path | None, rows: int, dim: int, dtype: str, *, create: bool,
                read_only: bool = False, use_libpmem: bool | None = None) -> Region:
    if tier == "dram":
        return DramRegion(rows, dim, dtype)
    if tier in ("shm", "pmem"):
        return SharedFileRegion(path, rows, dim, dtype, tier=tier, create=create, read_only=read_only,
                                use_libpmem=use_libpmem)
    if tier == "power-sim":
        return PowerSimRegion(path, rows, dim, dtype, create=create, read_only=read_only)
    raise InvalidConfigError(f"unknown tier {tier!r}; expected one of {TIERS + ('auto',)}")
