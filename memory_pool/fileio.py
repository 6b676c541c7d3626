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
Entries need no sync: one lost is an unsynced operation that happened to reach the disk, a state
a power loss may leave anyway. The log is deleted (a new generation begun) whenever every entry
in it is cancelled, so it holds only the unsynced work of the moment.
"""

from __future__ import annotations

import json
import os
import random
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["open", "pwrite", "ftruncate", "fallocate", "fdatasync", "fsync", "fsync_dir", "rename", "unlink",
           "note_rows", "note_range", "watch", "unwatch", "watching", "power_on", "pending", "unsynced_count", "LOG_DIR",
           "ENV", "Lose", "PowerOnReport"]

LOG_DIR = ".power-loss"
ENV = "DLRM_CXL_POWER_LOSS"   # "1": emulated pmem loses what was not synced too (the crash tests)
_MAGIC = b"PLG1"
_HEAD = struct.Struct("<4sIQI")   # magic, crc32 of the rest, blob bytes, json bytes

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
        j = json.dumps(doc, separators=(",", ":")).encode()
        body = j + bytes(blob)
        head = _HEAD.pack(_MAGIC, zlib.crc32(body), len(body) - len(j), len(j))
        os.write(self._log_fd(), head + body)
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


def _note_data(sim: _Sim, rel: str, fd: int, ranges: np.ndarray, old: bytes | memoryview, old_size: int) -> None:
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
            _note_data(sim, rel, fd, np.array([[off, len(buf)]]), old, size)
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
        _note_data(sim, rel, fd, ranges, np.ascontiguousarray(np.asarray(old)).data, os.fstat(fd).st_size)


def note_range(fd: int, off: int, old) -> None:
    """Before bytes ``[off, off + len(old))`` of a mapped file change: their current value."""
    hit = _watched(fd) if _fds else None
    if hit is None:
        return
    sim, rel = hit
    old = memoryview(old).cast("B")
    with sim.lock:
        _note_data(sim, rel, fd, np.array([[off, len(old)]]), old, os.fstat(fd).st_size)


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


def fdatasync(fd: int) -> None:
    os.fdatasync(fd)
    if _fds:
        _synced(fd)


def fsync(fd: int) -> None:
    os.fsync(fd)
    if _fds:
        _synced(fd)


def fsync_dir(path) -> None:
    """fsync a directory: the names created, renamed or removed in it are durable."""
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


def pending(root) -> bool:
    """Whether ``root`` holds an undo log (a process that watched it ended without syncing all)."""
    d = Path(root) / LOG_DIR
    return d.is_dir() and any(d.iterdir())


# --------------------------------------------------------------------------- power on
@dataclass
class Lose:
    """Which of the unsynced operations a power loss takes back (:func:`power_on`).

    ``mode``: ``"all"`` (nothing unsynced reached the disk), ``"prefix"`` (the first ``keep``
    unsynced operations did, in the order they were made, the rest did not), ``"subset"`` (each
    did or did not, drawn with ``seed``; a write may be torn: some of its ``block``-sized blocks
    reached the disk, others not)."""

    mode: str = "all"
    keep: int = 0
    seed: int = 0
    block: int = 4096


@dataclass
class PowerOnReport:
    entries: int = 0        # unsynced operations found
    undone: int = 0         # taken back
    torn: int = 0           # writes taken back in part
    logs: list = field(default_factory=list)


def _read_log(path: Path) -> list[tuple[dict, bytes]]:
    raw = path.read_bytes()
    out, at = [], 0
    while at + _HEAD.size <= len(raw):
        magic, crc, nblob, nj = _HEAD.unpack_from(raw, at)
        end = at + _HEAD.size + nj + nblob
        if magic != _MAGIC or end > len(raw) or zlib.crc32(raw[at + _HEAD.size:end]) != crc:
            break  # a torn last entry (a real power loss): the operation after it never ran
        doc = json.loads(raw[at + _HEAD.size:at + _HEAD.size + nj])
        out.append((doc, raw[at + _HEAD.size + nj:end]))
        at = end
    return out


def _unsynced(entries: list[tuple[dict, bytes]]) -> list[tuple[dict, bytes]]:
    """The entries no later marker cancels, in log order. A data entry of a file that a durable
    rename then moved names the file's new name (an undone rename is :func:`power_on`'s)."""
    alive: list[list] = []
    for doc, blob in entries:
        op = doc["op"]
        if op == "sync":
            for a in alive:
                if a[0]["op"] in ("data", "size") and a[2] == doc["path"]:
                    a[3] = False
        elif op == "dirsync":
            for a in alive:
                if a[0]["op"] in ("create", "rename", "unlink"):
                    a[4].discard(doc["path"])
                    if not a[4]:
                        a[3] = False
        else:
            path = doc.get("path", doc.get("dst"))
            dirs = {os.path.dirname(doc["src"]), os.path.dirname(doc["dst"])} if op == "rename" else \
                {os.path.dirname(path)}
            # A rename moves the data entries of its source to its destination's name (a
            # later sync of the new name cancels them).
            if op == "rename":
                for a in alive:
                    if a[0]["op"] in ("data", "size") and a[2] == doc["src"]:
                        a[2] = doc["dst"]
            alive.append([doc, blob, path, True, dirs])
    out = []
    for i, a in enumerate(alive):
        if not a[3]:
            continue
        if a[0]["op"] in ("data", "size"):
            # Where the file is after the power loss: renames after it that are durable moved it.
            p = a[0]["path"]
            for r in alive[i + 1:]:
                if r[0]["op"] == "rename" and not r[3] and r[0]["src"] == p:
                    p = r[0]["dst"]
            if p != a[0]["path"]:
                a[0] = {**a[0], "path": p}
        out.append((a[0], a[1]))
    return out


def unsynced_count(root) -> int:
    """How many operations under ``root`` a power loss now would take back (the crash-state
    checker spreads its prefixes over them)."""
    d = Path(root) / LOG_DIR
    return sum(len(_unsynced(_read_log(p))) for p in sorted(d.glob("undo-*.log"))) if d.is_dir() else 0


def power_on(root, lose: Lose | None = None) -> PowerOnReport:
    """Apply the power loss that the undo logs under ``root`` describe (see the module doc), then
    remove the logs. Call with the pool's writer lock held and before anything reads the pool.
    Idempotent: the logs go last (a crash during it leaves them, and a later call undoes the
    same entries again, to the same bytes)."""
    root = Path(os.path.abspath(root))
    lose = lose or Lose()
    rep = PowerOnReport()
    d = root / LOG_DIR
    if not d.is_dir():
        return rep
    logs = sorted(d.glob("undo-*.log"))
    rep.logs = [p.name for p in logs]
    todo: list[tuple[dict, bytes]] = []
    for p in logs:
        todo += _unsynced(_read_log(p))
    rep.entries = len(todo)
    rng = random.Random(lose.seed)
    if lose.mode == "all":
        lost = [True] * len(todo)
    elif lose.mode == "prefix":
        lost = [i >= lose.keep for i in range(len(todo))]
    elif lose.mode == "subset":
        lost = [rng.random() < 0.5 for _ in todo]
    else:
        raise ValueError(f"Lose.mode must be all, prefix or subset, got {lose.mode!r}")
    moved: dict[str, str] = {}   # renames that stay (later than the entry being undone)
    extent: dict[str, int] = {}  # the size that kept writes (later ones) need

    def where(rel: str) -> str:
        seen = 0
        while rel in moved and seen < 64:
            rel, seen = moved[rel], seen + 1
        return rel

    for (doc, blob), gone in reversed(list(zip(todo, lost))):
        op = doc["op"]
        if op in ("data", "size"):
            path = root / where(doc["path"])
            if not gone:
                if op == "data":
                    n = doc["n"]
                    r = np.frombuffer(blob[:16 * n], dtype="<i8").reshape(n, 2)
                    extent[str(path)] = max(extent.get(str(path), 0), int((r[:, 0] + r[:, 1]).max()) if n else 0)
                continue
            if not path.exists():
                continue
            rep.undone += 1
            fd = _os_open(path, os.O_RDWR)
            try:
                need = extent.get(str(path), 0)
                if op == "size":
                    if doc["new"] < doc["size"]:  # a shrink: the cut bytes come back
                        os.ftruncate(fd, max(doc["size"], need))
                        os.pwrite(fd, blob, doc["new"])
                    else:
                        os.ftruncate(fd, max(doc["size"], need))
                    continue
                n = doc["n"]
                r = np.frombuffer(blob[:16 * n], dtype="<i8").reshape(n, 2)
                old = memoryview(blob)[16 * n:]
                tear = lose.mode == "subset" and rng.random() < 0.5
                at = 0
                for off, ln in r.tolist():
                    have = max(0, min(ln, doc["size"] - off))  # bytes that existed before the write
                    piece = bytes(old[at:at + have])
                    at += have
                    if tear:  # some blocks of this write reached the disk, the others did not
                        rep.torn += 1
                        b = lose.block
                        for lo in range(off - off % b, off + ln, b):
                            if rng.random() < 0.5:
                                a, z = max(lo, off), min(lo + b, off + ln)
                                chunk = piece[a - off:z - off]
                                os.pwrite(fd, chunk + bytes(z - a - len(chunk)), a)
                    else:
                        os.pwrite(fd, piece + bytes(ln - have), off)
                if not tear:
                    os.ftruncate(fd, max(doc["size"], need))
            finally:
                os.close(fd)
        elif op == "create":
            path = root / doc["path"]
            if gone and where(doc["path"]) == doc["path"] and path.exists():
                rep.undone += 1
                path.unlink()
        elif op == "rename":
            if not gone:
                moved[doc["src"]] = doc["dst"]
                continue
            rep.undone += 1
            src, dst = root / doc["src"], root / doc["dst"]
            if dst.exists():
                os.rename(dst, src)
            if doc.get("grave") and (d / doc["grave"]).exists():
                os.rename(d / doc["grave"], dst)
        elif op == "unlink":
            g = d / doc["grave"]
            if gone and g.exists():
                rep.undone += 1
                os.rename(g, root / doc["path"])
    # What was undone is made durable before the logs go (a crash in between undoes it again).
    for dirpath, _, files in os.walk(root):
        if LOG_DIR in Path(dirpath).parts:
            continue
        for f in files:
            try:
                fd = _os_open(os.path.join(dirpath, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = _os_open(dirpath, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for p in sorted(d.iterdir()):
        p.unlink()
    d.rmdir()
    fd = _os_open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return rep
