"""The persistence journal: a sequential, checksummed record log with group commit.

Real persistent memory persists bytes (cache lines), not pages. An emulation that persists a
256-byte row by ``msync``-ing its 4 KiB page is 16x off and makes every number it produces
mislead. The journal gives emulated persistence the right cost model: persisting N bytes appends
N bytes (plus a 40-byte header) to a sequential file, and one ``fdatasync`` makes a whole group
of records durable (group commit). A compactor later writes the rows back into the table image
files, sorted and coalesced, and drops the segments it has absorbed.

Layout of ``<dir>/``::

    seg-<first seq, 16 hex digits>.log   segments, appended to; a new one is started after a
                                         transaction end once the current one is large
    START                                first live sequence number (written before segments are
                                         dropped, so a missing *first* segment is detected too)
    free-<hex>.log                       reclaimed segments kept for reuse (never read)
    COMMITTED                            the committed mark: a transaction known durable

Segment: a 64-byte header (magic ``DCXJSEG1``, version, first seq, flags, crc32c), then records.

Recycling (after PostgreSQL's WAL segments). A reclaimed segment is not deleted but renamed to
``free-*`` and later reused as a new segment: its new header is written and made durable *first*,
then it is renamed to its ``seg-`` name (a crash in between leaves a ``free-`` file, which is
ignored). Appends then overwrite pages that already exist: on tmpfs no page is allocated and
freed per step (on this VM a fresh page costs 4-8x an overwritten one), on a disk no block is
allocated and ``fdatasync`` has no file-size metadata to commit. The bytes after the valid
records of a recycled segment are records of its previous life: every one has a sequence number
below the segment's first, so the scan stops at them exactly as at the end of a fresh segment;
they are stale, not torn (the ``RECYCLED`` flag in the header says so), and are never read.
Record: a 40-byte header (magic ``DCXR``, type, seq, tag, payload length, crc32c of the payload,
crc32c of the header) and the payload. Sequence numbers increase by one across segments, so a
deleted or missing segment is a gap that the scan reports as damage, never skips.

Transactions. Records between two ``END`` records form a transaction; ``END`` carries a tag (the
training step) and a small JSON document. :meth:`Journal.end` is the commit, after SQLite's
atomic-commit rule: the transaction's records are made durable *first* (``fdatasync``), then the
``END`` record is appended and made durable. Hence:

* every record before a valid ``END`` was durable before that ``END`` existed: a record before
  the newest valid ``END`` that fails its checksum is **damage** (bit rot, a foreign write), and
  opening refuses (:class:`JournalCorruptError`, exit 4) — nothing is changed;
* records after the newest ``END`` belong to an unfinished transaction. They may be torn in any
  order (pages reach the disk in any order before a sync): the **torn tail** is ignored and, by a
  writer, truncated away before anything new is appended.

Who uses which record types: the pool appends ``ROWS`` (after-images of rows: what persisting
them means on a journaled tier) and replays the ``ROWS`` of complete transactions when it opens;
the checkpointer adds ``UNDO`` (before-images) and ``DENSE`` (the dense state) records and ends
each step's transaction with its commit document. ``ROWS`` and ``UNDO`` share one payload layout
(a row set, :mod:`memory_pool.records`).

Mapped segments (``mapped=True``: a journal in RAM, on tmpfs, the shm tier). ``pwrite`` into
tmpfs costs a kernel copy and a page-cache lookup per page (1.8 ms for 8 MB over a 64 MiB segment
here, against 0.65 ms for a copy into a mapping already faulted in); a mapped journal copies
records into a shared mapping of the segment instead. Its segments are sized up front and carry
the ``RECYCLED`` flag: the bytes after the valid records are not the log's (zeros or a previous
life), exactly as in a recycled segment. Pages are allocated (``posix_fallocate``: a full tmpfs
is ``PoolFullError``, never a SIGBUS in the middle of a copy) and faulted in 8 MiB ahead of the
appends, and a mapping is kept for the file's next lives. A process crash keeps every store made
before it, in program order: the header is copied after the payload, so a crash mid-record
leaves a torn or stale tail, as a short ``pwrite`` would.

Direct writes (``direct=True``: a journal on a disk, the emulated pmem and power-sim tiers). A
buffered ``pwrite`` of 8 MB into the page cache costs ~4 ms of kernel CPU on this VM (a page
dirtied, accounted and later written back, per 4 KiB), whether the pages are new or recycled;
with ``O_DIRECT`` the same write costs ~1 ms and the device does the rest while the trainer
computes. Records are built in a page-aligned buffer (payloads are copied, or filled in place:
:class:`Fill`, e.g. the dense state straight from the parameters) and written with one call per
append, whole blocks (``BLOCK``) at a time: the last partial block is written again, unchanged
in its first bytes, by the next append (a torn rewrite of identical bytes leaves them as they
were), and the bytes after the records up to the block's end are zeros. So the segment carries
the ``RECYCLED`` flag, and a segment written without direct writes (an older writer) is sealed,
never padded: appends go to a new one. ``fdatasync`` still follows every group commit (the
device's volatile cache, and the file's size). The journal's pages are then not in the page
cache: replay and compaction read them from the disk (measured: cheap in CPU, read ahead in
large blocks). A file system that refuses ``O_DIRECT`` is written through the page cache.

Committed mark (``COMMITTED``: the sequence number and tag of an ``END`` that was durable, crc32c).
A power loss cannot remove bytes that an ``fdatasync`` made durable; a journal that ends before a
commit it once had was cut (truncated, a segment deleted), and scanning it as a torn tail would
silently go back many committed steps. Inside the journal nothing can tell: a transaction cut off
at the end looks exactly like one a crash tore before its ``END``. So the writer rewrites this
small file in place after an ``END`` is durable, every ``MARK_EVERY`` bytes of appends, and the
scan refuses a journal whose newest ``END`` is older than the mark (damage, exit 4, nothing
changed), naming the committed steps that are missing (at least that many: the mark trails the
newest commit by less than ``MARK_EVERY``). Rules, and why each is sound:

* written only after its ``END``'s ``fdatasync`` returned: it never names more than is durable;
* never synced itself (one small buffered write a MiB of journal, not one ``fsync`` a commit): a
  power loss may keep an older mark, which vouches for less -- still true;
* moved every ``MARK_EVERY`` bytes, not at every ``END``: a small step's commit costs no extra
  write (nor, under the emulated power loss of :mod:`memory_pool.fileio`, an undo entry). The
  price: a cut that removes only commits made after the mark reads as a torn tail, as before;
  a cut of more than the last ``MARK_EVERY`` bytes of commits is caught (unless a power loss
  also took the newest mark from the page cache: then an older one, or none, is checked);
* read before ``START`` and the segments: a reader beside a live writer sees at least what the
  mark it read names (the ``END`` was written before the mark), so it never reports a commit
  made after it looked;
* ignored below ``START``: a compaction dropped those records on purpose;
* ignored when torn or damaged (its crc32c): a mark vouches for nothing then, and the scan
  checks what it always did;
* format: a file that an older dlrm-cxl neither reads nor writes; appends of an older writer
  only leave the mark behind, never ahead. The segments are unchanged, so no version bump.

The other high-water marks are checked by the scan already: a sealed segment is followed by a
segment whose first sequence number must follow its last record (a cut or deleted segment that
is not the last is a gap: damage), and ``START`` names the first segment, which must exist.

Thread safety: one writer thread appends and ends transactions; :meth:`Journal.reclaim` (the
compactor) may run on another thread; both take the journal's lock around segment-list changes.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import fcntl
import json
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from .arena import Arena, page_round
from . import fileio
from .durable import atomic_write, fsync_dir, pwrite_all, raise_if_full
from .records import (Fill, crc32c, crc32c_extend, decode_row_set, decode_rows, encode_row_set,  # noqa: F401
                      encode_rows, part_bytes)
from .errors import NeedsRecoveryError, PoolCorruptError, PoolReadOnlyError

__all__ = ["Journal", "RecordType", "RecordRef", "TxnInfo", "JournalCorruptError", "Fill", "encode_rows",
           "encode_row_set", "decode_rows", "decode_row_set", "crc32c"]

SEG_MAGIC = b"DCXJSEG1"
SEG = struct.Struct("<8sIQI36xI")         # magic, version, first seq, flags, pad, crc32c (64 bytes)
SEG_RECYCLED = 1                          # flags: the bytes after the valid records are stale
                                          # (a recycled segment, or a mapped one sized up front)
KEEP_FREE = 16                            # reclaimed segments kept for reuse (16 x (64 + 32) MiB at most)
MAP_CHUNK = 8 << 20                       # mapped segments: allocated and faulted in this much at a time
MAP_SLACK = 32 << 20                      # mapped segments are sized this much past segment_bytes: the
                                          # transaction that crosses it fits without a new mapping
MADV_POPULATE_WRITE = 23                  # Linux >= 5.14 (not in Python's mmap module before 3.13)
BLOCK = 4096                              # direct writes: offsets, lengths and buffers aligned to this
REC_MAGIC = b"DCXR"
REC = struct.Struct("<4sB3xQqQII")        # magic, type, seq, tag, length, payload crc, header crc (40)
VERSION = 1
MARK = "COMMITTED"                        # the committed mark (see "Committed mark" above)
MARK_MAGIC = b"DCXJMRK1"
MARK_REC = struct.Struct("<8sQqI")        # magic, seq of a durable END, its tag, crc32c (28 bytes)
MARK_EVERY = 1 << 20                      # the mark moves after this many bytes of appends


class RecordType(enum.IntEnum):
    ROWS = 1    # after-images of rows (the pool's persist on a journaled tier)
    END = 2     # transaction end: tag + JSON document
    UNDO = 3    # before-images of rows (the checkpointer's undo log)
    DENSE = 4   # the dense state of a step (the checkpointer's recovery point)
    LOGGED = 5  # a step's undo records are durable; its rows may change from here on (checkpointing.undo)


class JournalCorruptError(PoolCorruptError):
    """A journal record or segment before the newest transaction end is damaged or missing."""

    exit_code = 4
    default_hint = "the pool's journal is damaged; restore the pool from a copy (nothing was changed)"


@dataclass(frozen=True)
class RecordRef:
    """Where a record lives; read its payload with :meth:`Journal.read`."""

    segment: Path
    offset: int          # of the record header
    type: int
    seq: int
    tag: int
    length: int
    crc: int

    @property
    def payload_offset(self) -> int:
        return self.offset + REC.size


@dataclass
class TxnInfo:
    """A complete transaction: its records and its END record's tag and document."""

    tag: int
    doc: dict
    records: list[RecordRef]
    end: RecordRef

    @property
    def first_seq(self) -> int:
        return self.records[0].seq if self.records else self.end.seq


@dataclass
class _Mapping:
    """A kept shared mapping of a mapped segment; its first ``ready`` bytes are allocated (a
    store there is never a SIGBUS on a full tmpfs) and faulted in, but for the part a smaller,
    earlier mapping of the file had prepared (faulted in again only if stored to)."""

    mm: mmap.mmap
    view: np.ndarray      # the mapping's bytes (numpy: copies into it release the GIL)
    ready: int = 0


@dataclass
class _Segment:
    path: Path
    first_seq: int
    size: int = 0
    last_seq: int = -1     # of its last valid record (-1: none)
    stale_after: bool = False   # RECYCLED flag: bytes after the valid records are not the log's


def _seg_name(first_seq: int) -> str:
    return f"seg-{first_seq:016x}.log"


def _seg_header(first_seq: int, flags: int = 0) -> bytes:
    body = SEG.pack(SEG_MAGIC, VERSION, first_seq, flags, 0)[:-4]
    return body + struct.pack("<I", crc32c_extend(0, body))


def _rec_header(rtype: int, seq: int, tag: int, length: int, pcrc: int) -> bytes:
    body = REC.pack(REC_MAGIC, rtype, seq, tag, length, pcrc, 0)[:-4]
    return body + struct.pack("<I", crc32c_extend(0, body))


def _parse_header(raw: bytes):
    """(type, seq, tag, length, payload crc) or None when it is not a valid record header."""
    if len(raw) < REC.size or raw[:4] != REC_MAGIC:
        return None
    magic, rtype, seq, tag, length, pcrc, hcrc = REC.unpack_from(raw)
    if crc32c_extend(0, bytes(raw[:REC.size - 4])) != hcrc:
        return None
    return rtype, seq, tag, length, pcrc


# --------------------------------------------------------------------------- the journal


class Journal:
    """See the module docstring. Open with ``Journal(dir, sync=..., mapped=..., direct=..., read_only=...)``:
    the constructor scans (and verifies the structure of) everything already there."""

    def __init__(self, directory: Path, *, sync: bool = True, segment_bytes: int = 64 << 20,
                 read_only: bool = False, mapped: bool = False, direct: bool = False):
        self.dir = Path(directory)
        self.sync = sync
        self.mapped = mapped and not read_only
        # Direct: appends bypass the page cache (see "Direct writes"); off where the file
        # system refuses O_DIRECT (then written through the page cache, as without it).
        self.direct = direct and not self.mapped and not read_only
        self._staging: tuple[mmap.mmap, np.ndarray] | None = None  # direct: the aligned write buffer
        self._tail_block = b""     # direct: the bytes of the last, partial block written
        self._map: _Mapping | None = None     # mapped: the segment being appended to
        # Mapped: mappings by inode, kept across a segment's lives (a recycled segment is the
        # same file): faulting a page in costs more than copying 4 KiB into it.
        self._maps: dict[int, _Mapping] = {}
        self.segment_bytes = segment_bytes
        self.read_only = read_only
        self._lock = threading.RLock()
        self._fd: int | None = None
        self.bytes_appended = 0       # payload + headers appended by this process
        self._mark_fd: int | None = None   # the committed mark (COMMITTED), opened at its first write
        self._marked_at = 0           # bytes_appended when the mark was last moved
        self.syncs = 0
        self.recycled = 0             # segments started by reusing a reclaimed one
        if not read_only:
            self.dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(5 if read_only else 1):
            try:
                self._scan()
                break
            except (JournalCorruptError, FileNotFoundError):
                # A reader beside a live writer (inspect --no-digest) may scan the journal in
                # motion: a record whose header is not written yet while later records and an
                # END already are, or START moved and segments renamed by a compaction between
                # listing and reading them. That is gone when it looks again; damage stays.
                if attempt == 4 or not read_only:
                    raise
                time.sleep(0.02 * (attempt + 1))

    # -- scanning
    def _start_seq(self) -> int:
        try:
            return int((self.dir / "START").read_text().strip() or 0)
        except FileNotFoundError:
            return 0
        except ValueError:
            raise JournalCorruptError(f"{self.dir / 'START'} is damaged") from None

    def _scan(self) -> None:
        segs: list[_Segment] = []
        self._stray: Path | None = None   # an empty last segment, removed by the first append
        mark = self._read_mark()   # (before START and the segments: see "Committed mark")
        start = self._start_seq()
        paths = sorted(self.dir.glob("seg-*.log")) if self.dir.is_dir() else []
        for p in paths:
            try:
                first = int(p.stem[4:], 16)
            except ValueError:
                continue
            if first < start:
                # Absorbed by a compaction that was interrupted after START was written: dead.
                if not self.read_only:
                    fileio.unlink(p)
                continue
            segs.append(_Segment(p, first, p.stat().st_size))
        self._free = sorted(self.dir.glob("free-*.log")) if self.dir.is_dir() else []
        self.txns: list[TxnInfo] = []
        self.tail: list[RecordRef] = []       # valid records after the newest END
        self.tail_damage: str | None = None   # a bad record in the tail with valid records after it
        # The valid records after the tail's first bad one: whether that one is torn or damaged
        # is for the tail's writer to say (the checkpointer's logged mark, checkpointing.recovery).
        self.tail_beyond: list[RecordRef] = []
        self.torn_bytes = 0                   # bytes of the torn tail (ignored)
        expect = start
        if segs and segs[0].first_seq != start:
            raise JournalCorruptError(f"journal {self.dir}: segment with sequence {start} is missing "
                                      f"(first is {segs[0].path.name})")
        pending: list[RecordRef] = []
        bad: tuple[_Segment, int, str] | None = None
        recycled = False
        for i, seg in enumerate(segs):
            if seg.first_seq != expect:
                raise JournalCorruptError(f"journal {self.dir}: records {expect}..{seg.first_seq - 1} are missing "
                                          f"(a segment before {seg.path.name} was deleted)")
            with open(seg.path, "rb") as f:
                # Only the record headers are read here: no read-ahead of the payloads around
                # them (after a crash a direct-written journal is not cached: read-ahead would
                # read all of it from the disk, dense states included, to find ~40 bytes a record).
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                head = f.read(SEG.size)
                ok = len(head) == SEG.size and head[:8] == SEG_MAGIC and \
                    crc32c_extend(0, head[:-4]) == struct.unpack_from("<I", head, SEG.size - 4)[0] and \
                    SEG.unpack(head)[2] == seg.first_seq
                if not ok:
                    if i == len(segs) - 1 and not pending and seg.size == 0:
                        # Created, killed before its header was written: it holds nothing, not
                        # even a torn byte. Left as it is until the first append removes it (an
                        # open that then refuses the pool changes nothing).
                        segs.pop()
                        self._stray = seg.path
                        break
                    if i == len(segs) - 1 and ((not pending and seg.size <= SEG.size) or not any(head)):
                        # Created, header not yet durable: torn, not damage. A header that reads
                        # as zeros never reached the disk (a power loss that kept some later
                        # blocks of the file, not its first); no END after it was ever durable,
                        # since a segment's header is written before its records and every sync
                        # of the file covers it (a recycled one's is synced before its rename).
                        # A header with a flipped bit is damage.
                        bad = (seg, 0, "segment header torn")
                        break
                    raise JournalCorruptError(f"journal segment {seg.path.name}: header damaged")
                recycled = seg.stale_after = bool(SEG.unpack(head)[3] & SEG_RECYCLED)
                off = SEG.size
                while off < seg.size:
                    f.seek(off)
                    h = _parse_header(f.read(REC.size))
                    if h is None or h[1] != expect or off + REC.size + h[3] > seg.size:
                        bad = (seg, off, "bad header" if h is None or h[1] != expect else "truncated")
                        break
                    rtype, seq, tag, length, pcrc = h
                    ref = RecordRef(seg.path, off, rtype, seq, tag, length, pcrc)
                    if rtype == RecordType.END:
                        payload = f.read(length)
                        if crc32c_extend(0, payload) != pcrc:
                            bad = (seg, off, "END fails its checksum")
                            break
                        self.txns.append(TxnInfo(tag, json.loads(payload), pending, ref))
                        pending = []
                    else:
                        pending.append(ref)
                    seg.last_seq = seq
                    expect = seq + 1
                    off += REC.size + length
                seg.size = off if bad is None or bad[0] is not seg else bad[1]
            if bad is not None and recycled and bad[2] == "bad header" and i != len(segs) - 1:
                # A sealed recycled segment ends where its stale bytes begin; whether records
                # are missing shows at the next segment, whose first sequence must follow on.
                bad = None
                continue
            if bad is not None:
                if i != len(segs) - 1:
                    # A new segment is started only after an END: damage before a durable END.
                    raise JournalCorruptError(f"journal segment {bad[0].path.name} at byte {bad[1]}: {bad[2]} "
                                              f"(later segments exist)")
                break
        if bad is not None:
            seg, off, why = bad
            later = self._valid_after(seg, off, expect)
            if any(r.type == RecordType.END for r in later):
                raise JournalCorruptError(f"journal segment {seg.path.name} at byte {off}: {why}, before a durable "
                                          f"transaction end (record {later[-1].seq})")
            if later:
                self.tail_damage = (f"journal segment {seg.path.name} at byte {off}: {why}, with "
                                    f"{len(later)} valid records after it")
            self.tail_beyond = later
            # A recycled segment's bytes after its valid records are its previous life (stale,
            # never read, overwritten by the next append), not a torn write.
            self.torn_bytes = 0 if recycled and why == "bad header" else seg.path.stat().st_size - off
        # Tail records were not vouched for by an END: check their payloads now; the first bad
        # one ends the valid tail.
        for k, ref in enumerate(pending):
            if crc32c([self._pread(ref)]) != ref.crc:
                if k + 1 < len(pending):
                    self.tail_damage = f"journal record {ref.seq} fails its checksum, with valid records after it"
                self.tail_beyond = [r for r in pending[k + 1:] if crc32c([self._pread(r)]) == r.crc] + self.tail_beyond
                pending = pending[:k]
                seg = next(s for s in segs if s.path == ref.segment)
                self.torn_bytes += seg.size - ref.offset
                seg.size = ref.offset
                break
        newest = self.txns[-1].end.seq if self.txns else start - 1
        if mark is not None and start <= mark[0] and newest < mark[0]:
            raise JournalCorruptError(self._lost_commits(mark, newest))
        self.tail = pending
        self._segs = segs
        self.next_seq = expect if not pending else pending[-1].seq + 1
        self._tail_clean = not self.tail and self.torn_bytes == 0

    def _read_mark(self) -> tuple[int, int] | None:
        """The committed mark's (END seq, tag), or None: no mark, or a torn or damaged one."""
        try:
            raw = (self.dir / MARK).read_bytes()
        except OSError:
            return None
        if len(raw) != MARK_REC.size:
            return None
        magic, seq, tag, crc = MARK_REC.unpack(raw)
        if magic != MARK_MAGIC or crc32c_extend(0, raw[:-4]) != crc:
            return None
        return seq, tag

    def _lost_commits(self, mark: tuple[int, int], newest: int) -> str:
        seq, tag = mark
        msg = (f"journal {self.dir}: the transaction ending at record {seq}{f' (step {tag})' if tag >= 0 else ''} "
               f"was committed and durable ({MARK}), but the journal now ends at record {newest}")
        steps = [t.tag for t in self.txns if t.tag >= 0]
        if tag >= 0 and (not steps or max(steps) < tag):
            lo = max(steps) + 1 if steps else 0
            msg += f": at least {tag - lo + 1} committed steps ({lo}..{tag}) are missing"
        return msg + (" -- it was truncated or a segment deleted, which a power loss cannot do (what an fdatasync "
                      "made durable stays)")

    def _valid_after(self, seg: _Segment, off: int, after_seq: int) -> list[RecordRef]:
        """Valid record headers after a bad spot (searching for the record magic), up to the
        first record of an earlier life of the file: a recycled segment was written from its
        header on, so whatever of this life lies after the bad spot comes before the stale
        bytes (and a fresh segment has none). Reads no further than that."""
        out: list[RecordRef] = []
        with open(seg.path, "rb") as f:
            if os.fstat(f.fileno()).st_size <= off:
                return out
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                pos = data.find(REC_MAGIC, off + 1)
                while pos >= 0:
                    h = _parse_header(data[pos:pos + REC.size])
                    if h is not None and h[1] < seg.first_seq:
                        break  # the previous life of a recycled segment begins here
                    if h is not None and h[1] >= after_seq and pos + REC.size + h[3] <= len(data):
                        if crc32c_extend(0, data[pos + REC.size:pos + REC.size + h[3]]) == h[4]:
                            out.append(RecordRef(seg.path, pos, h[0], h[1], h[2], h[3], h[4]))
                    pos = data.find(REC_MAGIC, pos + 1)
        return out

    # -- reading
    def _pread(self, ref: RecordRef) -> bytearray:
        buf = bytearray(ref.length)
        fd = os.open(ref.segment, os.O_RDONLY)
        try:
            got = os.preadv(fd, [buf], ref.payload_offset)
        finally:
            os.close(fd)
        if got != ref.length:
            raise JournalCorruptError(f"journal record {ref.seq} in {ref.segment.name} is truncated")
        return buf

    def read(self, ref: RecordRef) -> bytearray:
        """The payload of ``ref``, verified against its checksum."""
        buf = self._pread(ref)
        if crc32c([buf]) != ref.crc:
            raise JournalCorruptError(f"journal record {ref.seq} ({RecordType(ref.type).name}) in "
                                      f"{ref.segment.name} fails its checksum (bit flip or foreign write)")
        return buf

    def read_many(self, refs: Sequence[RecordRef], *, window: Arena | None = None):
        """Yield ``(ref, payload)`` for ``refs`` (in order), verified; each segment is mapped once
        (replay and compaction read thousands of records: no open/read per record). Payloads
        are views of the mapping: use them before the next one is yielded... or copy.

        ``window``: map the segments side by side into this reserved range instead (capacity:
        :func:`window_bytes` of ``refs``), so that every payload lies in one address range and
        one tensor over it reaches them all (on-demand replay gathers rows from many records
        with one ``index_select``). The mappings live as long as the window."""
        maps: dict[Path, mmap.mmap | memoryview] = {}
        _prefetch(refs)
        try:
            for ref in refs:
                m = maps.get(ref.segment)
                if m is None:
                    if window is not None:
                        m = maps[ref.segment] = _map_into(window, ref.segment)
                    else:
                        with open(ref.segment, "rb") as f:
                            m = maps[ref.segment] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                end = ref.payload_offset + ref.length
                if end > len(m):
                    raise JournalCorruptError(f"journal record {ref.seq} in {ref.segment.name} is truncated")
                view = memoryview(m)[ref.payload_offset:end]
                try:
                    if crc32c_extend(0, view) != ref.crc:
                        raise JournalCorruptError(
                            f"journal record {ref.seq} ({RecordType(ref.type).name}) in {ref.segment.name} fails "
                            f"its checksum (bit flip or foreign write)")
                    yield ref, view
                finally:
                    view.release()
        finally:
            for m in maps.values():
                try:
                    m.close() if isinstance(m, mmap.mmap) else m.release()
                except BufferError:
                    pass  # a caller still holds a view; the mapping goes with it

    @property
    def last(self) -> TxnInfo | None:
        return self.txns[-1] if self.txns else None

    @property
    def live_bytes(self) -> int:
        return sum(s.size for s in self._segs)

    # -- writing
    def truncate_tail(self) -> int:
        """Remove everything after the newest END, durably. Returns the bytes removed. A writer
        must do this (after using the tail, e.g. rolling back its UNDO records) before it
        appends: otherwise the next END would seal records of an abandoned step."""
        if self.read_only:
            raise PoolReadOnlyError(f"journal {self.dir} was opened read-only")
        removed = 0
        with self._lock:
            self._close_fd()
            self._drop_mapping()
            last = self.last
            keep: list[_Segment] = []
            for s in self._segs:
                if last is not None and s.path == last.end.segment:
                    end = last.end.payload_offset + last.end.length
                    size = s.path.stat().st_size
                    if size != end:
                        # (a segment sized up front or recycled: what follows its valid records
                        # is not the log's; only the torn records were the log's)
                        removed += self.torn_bytes + sum(REC.size + r.length for r in self.tail
                                                         if r.segment == s.path) if s.stale_after else size - end
                        fd = fileio.open(s.path, os.O_RDWR)
                        try:
                            fileio.ftruncate(fd, end)
                            fileio.fdatasync(fd)
                        finally:
                            fileio.close(fd)
                    s.size, s.last_seq = end, last.end.seq
                    keep.append(s)
                elif last is not None and s.first_seq <= last.end.seq:
                    keep.append(s)
                else:
                    removed += s.path.stat().st_size
                    fileio.unlink(s.path)
            self._segs = keep
            fsync_dir(self.dir)
            self.tail = []
            self.tail_damage = None
            self.tail_beyond = []
            self.torn_bytes = 0
            self.next_seq = last.end.seq + 1 if last is not None else self._start_seq()
            self._tail_clean = True
        return removed

    def _current(self) -> _Segment:
        if self._fd is not None:
            return self._segs[-1]
        if self._stray is not None:
            fileio.unlink(self._stray, missing_ok=True)  # (see _scan: an empty segment)
            self._stray = None
        if not self._tail_clean:
            raise NeedsRecoveryError(f"journal {self.dir}: a crash left an unfinished transaction after the "
                                     f"last commit; appending now would seal it")
        last = self._segs[-1] if self._segs else None
        if last is None or (self.direct and not last.stale_after):
            # Direct writes pad their last block with zeros, which only a segment flagged
            # RECYCLED may hold after its records: one that is not (written by a writer without
            # direct writes) is left sealed, and appends go to a new one.
            if last is not None and last.first_seq == self.next_seq:
                self._segs.pop()  # it holds no record: started again under the same name
            self._new_segment()
        else:
            self._fd = fileio.open(last.path, os.O_RDWR)
            self._start_direct(last)
        return self._segs[-1]

    def _start_direct(self, seg: _Segment) -> None:
        """Direct writes on the segment just opened: keep its last partial block (rewritten,
        unchanged, by the next append) and switch the descriptor to O_DIRECT."""
        if not self.direct:
            return
        # (Read before O_DIRECT is on: an unaligned read of a direct descriptor is EINVAL.
        # Where the file system refuses O_DIRECT -- tmpfs before Linux 6.6, many FUSE file
        # systems -- _set_direct drops the block again: a buffered write starts at the append
        # point itself, and the kept block in front of it made every append fail.)
        at = seg.size - seg.size % BLOCK
        self._tail_block = os.pread(self._fd, seg.size - at, at)
        self._set_direct(True)

    def _set_direct(self, on: bool) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
        except OSError:
            on = False  # a file system without O_DIRECT: through the page cache
        self.direct = on
        if not on:
            # Buffered from here on: a write starts at the append point, so no block is rewritten
            # and none is kept (a stale one, left by the fallback after a refused direct write,
            # made the next append fail).
            self._tail_block = b""

    def _close_fd(self) -> None:
        self._map = None  # (stays in self._maps for the file's next life)
        self._tail_block = b""
        if self._fd is not None:
            fileio.close(self._fd)
            self._fd = None

    def _new_segment(self) -> None:
        self._close_fd()
        seg = _Segment(self.dir / _seg_name(self.next_seq), self.next_seq, SEG.size)
        fd = self._reuse_free(seg) if self._free else None
        if fd is None:
            try:
                fd = fileio.open(seg.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            except OSError as exc:  # (a full disk: under power-sim the undo log's own write too)
                raise_if_full(exc, f"creating journal segment {seg.path}")
            try:
                # Mapped: sized up front (allocated a chunk at a time as it fills, _prepare), so
                # flagged as a recycled one is (header first: a crash before the resize leaves a
                # small valid segment).
                # Direct: flagged too (its last block is padded with zeros after the records).
                fileio.pwrite(fd, _seg_header(self.next_seq, SEG_RECYCLED if self.mapped or self.direct else 0), 0)
                if self.mapped:
                    fileio.ftruncate(fd, self.segment_bytes + MAP_SLACK)
            except OSError as exc:
                fileio.close(fd)
                raise_if_full(exc, f"creating journal segment {seg.path}")
            seg.stale_after = self.mapped or self.direct
        self._fd = fd
        self._start_direct(seg)
        with self._lock:
            self._segs.append(seg)
        if self.sync:
            fsync_dir(self.dir)  # the segment's name is durable before any END inside it is

    def _reuse_free(self, seg: _Segment) -> int | None:
        """Open a reclaimed segment as ``seg`` (see "Recycling"); None if that fails."""
        free = self._free.pop()
        try:
            fd = fileio.open(free, os.O_RDWR)
        except OSError:
            return None
        try:
            fileio.pwrite(fd, _seg_header(seg.first_seq, SEG_RECYCLED), 0)
            if self.sync:
                fileio.fdatasync(fd)  # the new header durable before the file has a seg- name
            fileio.rename(free, seg.path)
        except OSError:
            fileio.close(fd)
            return None
        seg.stale_after = True
        self.recycled += 1
        return fd

    def _write(self, off0: int, entries: list) -> list[int]:
        """Write records ``[(type, seq, tag, length, parts)]`` contiguously from byte ``off0`` of
        the current segment, filling :class:`Fill` parts in place. Returns their payload crcs."""
        end = off0 + sum(REC.size + e[3] for e in entries)
        if self.mapped:
            m = self._map
            if m is None or m.ready < end:
                m = self._prepare(end)
            dest, base = m.view, 0
            if fileio.needs_notes(self._fd):  # stores into a mapping: noted first (fileio)
                fileio.note_range(self._fd, off0, dest[off0:end])
        else:
            # Built in an aligned buffer, then written with one call. Direct: from the start of
            # the block holding off0, whose first bytes are written again, unchanged.
            base = off0 - off0 % BLOCK if self.direct else off0
            dest = self._stage(end - base)
            if self.direct:
                dest[:off0 - base] = np.frombuffer(self._tail_block, dtype=np.uint8)
        crcs, off = [], off0
        for rtype, seq, tag, length, parts in entries:
            # The payload first, the header last: a crash mid-record leaves no valid header
            # vouching for a partial payload (program order is what survives a process crash).
            # (numpy copies without holding the GIL: the trainer's thread runs meanwhile.)
            at = start = off + REC.size - base
            for p in parts:
                if isinstance(p, Fill):
                    p.fn(dest[at:at + p.nbytes])
                    at += p.nbytes
                else:
                    v = np.frombuffer(p, dtype=np.uint8)
                    dest[at:at + v.size] = v
                    at += v.size
            pcrc = crc32c_extend(0, dest[start:at])  # (without the GIL: the trainer's thread runs)
            dest[off - base:off - base + REC.size] = np.frombuffer(_rec_header(rtype, seq, tag, length, pcrc),
                                                                   dtype=np.uint8)
            crcs.append(pcrc)
            off += REC.size + length
        if not self.mapped:
            n = end - base
            if self.direct:
                # Zeros up to the block's end: read as the end of the log (the segment is
                # flagged RECYCLED), and overwritten by the next append.
                n = -(-n // BLOCK) * BLOCK
                dest[end - base:n] = 0
            try:
                pwrite_all(self._fd, memoryview(self._staging[0])[:n], base)
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise
                # O_DIRECT refused the write: alignment rules other than BLOCK, or a file size
                # limit that cut it short (a full disk is ENOSPC). The same bytes through the
                # page cache, from now on (a real error shows again there).
                self._set_direct(False)
                pwrite_all(self._fd, memoryview(self._staging[0])[:n], base)
            if self.direct:
                self._tail_block = bytes(dest[end - end % BLOCK - base:end - base])
        return crcs

    def _stage(self, size: int) -> np.ndarray:
        """The write buffer, at least ``size`` bytes rounded up to a block (page-aligned: an
        anonymous mapping, as O_DIRECT needs)."""
        need = -(-size // BLOCK) * BLOCK
        if self._staging is None or len(self._staging[0]) < need:
            mm = mmap.mmap(-1, -(-(need * 5 // 4) // (1 << 20)) * (1 << 20))
            self._staging = (mm, np.frombuffer(mm, dtype=np.uint8))
        return self._staging[1]

    def _prepare(self, end: int) -> "_Mapping":
        """The mapping of the segment being appended to, allocated and faulted in up to at least
        ``end``: a chunk at a time (a small pool's journal does not pay for 64 MiB up front)."""
        self._map = None
        st = os.fstat(self._fd)
        seg = self._segs[-1]
        with self._lock:
            kept = self._maps.pop(st.st_ino, None)
        allocated = 0
        if kept is not None and kept.view.size < end:
            # Too small: mapped again, larger. What is allocated stays allocated; the records
            # already written are never stored to again, so only what lies ahead is faulted in.
            allocated = kept.ready
            kept = None  # (the last reference to a mapping gone: it is unmapped)
        if kept is None:
            size = st.st_size
            if size < end:
                # Only a segment whose trailing bytes are flagged as not the log's may be longer
                # than its records.
                size = max(end + MAP_CHUNK, self.segment_bytes + MAP_SLACK) if seg.stale_after else end
                try:
                    fileio.ftruncate(self._fd, size)
                except OSError as exc:
                    raise_if_full(exc, f"growing journal segment {seg.path}")
            m = mmap.mmap(self._fd, size)
            kept = _Mapping(m, np.frombuffer(m, dtype=np.uint8), allocated)
        if kept.ready < end:
            lo = kept.ready & ~(mmap.PAGESIZE - 1)
            hi = min(kept.view.size, max(end, kept.ready + MAP_CHUNK))
            try:
                # Allocated, not a hole: a store into a hole of a full tmpfs is a SIGBUS; this
                # fails with ENOSPC instead.
                fileio.fallocate(self._fd, lo, hi - lo)
            except OSError as exc:
                raise_if_full(exc, f"growing journal segment {seg.path}")
            try:
                kept.mm.madvise(MADV_POPULATE_WRITE, lo, hi - lo)  # faulted in with one call
            except (OSError, ValueError):
                pass  # an older kernel: pages fault in on first touch instead
            kept.ready = hi
        with self._lock:
            self._maps[st.st_ino] = kept   # (most recently used last)
            while len(self._maps) > KEEP_FREE + 4:
                del self._maps[next(iter(self._maps))]
        self._map = kept
        return kept

    def _drop_mapping(self, path: Path | None = None) -> None:
        """Forget the kept mapping of ``path`` (all of them if None): before the file is
        shortened (a store past its end would be a SIGBUS) or deleted (it would keep its pages)."""
        # (The journal holds the only references: dropping them unmaps.)
        with self._lock:
            if path is None:
                self._maps = {}
            else:
                try:
                    self._maps.pop(path.stat().st_ino, None)
                except FileNotFoundError:
                    pass

    def append(self, rtype: int, tag: int, parts: Sequence) -> RecordRef:
        """Append one record (not yet durable). ``parts``: buffers forming the payload, or
        :class:`Fill` parts written in place."""
        return self.append_many([(rtype, tag, parts)])[0]

    def append_many(self, records: Sequence[tuple[int, int, Sequence]]) -> list[RecordRef]:
        """Append several records ``(type, tag, parts)`` with one write."""
        seg = self._current()
        if not records:
            return []
        entries = [(int(rtype), self.next_seq + i, tag, sum(part_bytes(p) for p in parts), parts)
                   for i, (rtype, tag, parts) in enumerate(records)]
        try:
            crcs = self._write(seg.size, entries)
        except OSError as exc:
            raise_if_full(exc, f"appending to journal {seg.path}")
        refs, off = [], seg.size
        for (rtype, seq, tag, length, _), pcrc in zip(entries, crcs):
            refs.append(RecordRef(seg.path, off, rtype, seq, tag, length, pcrc))
            off += REC.size + length
        self.next_seq += len(refs)
        self.bytes_appended += off - seg.size
        seg.size = off
        if refs:
            seg.last_seq = refs[-1].seq
        self.tail.extend(refs)
        return refs

    def flush(self) -> None:
        """Make every appended record durable (``fdatasync``): the write-ahead barrier."""
        if self._fd is not None and self.sync:
            try:
                fileio.fdatasync(self._fd)
            except OSError as exc:
                raise_if_full(exc, f"syncing journal {self.dir}")
            self.syncs += 1

    def end(self, tag: int, doc: dict) -> TxnInfo:
        """Commit the records appended since the last END: sync them, then append the END
        record and sync it. Durable when this returns."""
        # 1. The transaction's records durable first: only then may an END vouch for them.
        self.flush()
        payload = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        records = list(self.tail)
        ref = self.append(RecordType.END, tag, [payload])
        # 2. The END durable: from here on the transaction survives any crash.
        self.flush()
        if self.sync and self.bytes_appended - self._marked_at >= MARK_EVERY:
            self._mark(ref)
        txn = TxnInfo(tag, doc, records, ref)
        with self._lock:
            self.txns.append(txn)
            self.tail = []
            if len(self.txns) > 4096:
                del self.txns[:-1024]  # bookkeeping only; reclaim() looks at segments
        if self._segs[-1].size >= self.segment_bytes:
            self._new_segment()  # start a new segment only right after an END (see _scan)
        return txn

    def rotate(self) -> None:
        """Start a new segment (after an END), so that everything before it can be reclaimed."""
        if self.read_only or not self._tail_clean:
            return
        with self._lock:
            if self._segs and self._segs[-1].last_seq >= 0 and not self.tail:
                self._new_segment()

    @property
    def start_seq(self) -> int:
        """Sequence number of the first live record (every record below it has been dropped)."""
        with self._lock:
            return self._segs[0].first_seq if self._segs else self.next_seq

    def sealed_bytes(self, since_seq: int) -> int:
        """Bytes of the sealed segments (all but the one being appended to) that hold records
        at or after ``since_seq``."""
        with self._lock:
            return sum(s.size for s in self._segs[:-1] if s.last_seq >= since_seq)

    def sealed_refs(self, since_seq: int) -> tuple[list[RecordRef], int | None]:
        """Every record with a sequence number >= ``since_seq`` in the *sealed* segments (all
        but the one being appended to), and the sequence number just past them; ``([], None)``
        when no sealed segment reaches ``since_seq``. A segment is sealed only after an END, so
        these records are all committed; and only sealed segments are read beside the writer:
        the segment being appended to has its last block rewritten by direct writes, which must
        not meet a mapping of it."""
        with self._lock:
            segs = [s for s in self._segs[:-1] if s.last_seq >= since_seq]
        if not segs:
            return [], None
        refs = [r for s in segs for r in _iter_refs(s) if r.seq >= since_seq]
        return refs, segs[-1].last_seq + 1

    def reclaim(self, before_seq: int, absorb: Callable[[list[RecordRef]], None] | None = None) -> int:
        """Drop segments all of whose records have a sequence number below ``before_seq`` (never
        the one being appended to). ``absorb(records)`` first writes what they hold back to
        where it belongs and makes it durable (the pool's compactor). Returns bytes dropped."""
        with self._lock:
            done = [s for s in self._segs[:-1] if s.last_seq < before_seq]
        if not done:
            return 0
        if absorb is not None:
            refs: list[RecordRef] = []
            for s in done:
                refs.extend(t for t in _iter_refs(s))
            absorb(refs)
        new_start = done[-1].last_seq + 1
        # START first, durably: a crash after it leaves dead segments that the next scan drops;
        # the other order could leave a gap at the front that looked like a missing segment.
        atomic_write(self.dir / "START", f"{new_start}\n".encode(), durable=self.sync)
        dropped = 0
        with self._lock:
            for s in done:
                dropped += s.size
                # (Only segments of about the usual size: one that a large transaction grew far
                # past it -- `--checkpoint none` commits a whole run's rows at once -- would keep
                # that much disk for reuse, 16 of them several GB.)
                if len(self._free) < KEEP_FREE and s.path.stat().st_size <= self.segment_bytes + MAP_SLACK:
                    free = self.dir / f"free-{s.first_seq:016x}.log"
                    fileio.rename(s.path, free)  # kept for reuse; START already says it is dead
                    self._free.append(free)
                else:
                    self._drop_mapping(s.path)
                    fileio.unlink(s.path)
            self._segs = self._segs[len(done):]
            self.txns = [t for t in self.txns if t.end.seq >= new_start]
        if self.sync:
            fsync_dir(self.dir)
        return dropped

    def _mark(self, end: RecordRef) -> None:
        """Move the committed mark to ``end`` (durable already: see "Committed mark"). In place,
        one 28-byte write: a torn one fails its crc32c and vouches for nothing. Best effort: a
        mark that cannot be written only leaves the older one, which is still true."""
        body = MARK_REC.pack(MARK_MAGIC, end.seq, end.tag, 0)[:-4]
        try:
            if self._mark_fd is None:
                self._mark_fd = fileio.open(self.dir / MARK, os.O_RDWR | os.O_CREAT, 0o644)
            fileio.pwrite(self._mark_fd, body + struct.pack("<I", crc32c_extend(0, body)), 0)
        except OSError:
            return
        self._marked_at = self.bytes_appended

    def close(self) -> None:
        self._close_fd()
        self._drop_mapping()
        if self._mark_fd is not None:
            fileio.close(self._mark_fd)
            self._mark_fd = None


def _iter_refs(seg: _Segment) -> Iterable[RecordRef]:
    """Every record of a sealed segment (headers verified again)."""
    with open(seg.path, "rb") as f:
        off = SEG.size
        while off < seg.size:
            f.seek(off)
            h = _parse_header(f.read(REC.size))
            if h is None:
                raise JournalCorruptError(f"journal segment {seg.path.name} at byte {off}: bad header")
            yield RecordRef(seg.path, off, h[0], h[1], h[2], h[3], h[4])
            off += REC.size + h[3]


def _prefetch(refs: Sequence[RecordRef]) -> None:
    """Ask the kernel to read the payloads of ``refs`` now, all at once (asynchronously, at the
    disk's full queue depth; a no-op for cached pages), instead of one read-ahead window per
    page fault as they are used: after a crash the journal is read from the disk."""
    spans: dict[Path, list[list[int]]] = {}
    for r in refs:
        s = spans.setdefault(r.segment, [])
        if s and r.offset <= s[-1][1] + BLOCK:
            s[-1][1] = max(s[-1][1], r.payload_offset + r.length)
        else:
            s.append([r.offset, r.payload_offset + r.length])
    for path, ranges in spans.items():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # (read_many reports it)
        try:
            for lo, hi in ranges:
                os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def window_bytes(refs: Sequence[RecordRef]) -> int:
    """The capacity a :meth:`Journal.read_many` window needs for ``refs``: their segments, whole,
    twice over -- room for a segment that grows while it is read (a reader beside a writer); the
    range is only reserved, so the slack costs no memory."""
    total = 0
    for seg in {r.segment for r in refs}:
        try:
            total += page_round(seg.stat().st_size)
        except OSError:
            pass  # (read_many reports it)
    return 2 * total


def _map_into(window: Arena, segment: Path) -> memoryview:
    """``segment`` mapped read-only (shared: the file's page cache) at the next free offset of
    ``window``, as a memoryview."""
    fd = os.open(segment, os.O_RDONLY)
    try:
        # (At most what is left of the window: a record past it reads as truncated, as past the
        # end of the file.)
        size = min(os.fstat(fd).st_size, window.capacity - window.used)
        off = window.place(size)
        if size:
            window.map_file(off, fd, size, shared=True, writable=False)
    finally:
        os.close(fd)  # (the mapping keeps the file)
    if not size:
        return memoryview(b"")
    buf = (ctypes.c_char * size).from_address(window.base + off)
    buf._arena = window  # a view of it keeps the window mapped
    return memoryview(buf).cast("B")
