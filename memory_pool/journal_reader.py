"""Opening a journal (:mod:`memory_pool.journal`): the scan that verifies its structure and finds
its transactions, its torn tail and any damage, and reading its records back.
:class:`JournalReader` is the base of :class:`~memory_pool.journal.Journal`, which sets the
attributes it reads (``dir``, ``read_only``, ``_lock``) and scans at its construction; the
format: :mod:`memory_pool.segment_format`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np

from .arena import PAGE as PAGE_BYTES, Arena, page_round
from . import fileio
from .records import crc32c, crc32c_extend, row_set_ids_end
from .segment_format import (BLOCK, MARK, MARK_MAGIC, MARK_REC, REC, REC_MAGIC, SEG, SEG_MAGIC, SEG_RECYCLED,
                             JournalCorruptError, RecordRef, RecordType, TxnInfo, iter_refs, parse_header, seg_refs,
                             Segment)

__all__ = ["JournalReader", "window_bytes", "HEAD_READ", "DIRECT_SPAN"]

DIRECT_SPAN = 16 << 20  # bytes of consecutive records read_payloads reads at once
HEAD_READ = 16 << 10   # bytes first read of a row record for its header and ids (52 tables' list: ~2 KB)


class JournalReader:
    """The reading side of a journal: the scan at open (see the module docstring) and reading
    records back. Opened through :class:`~memory_pool.journal.Journal` (``read_only=True`` to
    only read)."""

    heads = None   # (the journal's kept row records' heads, if any: memory_pool/record_heads.py)

    # -- scanning
    def _start_seq(self) -> int:
        try:
            return int((self.dir / "START").read_text().strip() or 0)
        except FileNotFoundError:
            return 0
        except ValueError:
            raise JournalCorruptError(f"{self.dir / 'START'} is damaged") from None

    def _scan(self) -> None:
        segs: list[Segment] = []
        self._stray: Path | None = None   # an empty last segment, removed by the first append
        mark = self._read_mark()   # (before START and the segments: memory_pool.journal, "Committed mark")
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
            segs.append(Segment(p, first, p.stat().st_size))
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
        bad: tuple[Segment, int, str] | None = None
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
                    h = parse_header(f.read(REC.size))
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

    def _valid_after(self, seg: Segment, off: int, after_seq: int) -> list[RecordRef]:
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
                    h = parse_header(data[pos:pos + REC.size])
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

    def read_payloads(self, refs: Sequence[RecordRef], *, ids_only: bool = False):
        """Yield ``(ref, payload)`` for ``refs`` (in order), verified against their checksums,
        without mapping the segments: read with ``O_DIRECT`` (a payload is valid until the next
        is yielded). Why: on this VM the CPU's first touch of a page the disk just filled costs
        ~2 us (a GiB of journal: ~0.55 s of the compactor's CPU, whether through a mapping or a
        copy out of the page cache), and a direct read into memory already touched costs ~0.04 s
        a GiB (memory_pool/newest.py). Consecutive records are read together, up to
        :data:`DIRECT_SPAN` bytes at a time, into two buffers used in turn: the next span is read
        on a thread of its own while this one's records go out. Where the file system refuses
        direct reads, ``pread`` through the page cache.

        ``ids_only``: a row record's bytes up to the end of its ids
        (:func:`~memory_pool.records.row_set_ids_end`; all of a record of another format), *not*
        verified: the caller verifies them when it reads the record whole. Those of the journal's
        kept :attr:`heads` are not read at all."""
        if ids_only:
            yield from self._read_heads(refs)
            return
        spans = _direct_spans(refs)
        bufs: list = [None, None]   # (two: the next span is read while this one's records go out)

        def read(n: int) -> tuple[mmap.mmap, int]:   # (on the reader thread)
            path, a, b, rs = spans[n]
            buf = bufs[n % 2]
            if buf is None or len(buf) < b - a:  # (an old one goes with the last view a caller keeps)
                buf = bufs[n % 2] = mmap.mmap(-1, max(b - a, DIRECT_SPAN))  # (page-aligned: O_DIRECT's)
            fd, direct = _open_for_reading(path, rs[0])
            try:
                with memoryview(buf)[:b - a] as span:
                    return buf, _read_span(fd, direct, span, a)[0]
            finally:
                os.close(fd)

        with ThreadPoolExecutor(1, thread_name_prefix="journal-read") as reader:
            ahead = reader.submit(read, 0) if spans else None
            for n, (_, a, _, rs) in enumerate(spans):
                buf, got = ahead.result()
                ahead = reader.submit(read, n + 1) if n + 1 < len(spans) else None
                for ref in rs:
                    at = ref.payload_offset - a
                    if at + ref.length > got:
                        raise JournalCorruptError(f"journal record {ref.seq} in {ref.segment.name} is truncated")
                    with memoryview(buf)[at:at + ref.length] as view:
                        if crc32c_extend(0, view) != ref.crc:
                            raise JournalCorruptError(
                                f"journal record {ref.seq} ({RecordType(ref.type).name}) in "
                                f"{ref.segment.name} fails its checksum (bit flip or foreign write)")
                        yield ref, view
        for buf in bufs:
            _close(buf)

    def _read_heads(self, refs: Sequence[RecordRef]):
        """(read_payloads' ``ids_only``.) A record's first :data:`HEAD_READ` bytes, then the rest
        of its ids if they go on: direct reads too, into one reused buffer."""
        buf, cap = None, 0
        fd, path, direct = None, None, False
        try:
            for ref in refs:
                kept = self.heads.get(ref) if self.heads is not None else None
                if kept is not None:
                    with memoryview(kept) as view:
                        yield ref, view
                    continue
                if ref.segment != path:
                    if fd is not None:
                        os.close(fd)
                        fd = None
                    fd, direct = _open_for_reading(ref.segment, ref)
                    path = ref.segment
                lo = ref.payload_offset
                a = lo - lo % PAGE_BYTES
                want = min(ref.length, HEAD_READ)
                for _ in range(2):  # (the head, then the ids past it)
                    b = page_round(lo + want)
                    if cap < b - a:
                        cap = max(b - a, 2 * cap)
                        buf = mmap.mmap(-1, cap)
                    span = memoryview(buf)[:b - a]
                    try:
                        got, direct = _read_span(fd, direct, span, a)
                    finally:
                        span.release()
                    if got < lo - a + want:
                        raise JournalCorruptError(f"journal record {ref.seq} in {ref.segment.name} is truncated")
                    end = row_set_ids_end(buf[lo - a:lo - a + min(want, 64)])
                    need = ref.length if end is None else min(end, ref.length)
                    if need <= want:
                        break
                    want = need
                view = memoryview(buf)[lo - a:lo - a + need]
                try:
                    yield ref, view
                finally:
                    view.release()
        finally:
            if fd is not None:
                os.close(fd)
            _close(buf)

    def preread(self, refs: Sequence[RecordRef]) -> int:
        """Bring the payloads of ``refs`` into the page cache and wait for them: one touch a
        page through a read-only mapping, the kernel's read-ahead doing the rest (~0.6 s and
        ~0.05 s of CPU for 1 GiB here; ``POSIX_FADV_WILLNEED`` alone left most of a GiB unread
        after 20 s). A compaction does it first, while the steps keep every intra-op thread
        (``Compaction.reading``): then its pass over the records is the CPU's work alone, not
        device waits on one thread fewer. A mapped journal (in RAM) has them. Returns the bytes
        asked for. The pages go with :meth:`forget_read`, as those a reader faults in do."""
        if self.mapped:
            return 0
        total = 0
        for fd, ranges in _open_spans(refs):
            size = os.fstat(fd).st_size
            if not size:
                continue
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:
                pages = np.frombuffer(m, dtype=np.uint8)
                for lo, hi in ranges:
                    hi = min(hi, size)
                    if lo < hi:
                        int(pages[lo - lo % PAGE_BYTES:hi:PAGE_BYTES].sum())  # (a read of each page)
                        total += hi - lo
                del pages
        return total

    def forget_read(self, refs: Sequence[RecordRef]) -> None:
        """Give back the page cache of the segments ``refs`` lie in, once a write-back has read
        them (an apply pass or a compaction reads whole sealed segments, and nothing reads them
        again: they are dropped or reused at the next compaction). Call it when no view of them
        is left (the pages a mapping still maps stay). A journal written with direct writes has
        its pages cached only because a reader read them (and the read-around of the mapping's
        faults), and they stayed against the pool's DRAM budget: 1.1 GB of `kaggle`'s journal
        after 270 steps behind a 2.2 GB budget (docs/tiering-measurements.md). A mapped
        journal (in RAM) keeps its pages: they are the journal."""
        if self.mapped:
            return
        for path in {r.segment for r in refs}:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue  # (gone: nothing cached)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    @property
    def last(self) -> TxnInfo | None:
        return self.txns[-1] if self.txns else None

    @property
    def live_bytes(self) -> int:
        return sum(s.size for s in self._segs)

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
        refs = [r for s in segs for r in seg_refs(s) if r.seq >= since_seq]
        return refs, segs[-1].last_seq + 1


def _spans(refs: Sequence[RecordRef]) -> dict[Path, list[list[int]]]:
    """The byte ranges ``refs`` occupy, per segment, neighbours merged."""
    spans: dict[Path, list[list[int]]] = {}
    for r in refs:
        s = spans.setdefault(r.segment, [])
        if s and r.offset <= s[-1][1] + BLOCK:
            s[-1][1] = max(s[-1][1], r.payload_offset + r.length)
        else:
            s.append([r.offset, r.payload_offset + r.length])
    return spans


def _prefetch(refs: Sequence[RecordRef]) -> None:
    """Ask the kernel to read the payloads of ``refs`` now, all at once (asynchronously, at the
    disk's full queue depth; a no-op for cached pages), instead of one read-ahead window per
    page fault as they are used: after a crash the journal is read from the disk."""
    for fd, ranges in _open_spans(refs):
        for lo, hi in ranges:
            os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)


def _open_spans(refs: Sequence[RecordRef]):
    """``(descriptor, byte ranges)`` of each segment ``refs`` lie in (:func:`_spans`), opened
    read-only and closed when the next is asked for; a segment that is gone is skipped
    (``read_many`` reports it)."""
    for path, ranges in _spans(refs).items():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            yield fd, ranges
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
    return memoryview(window.buffer(off, size)).cast("B")  # (a view of it keeps the window mapped)


def _open_for_reading(path: Path, ref: RecordRef) -> tuple[int, bool]:
    """``path`` (where ``ref`` lies) opened read-only, with ``O_DIRECT`` where the file system
    takes it; (descriptor, whether direct)."""
    try:
        if hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        return os.open(path, os.O_RDONLY), False
    except FileNotFoundError:
        raise JournalCorruptError(f"journal record {ref.seq}: its segment {path.name} is gone") from None


def _read_span(fd: int, direct: bool, span: memoryview, offset: int) -> tuple[int, bool]:
    """Read ``span`` from ``offset`` (page-aligned, both); (bytes read, whether still direct): a
    direct read refused (``EINVAL``: an alignment the device does not take) is done again through
    the page cache, and the descriptor stays so."""
    if direct:
        try:
            return os.preadv(fd, [span], offset), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
    return os.preadv(fd, [span], offset), False


def _close(buf: mmap.mmap | None) -> None:
    """Unmap a read buffer now, or when the last view a caller keeps of it goes."""
    if buf is not None:
        try:
            buf.close()
        except BufferError:
            pass


def _direct_spans(refs: Sequence[RecordRef]) -> list[tuple[Path, int, int, list[RecordRef]]]:
    """``(segment, start, end, its records)``: ``refs`` cut into page-aligned spans of records
    that follow each other in one segment, at most :data:`DIRECT_SPAN` bytes each (a record
    larger than that alone)."""
    spans: list = []
    for ref in refs:
        lo, hi = ref.payload_offset, ref.payload_offset + ref.length
        if spans:
            path, a, b, rs = spans[-1]
            last = rs[-1].payload_offset + rs[-1].length
            if path == ref.segment and lo >= last and hi - a <= DIRECT_SPAN:
                spans[-1] = (path, a, page_round(hi), rs)
                rs.append(ref)
                continue
        spans.append((ref.segment, lo - lo % PAGE_BYTES, page_round(hi), [ref]))
    return spans
