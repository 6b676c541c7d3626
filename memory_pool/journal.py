"""The persistence journal: a sequential, checksummed record log with group commit.

Real persistent memory persists bytes (cache lines), not pages. An emulation that persists a
256-byte row by ``msync``-ing its 4 KiB page is 16x off and makes every number it produces
mislead. The journal gives emulated persistence the right cost model: persisting N bytes appends
N bytes (plus a 40-byte header) to a sequential file, and one ``fdatasync`` makes a whole group
of records durable (group commit). A compactor later writes the rows back into the table image
files, sorted and coalesced, and drops the segments it has absorbed.

The on-media format (the directory's files, segment and record headers, record types):
:mod:`memory_pool.segment_format`. The scan at open and reading records back:
:mod:`memory_pool.journal_reader` (:class:`Journal` is a :class:`JournalReader`).

Recycling (after PostgreSQL's WAL): a reclaimed segment is renamed ``free-*`` and reused as a
new one, its new header durable *before* its ``seg-`` rename (a crash between leaves an ignored
``free-`` file). Appends then overwrite existing pages (a fresh page costs 4-8x here). Past its
valid records lie its previous life's, numbered below the segment's first: the scan stops there,
and the ``RECYCLED`` flag says stale, not torn. (Row records' heads: memory_pool/record_heads.py.)

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

Mapped segments (``mapped=True``: a journal in RAM, on tmpfs, the shm tier). ``pwrite`` into
tmpfs costs a kernel copy and a page-cache lookup per page (1.8 ms for 8 MB over a 64 MiB segment
here, against 0.65 ms into a mapping already faulted in): records are copied into a shared mapping
of the segment instead, sized up front and flagged ``RECYCLED`` (the bytes after the valid records
are zeros or a previous life). Pages are allocated (``posix_fallocate``: a full tmpfs is
``PoolFullError``, never a SIGBUS mid-copy) and faulted in 8 MiB ahead of the appends, and the
mapping is kept for the file's next lives. A process crash keeps every store made before it, in
program order: the header is copied after the payload, so a crash mid-record leaves a torn or
stale tail, as a short ``pwrite`` would.

Direct writes (``direct=True``: a journal on a disk, the emulated pmem and power-sim tiers). A
buffered ``pwrite`` of 8 MB costs ~4 ms of kernel CPU on this VM (a page dirtied, accounted and
later written back, per 4 KiB); with ``O_DIRECT`` ~1 ms, the device doing the rest while the
trainer computes. Records are built in a page-aligned buffer (payloads copied, or filled in place:
:class:`Fill`, e.g. the dense state straight from the parameters) and written with one call per
append, whole blocks (``BLOCK``): the last partial block is written again, unchanged in its first
bytes, by the next append (a torn rewrite of identical bytes leaves them as they were), and the
bytes after the records up to the block's end are zeros. So the segment carries the ``RECYCLED``
flag; one written without direct writes (an older writer) is sealed, never padded. ``fdatasync``
still follows every group commit (the device's volatile cache, the file's size). Replay and
compaction read the pages from the disk (cheap in CPU, read ahead in large blocks). A file system
that refuses ``O_DIRECT`` is written through the page cache.

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
* format: a file an older dlrm-cxl neither reads nor writes (its appends leave the mark behind,
  never ahead); the segments are unchanged, so no version bump.

The other high-water marks are checked by the scan already: a sealed segment is followed by a
segment whose first sequence number must follow its last record (a cut or deleted segment that
is not the last is a gap: damage), and ``START`` names the first segment, which must exist.

Thread safety: one writer thread appends and ends transactions; :meth:`Journal.reclaim` (the
compactor) may run on another; both take the journal's lock around segment-list changes.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from . import fileio
from .durable import atomic_write, fsync_dir, pwrite_all, raise_if_full
from .records import (Fill, crc32c, crc32c_extend, decode_row_set, decode_rows, encode_row_set,  # noqa: F401
                      encode_rows, part_bytes)
from .errors import NeedsRecoveryError, PoolReadOnlyError
from .journal_reader import JournalReader, window_bytes
from .record_heads import RecordHeads
from .segment_format import (BLOCK, MARK, MARK_MAGIC, MARK_REC, REC, SEG, SEG_RECYCLED, JournalCorruptError,
                             RecordRef, RecordType, TxnInfo, seg_refs, rec_header, seg_header, seg_name,
                             Segment)

__all__ = ["Journal", "RecordType", "RecordRef", "TxnInfo", "JournalCorruptError", "Fill", "encode_rows",
           "encode_row_set", "decode_rows", "decode_row_set", "crc32c", "window_bytes"]

KEEP_FREE = 16                            # reclaimed segments kept for reuse (16 x (64 + 32) MiB at most)
MAP_CHUNK = 8 << 20                       # mapped segments: allocated and faulted in this much at a time
MAP_SLACK = 32 << 20                      # mapped segments are sized this much past segment_bytes: the
                                          # transaction that crosses it fits without a new mapping
MARK_EVERY = 1 << 20                      # the mark moves after this many bytes of appends


@dataclass
class _Mapping:
    """A kept shared mapping of a mapped segment; its first ``ready`` bytes are allocated (a
    store there is never a SIGBUS on a full tmpfs) and faulted in, but for the part a smaller,
    earlier mapping of the file had prepared (faulted in again only if stored to)."""

    mm: mmap.mmap
    view: np.ndarray      # the mapping's bytes (numpy: copies into it release the GIL)
    ready: int = 0


# --------------------------------------------------------------------------- the journal


class Journal(JournalReader):
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
        # Written to since its last sync? (_write only: a new segment's header is synced with its
        # first record; alone it vouches for nothing, and a scan skips a segment that lost it)
        self._unsynced = False
        self.bytes_appended = 0       # payload + headers appended by this process
        self._mark_fd: int | None = None   # the committed mark (COMMITTED), opened at its first write
        self._marked_at = 0           # bytes_appended when the mark was last moved
        self.syncs = 0
        self.recycled = 0             # segments started by reusing a reclaimed one
        self.heads: RecordHeads | None = None   # kept row records' heads (see the module), or not
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
            keep: list[Segment] = []
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
                            # Durable now: without it a power loss brings the cut records back,
                            # and a pool that recovery left clean needs recovery again
                            # (test_recovery's clean-journal checks on power-sim catch it).
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

    def _current(self) -> Segment:
        if self._fd is not None:
            return self._segs[-1]
        if self._stray is not None:
            fileio.unlink(self._stray, missing_ok=True)  # (see _scan: an empty segment)
            if self.sync:
                # Durable before any END appended to the segment before it is: a power loss
                # would bring the empty file back, named for sequence numbers that segment
                # then holds, and the journal would read as damaged (records "missing").
                fsync_dir(self.dir)
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

    def _start_direct(self, seg: Segment) -> None:
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
        on = fileio.set_direct(self._fd, on) and on  # (refused: through the page cache)
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
        seg = Segment(self.dir / seg_name(self.next_seq), self.next_seq, SEG.size, refs=[])
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
                fileio.pwrite(fd, seg_header(self.next_seq, SEG_RECYCLED if self.mapped or self.direct else 0), 0)
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

    def _reuse_free(self, seg: Segment) -> int | None:
        """Open a reclaimed segment as ``seg`` (see "Recycling"); None if that fails."""
        free = self._free.pop()
        try:
            fd = fileio.open(free, os.O_RDWR)
        except OSError:
            return None
        try:
            fileio.pwrite(fd, seg_header(seg.first_seq, SEG_RECYCLED), 0)
            if self.sync:
                fileio.fdatasync(fd)  # the new header durable before the file has a seg- name
            fileio.rename(free, seg.path)
        except OSError:
            fileio.close(fd)
            return None
        seg.stale_after = True
        self.recycled += 1
        return fd

    def _write(self, off0: int, entries: list) -> tuple[list[int], list]:
        """Write records ``[(type, seq, tag, length, parts)]`` contiguously from byte ``off0`` of
        the current segment, filling :class:`Fill` parts in place. Returns their payload crcs,
        and the row records' heads to keep (:attr:`heads`)."""
        end = off0 + sum(REC.size + e[3] for e in entries)
        self._unsynced = True  # (first: a write that fails part-way counts too)
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
        crcs, off, noted = [], off0, []
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
            if self.heads is not None and rtype == RecordType.ROWS:
                noted.append(RecordHeads.note(seq, dest[start:at]))
            dest[off - base:off - base + REC.size] = np.frombuffer(rec_header(rtype, seq, tag, length, pcrc),
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
        return crcs, [n for n in noted if n is not None]

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
            # Faulted in with one call, without holding the GIL (the prefetch thread runs on):
            # fails on an older kernel, and the pages fault in on first touch instead.
            fileio.populate_write(kept.view, lo, hi)
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
            crcs, noted = self._write(seg.size, entries)
        except OSError as exc:
            raise_if_full(exc, f"appending to journal {seg.path}")
        refs, off = [], seg.size
        for (rtype, seq, tag, length, _), pcrc in zip(entries, crcs):
            refs.append(RecordRef(seg.path, off, rtype, seq, tag, length, pcrc))
            off += REC.size + length
        if noted:  # (written: kept now)
            self.heads.add(noted, refs)
        self.next_seq += len(refs)
        self.bytes_appended += off - seg.size
        seg.size = off
        seg.appended(refs)
        self.tail.extend(refs)
        return refs

    def flush(self) -> None:
        """Make every appended record durable (``fdatasync``): the write-ahead barrier; skipped
        when nothing was written since the last one (a step's END alone: one sync, not two)."""
        if self._fd is not None and self.sync and self._unsynced:
            try:
                fileio.fdatasync(self._fd)
            except OSError as exc:
                raise_if_full(exc, f"syncing journal {self.dir}")
            self._unsynced = False  # (only once it returned: a failed sync is tried again)
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
                refs.extend(seg_refs(s))
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
            if self.heads is not None:
                self.heads.drop_below(new_start)
        if self.sync:
            # Not for correctness (START, durable above, already says these segments are dead,
            # and a scan deletes files named below it) but for the disk: without it a power loss
            # brings the dropped segments back, and the journal stays that large on disk until
            # a writer opens the pool again.
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
