"""The one I/O layer of the durable pool files, and the emulated power loss that runs through it.

Every operation the journaled tiers (emulated pmem, power-sim) do on a pool file goes through
here: ``open`` (a file created), ``pwrite``, stores into a shared mapping (:func:`note_rows` /
:func:`note_range`, called *before* the store), ``ftruncate``/``fallocate``, ``fdatasync``,
``fsync``, :func:`fsync_dir`, :func:`rename` and :func:`unlink`. Outside an emulated power loss
each is the plain system call and nothing more (one dictionary look-up: the fast path).

Emulated power loss (``power-sim`` always; emulated ``pmem`` when ``DLRM_CXL_POWER_LOSS=1``, the
crash tests) -- "a crash keeps exactly what was synced"
--------------------------------------------------------------------------------------------
A SIGKILL keeps the kernel's page cache, so a killed trainer alone cannot show a missing sync.
Here every operation is still done for real (the process sees exactly what it would see), and
*before* it the layer appends, to an undo log in the pool (``.power-loss/undo-<gen>.log``), what
a power loss would take back: the old bytes of a write (and the file's old size), a file's
creation, a rename (the file it displaced kept aside, under ``.power-loss/``), an unlink (the
file kept aside). A sync cancels what it makes durable -- ``fdatasync``/``fsync`` of a file its
data entries, :func:`fsync_dir` of a directory the names created, renamed or removed in it -- by
appending a marker. The next open of the pool (:func:`power_on`, before it reads anything)
undoes every entry not cancelled, newest first: the files are then exactly what a power loss at
the moment of the crash leaves when nothing unsynced reached the disk. SQLite tests its commit
the same way, on a VFS that drops unsynced writes.

The crash-state checker (``tools/crash_states.py``) calls :func:`power_on` with a ``lose``
choice instead: any prefix of the unsynced operations, or random subsets of them torn at 512 B or
4 KiB blocks -- the states POSIX allows when a sync is interrupted part-way or the kernel wrote
some pages back early.

Stores into a shared mapping: the compaction writes rows home through a writable mapping of the
image (``FileRegion.home``), which no system call sees. Those stores are accounted for by
:func:`note_rows`, which the write-back calls with the rows' old bytes right before it stores
them; the image's ``fdatasync`` then cancels them like any write. A mapped journal segment
(:func:`note_range`) is the same. A store that skipped the note would survive the emulated power
loss: the layer cannot see it, so every store into a durable file's mapping goes through one of
these two places.

Why the log itself is synced at each marker: a marker lost in a real power loss (the
loop-device test) would make :func:`power_on` undo data that the file system had made durable.
And why it is synced before each real sync (``_log_first``): a sync makes durable every operation
done before it, and the entries that undo them must be durable by then. With entries unsynced, a
real power loss right after a directory's fsync kept a rename (a new runs/MANIFEST) whose entry
was lost, while the entry for the creation of the run it names had been synced with an earlier
marker: :func:`power_on` deleted the run and left the manifest naming it (the loop-device test,
1 run in ~30 under load). An entry lost without a sync after it is an unsynced operation that
happened to reach the disk, a state a power loss may leave anyway (the kernel's own write-back,
the one case this emulation cannot order). The log is deleted (a new generation begun) whenever every entry
in it is cancelled, so it holds only the unsynced work of the moment.
"""

from __future__ import annotations

import builtins
import fcntl
import os
import threading
from pathlib import Path

import numpy as np

# The undo log's format and the power loss it describes (re-exported: one place to call).
from .powerloss import LOG_DIR, Lose, encode_entry, PowerOnReport, pending, power_on, unsynced_count

__all__ = ["open", "pwrite", "set_direct", "mount_entry", "ftruncate", "fallocate", "populate_write", "fdatasync", "fsync", "fsync_dir", "rename", "unlink",
           "note_rows", "note_range", "start_writeback", "watch", "unwatch", "watching", "power_on", "pending", "unsynced_count", "LOG_DIR",
           "ENV", "Lose", "PowerOnReport"]

ENV = "DLRM_CXL_POWER_LOSS"   # "1": emulated pmem loses what was not synced too (the crash tests)

_os_open = os.open  # (this module's ``open`` shadows the builtin name inside it)


class _Sim:
    """The undo log of one watched directory tree (a pool)."""

    def __init__(self, root: Path):
        self.root = root
        self.dir = root / LOG_DIR
        self.lock = threading.Lock()
        self.gen = 0
        self.fd: int | None = None
        self.live_data: dict[str, int] = {}      # path -> entries of data not yet synced
        self.live_names: list[dict] = []         # namespace entries not yet made durable
        self.graves = 0
        self.dirty_log = False                   # entries written since the log's last sync

    def rel(self, path) -> str | None:
        p = os.path.abspath(path)
        r = os.path.relpath(p, self.root)
        return None if r.startswith("..") or r.split(os.sep, 1)[0] == LOG_DIR else r

    # -- the log
    def _log_fd(self) -> int:
        if self.fd is None:
            self.dir.mkdir(exist_ok=True)
            self.fd = _os_open(self.dir / f"undo-{self.gen:08d}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        return self.fd

    def append(self, doc: dict, blob: bytes | memoryview = b"") -> None:
        os.write(self._log_fd(), encode_entry(doc, blob))
        self.dirty_log = True

    def sync_log(self) -> None:
        """The layer's own sync: the markers just written durable (see the module doc)."""
        if self.fd is not None and self.dirty_log:
            os.fdatasync(self.fd)
            self.dirty_log = False

    def maybe_rotate(self) -> None:
        """Every entry cancelled: the log holds nothing a power loss would undo; start anew."""
        if self.fd is not None and not any(self.live_data.values()) and not self.live_names:
            os.close(self.fd)
            self.fd = None
            try:
                os.unlink(self.dir / f"undo-{self.gen:08d}.log")
            except FileNotFoundError:
                pass
            self.gen += 1
            self.live_data.clear()

    def grave(self) -> Path:
        self.dir.mkdir(exist_ok=True)
        self.graves += 1
        return self.dir / f"grave-{self.gen:08d}-{self.graves:06d}"


_sims: dict[Path, _Sim] = {}
_fds: dict[int, tuple[_Sim, str, int]] = {}   # open descriptors of watched files: (sim, path, inode)
_glock = threading.Lock()


def watch(root) -> None:
    """Emulate power loss for every file under ``root`` from now on (one writer per pool: the
    pool's lock)."""
    root = Path(os.path.abspath(root))
    with _glock:
        if root not in _sims:
            _sims[root] = _Sim(root)


def unwatch(root) -> None:
    """Stop watching ``root`` (the pool closed). Its log stays: the next open undoes what was
    never synced, as a power loss right after the close would."""
    root = Path(os.path.abspath(root))
    with _glock:
        sim = _sims.pop(root, None)
        if sim is None:
            return
        for fd in [fd for fd, (s, _, _) in _fds.items() if s is sim]:
            del _fds[fd]
        if sim.fd is not None:
            os.close(sim.fd)
            sim.fd = None


def watching(root) -> bool:
    return Path(os.path.abspath(root)) in _sims


def _sim_of(path) -> tuple[_Sim, str] | None:
    if not _sims:
        return None
    p = os.path.abspath(path)
    for root, sim in _sims.items():
        r = sim.rel(p)
        if r is not None:
            return sim, r
    return None


# --------------------------------------------------------------------------- the operations
def open(path, flags: int, mode: int = 0o644) -> int:  # noqa: A001 (the layer's own open)
    """``os.open``; a file it creates is an entry (its name is durable once its directory is)."""
    hit = _sim_of(path) if _sims else None
    if hit is None:
        return _os_open(path, flags, mode)
    sim, rel = hit
    with sim.lock:
        existed = os.path.exists(path)
        if flags & os.O_CREAT and not existed:
            sim.append({"op": "create", "path": rel})
            sim.live_names.append({"dirs": {os.path.dirname(rel)}})
        elif flags & os.O_TRUNC and existed and os.path.getsize(path):
            _note_size(sim, rel, path, 0)
        fd = _os_open(path, flags, mode)
        _fds[fd] = (sim, rel, os.fstat(fd).st_ino)
    return fd


def _watched(fd: int) -> tuple[_Sim, str] | None:
    """The watched file behind ``fd``; a descriptor closed with ``os.close`` and its number
    reused for another file is told apart by its inode."""
    hit = _fds.get(fd)
    if hit is None:
        return None
    try:
        if os.fstat(fd).st_ino == hit[2]:
            return hit[0], hit[1]
    except OSError:
        pass
    _fds.pop(fd, None)
    return None


def close(fd: int) -> None:
    _fds.pop(fd, None)
    os.close(fd)


def set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; False where the file system refuses it (tmpfs
    before Linux 6.6, many FUSE file systems). The journal's segments and the row overlay's
    runs are written this way (memory_pool/journal.py, memory_pool/runfile.py)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return True


def mount_entry(path: str | os.PathLike) -> tuple[str, str, list[str]] | None:
    """``(mount point, file system type, options)`` of the mount ``path`` lies on (the longest
    prefix in /proc/mounts); None where that cannot be read."""
    path = os.path.realpath(path)
    best = None
    try:
        with builtins.open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                mnt = parts[1]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) >= len(best[0])):
                    best = (mnt, parts[2], parts[3].split(","))
    except OSError:
        return None
    return best


def _note_data(sim: _Sim, rel: str, ranges: np.ndarray, old: bytes | memoryview, old_size: int) -> None:
    sim.append({"op": "data", "path": rel, "n": int(len(ranges)), "size": int(old_size)},
               ranges.astype("<i8").tobytes() + bytes(old))
    sim.live_data[rel] = sim.live_data.get(rel, 0) + 1


def _note_size(sim: _Sim, rel: str, path_or_fd, new_size: int) -> None:
    st = os.fstat(path_or_fd) if isinstance(path_or_fd, int) else os.stat(path_or_fd)
    cut = b""
    if new_size < st.st_size:  # the bytes a shrink removes come back at a power loss
        cut = _pread(sim, rel, st.st_size - new_size, new_size)
    sim.append({"op": "size", "path": rel, "size": int(st.st_size), "new": int(new_size)}, cut)
    sim.live_data[rel] = sim.live_data.get(rel, 0) + 1


def _pread(sim: _Sim, rel: str, n: int, off: int) -> bytes:
    """Bytes of a watched file, through a descriptor of its own (``fd`` may be O_DIRECT, which
    refuses reads that are not block-aligned)."""
    rfd = _os_open(sim.root / rel, os.O_RDONLY)
    try:
        return os.pread(rfd, n, off)
    finally:
        os.close(rfd)


def pwrite(fd: int, buf, off: int) -> None:
    """``pwrite`` all of ``buf`` at ``off`` (a write may be short: a signal, a file size limit)."""
    buf = memoryview(buf).cast("B")
    hit = _watched(fd) if _fds else None
    if hit is not None:
        sim, rel = hit
        with sim.lock:
            size = os.fstat(fd).st_size
            old = _pread(sim, rel, max(0, min(len(buf), size - off)), off) if off < size else b""
            _note_data(sim, rel, np.array([[off, len(buf)]]), old, size)
    while buf:
        n = os.pwrite(fd, buf, off)
        buf, off = buf[n:], off + n


def note_rows(fd: int, ids, row_bytes: int, old) -> None:
    """Before rows ``ids`` of the file behind ``fd`` change through a shared mapping: ``old`` is
    their current bytes ([n, row_bytes] uint8, e.g. ``home.index_select(0, ids)``). See the
    module doc: a mapped store no system call sees is accounted for here."""
    hit = _watched(fd) if _fds else None
    if hit is None:
        return
    sim, rel = hit
    off = np.asarray(ids, dtype=np.int64) * row_bytes
    ranges = np.stack([off, np.full_like(off, row_bytes)], axis=1)
    with sim.lock:
        _note_data(sim, rel, ranges, np.ascontiguousarray(np.asarray(old)).data, os.fstat(fd).st_size)


def note_range(fd: int, off: int, old) -> None:
    """Before bytes ``[off, off + len(old))`` of a mapped file change: their current value."""
    hit = _watched(fd) if _fds else None
    if hit is None:
        return
    sim, rel = hit
    old = memoryview(old).cast("B")
    with sim.lock:
        _note_data(sim, rel, np.array([[off, len(old)]]), old, os.fstat(fd).st_size)


def needs_notes(fd: int) -> bool:
    """Whether stores into ``fd``'s mapping must be noted (the file is watched)."""
    return bool(_fds) and _watched(fd) is not None


def ftruncate(fd: int, size: int) -> None:
    hit = _watched(fd) if _fds else None
    if hit is not None:
        with hit[0].lock:
            _note_size(hit[0], hit[1], fd, size)
    os.ftruncate(fd, size)


def fallocate(fd: int, off: int, length: int) -> None:
    """``posix_fallocate`` (it may grow the file: the old size comes back at a power loss)."""
    hit = _watched(fd) if _fds else None
    if hit is not None and off + length > os.fstat(fd).st_size:
        with hit[0].lock:
            _note_size(hit[0], hit[1], fd, off + length)
    os.posix_fallocate(fd, off, length)


def _synced(fd: int) -> None:
    hit = _watched(fd)
    if hit is None:
        return
    sim, rel = hit
    with sim.lock:
        if sim.live_data.get(rel):
            # The data is durable (the sync returned) before the marker says so: a marker
            # ahead of its data would let a power loss keep writes that never reached the disk.
            sim.append({"op": "sync", "path": rel})
            sim.live_data[rel] = 0
            sim.sync_log()
            sim.maybe_rotate()


def _log_first(sim: _Sim | None) -> None:
    """Write-ahead for the layer's own log: before a real sync, which may make durable any
    operation done so far (a directory's fsync commits every name changed in it, a file's its
    data), the entries that undo them are made durable. Else a real power loss right after the
    sync kept, say, a rename whose entry was lost, and took back the creation of a file the
    renamed manifest names (the loop-device test saw a run missing that its manifest named)."""
    if sim is not None and sim.dirty_log:
        with sim.lock:
            sim.sync_log()


_libc_fns: dict = {}


def _libc(name: str, argtypes: tuple):
    """libc's function ``name`` through ctypes (``CDLL``: a call lets go of the GIL), looked up
    once; None where libc lacks it."""
    if name not in _libc_fns:
        import ctypes

        try:
            f = getattr(ctypes.CDLL(None, use_errno=True), name)
            f.argtypes = argtypes
            _libc_fns[name] = f
        except (OSError, AttributeError):
            _libc_fns[name] = None
    return _libc_fns[name]


def start_writeback(fd: int, off: int, length: int, *, wait: bool = False) -> None:
    """Ask the kernel to start writing a range's dirty pages to the device now
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``; ``posix_fadvise(DONTNEED)`` where libc lacks
    it, which starts the same write-back). A hint for throughput: it makes nothing durable and
    tells the emulated power loss nothing -- only a later ``fdatasync`` does. Used by a bulk
    load, so that the device writes the first pages while the next ones are produced, and the
    load's final sync waits for the tail only. ``wait``: also wait until those pages are written
    (``WAIT_BEFORE | WRITE | WAIT_AFTER``: clean, so that ``DONTNEED`` drops them at once)."""
    import ctypes

    f = _libc("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint))
    if f is not None and f(fd, off, length, 7 if wait else 2) == 0:  # (WRITE: 2)
        return
    try:
        os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass


MADV_POPULATE_WRITE = 23   # Linux >= 5.14 (not in Python's mmap module before 3.13)


def populate_write(view: np.ndarray, lo: int, hi: int) -> bool:
    """Fault in bytes ``[lo, hi)`` of a shared file mapping (``view``: its bytes, page-aligned
    ``lo``) for writing, with one call (``MADV_POPULATE_WRITE``), without holding the GIL:
    ``mmap.madvise`` holds it for the whole call (~3 ms for 8 MiB of tmpfs here), stopping every
    other Python thread. It only faults pages in (no byte changes); a file hole on a full file
    system is an error here, never a SIGBUS, but allocate first (:func:`fallocate`) to get
    ENOSPC. Returns False where it failed or the kernel lacks it (pages then fault in on first
    touch)."""
    import ctypes

    f = _libc("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    if f is None or hi <= lo:
        return False
    return f(view.ctypes.data + lo, hi - lo, MADV_POPULATE_WRITE) == 0


def fdatasync(fd: int) -> None:
    hit = _watched(fd) if _fds else None
    _log_first(hit[0] if hit else None)
    os.fdatasync(fd)
    if _fds:
        _synced(fd)


def fsync(fd: int) -> None:
    hit = _watched(fd) if _fds else None
    _log_first(hit[0] if hit else None)
    os.fsync(fd)
    if _fds:
        _synced(fd)


def fsync_dir(path) -> None:
    """fsync a directory: the names created, renamed or removed in it are durable."""
    hit = _sim_of(path) if _sims else None
    _log_first(hit[0] if hit else None)
    fd = _os_open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    hit = _sim_of(path) if _sims else None
    if hit is None:
        return
    sim, rel = hit
    rel = "" if rel == "." else rel
    with sim.lock:
        if any(rel in e["dirs"] for e in sim.live_names):
            sim.append({"op": "dirsync", "path": rel})
            keep = []
            for e in sim.live_names:
                e["dirs"].discard(rel)
                if e["dirs"]:
                    keep.append(e)
                elif e.get("grave"):
                    try:  # the removal is durable: the kept copy can go now
                        os.unlink(e["grave"])
                    except FileNotFoundError:
                        pass
            sim.live_names = keep
            sim.sync_log()
            sim.maybe_rotate()


def rename(src, dst) -> None:
    """``os.rename`` (replacing ``dst``); durable once both directories are."""
    hit = _sim_of(dst) if _sims else None
    if hit is None or _sim_of(src) is None:
        os.rename(src, dst)
        return
    sim, rdst = hit
    rsrc = sim.rel(src)
    with sim.lock:
        grave = None
        if os.path.exists(dst):
            grave = sim.grave()
            os.link(dst, grave)  # what dst was comes back at a power loss
        sim.append({"op": "rename", "src": rsrc, "dst": rdst, "grave": grave.name if grave else None})
        sim.live_names.append({"dirs": {os.path.dirname(rsrc), os.path.dirname(rdst)},
                               "grave": str(grave) if grave else None})
        os.rename(src, dst)
        for fd, (s, r, ino) in list(_fds.items()):  # open descriptors follow their file
            if s is sim and r == rsrc:
                _fds[fd] = (s, rdst, ino)
            elif s is sim and r == rdst:
                del _fds[fd]  # the file it was is gone from that name


def unlink(path, *, missing_ok: bool = False) -> None:
    hit = _sim_of(path) if _sims else None
    try:
        if hit is None:
            os.unlink(path)
            return
        sim, rel = hit
        with sim.lock:
            grave = sim.grave()
            os.link(path, grave)  # kept aside until the directory is synced
            sim.append({"op": "unlink", "path": rel, "grave": grave.name})
            sim.live_names.append({"dirs": {os.path.dirname(rel)}, "grave": str(grave)})
            os.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise
