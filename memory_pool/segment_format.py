"""The journal's on-media format (:mod:`memory_pool.journal`): the files of its directory, the
segment and record headers, the record types, the committed mark's record, and the records of a
sealed segment read back. The scan at open: :mod:`memory_pool.journal_reader`.

Layout of ``<dir>/``::

    seg-<first seq, 16 hex digits>.log   segments, appended to; a new one is started after a
                                         transaction end once the current one is large
    START                                first live sequence number (written before segments are
                                         dropped, so a missing *first* segment is detected too)
    free-<hex>.log                       reclaimed segments kept for reuse (never read)
    COMMITTED                            the committed mark: a transaction known durable

Segment: a 64-byte header (magic ``DCXJSEG1``, version, first seq, flags, crc32c), then records.

Record: a 40-byte header (magic ``DCXR``, type, seq, tag, payload length, crc32c of the payload,
crc32c of the header) and the payload. Sequence numbers increase by one across segments, so a
deleted or missing segment is a gap that the scan reports as damage, never skips.

Who uses which record types: the pool appends ``ROWS`` (after-images of rows: what persisting
them means on a journaled tier) and replays the ``ROWS`` of complete transactions when it opens;
the checkpointer adds ``UNDO`` (before-images) and ``DENSE`` (the dense state) records and ends
each step's transaction with its commit document. ``ROWS`` and ``UNDO`` share one payload layout
(a row set, :mod:`memory_pool.records`).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .records import crc32c_extend
from .errors import PoolCorruptError

__all__ = ["RecordType", "RecordRef", "TxnInfo", "JournalCorruptError", "SEG_MAGIC", "SEG", "SEG_RECYCLED",
           "BLOCK", "REC_MAGIC", "REC", "VERSION", "MARK", "MARK_MAGIC", "MARK_REC", "Segment", "seg_name", "seg_header",
           "rec_header", "parse_header", "iter_refs", "seg_refs"]

SEG_MAGIC = b"DCXJSEG1"
SEG = struct.Struct("<8sIQI36xI")         # magic, version, first seq, flags, pad, crc32c (64 bytes)
SEG_RECYCLED = 1                          # flags: the bytes after the valid records are stale
                                          # (a recycled segment, or a mapped one sized up front)
BLOCK = 4096                              # direct writes: offsets, lengths and buffers aligned to this
REC_MAGIC = b"DCXR"
REC = struct.Struct("<4sB3xQqQII")        # magic, type, seq, tag, length, payload crc, header crc (40)
VERSION = 1
MARK = "COMMITTED"                        # the committed mark (see "Committed mark" in memory_pool.journal)
MARK_MAGIC = b"DCXJMRK1"
MARK_REC = struct.Struct("<8sQqI")        # magic, seq of a durable END, its tag, crc32c (28 bytes)


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
class Segment:
    """One segment file of the journal as a scan (or the writer) knows it."""

    path: Path
    first_seq: int
    size: int = 0
    last_seq: int = -1     # of its last valid record (-1: none)
    stale_after: bool = False   # RECYCLED flag: bytes after the valid records are not the log's
    # Its records, as this process's writer appended them (None: not known in memory -- a
    # segment found at open -- so a reclaim reads its headers again, iter_refs).
    refs: list | None = field(default=None, repr=False, compare=False)

    def appended(self, refs: list) -> None:
        """The writer appended records ``refs`` (in order) to this segment."""
        if refs:
            self.last_seq = refs[-1].seq
            if self.refs is not None:
                self.refs.extend(refs)


def seg_name(first_seq: int) -> str:
    """The file name of the segment whose first record is ``first_seq``."""
    return f"seg-{first_seq:016x}.log"


def seg_header(first_seq: int, flags: int = 0) -> bytes:
    """A segment's header (``SEG``, its crc32c last)."""
    body = SEG.pack(SEG_MAGIC, VERSION, first_seq, flags, 0)[:-4]
    return body + struct.pack("<I", crc32c_extend(0, body))


def rec_header(rtype: int, seq: int, tag: int, length: int, pcrc: int) -> bytes:
    """A record's header (``REC``, its crc32c last); ``pcrc``: the payload's crc32c."""
    body = REC.pack(REC_MAGIC, rtype, seq, tag, length, pcrc, 0)[:-4]
    return body + struct.pack("<I", crc32c_extend(0, body))


def parse_header(raw: bytes):
    """(type, seq, tag, length, payload crc) or None when it is not a valid record header."""
    if len(raw) < REC.size or raw[:4] != REC_MAGIC:
        return None
    magic, rtype, seq, tag, length, pcrc, hcrc = REC.unpack_from(raw)
    if crc32c_extend(0, bytes(raw[:REC.size - 4])) != hcrc:
        return None
    return rtype, seq, tag, length, pcrc


def seg_refs(seg: Segment) -> Iterable[RecordRef]:
    """Every record of a sealed segment: the writer's own list where it has one (``seg.refs``),
    else its headers read back (:func:`iter_refs`). Why: a journal written with direct writes is
    not in the page cache, and a compaction read each header back from the device -- ~2,900
    reads for a `kaggle` compaction's 1 GiB, 0.3-0.5 s of its time, while the steps ran on one
    intra-op thread fewer (dlrm_cxl/cores.py)."""
    return seg.refs if seg.refs is not None else iter_refs(seg)


def iter_refs(seg: Segment) -> Iterable[RecordRef]:
    """Every record of a sealed segment (headers verified again)."""
    with open(seg.path, "rb") as f:
        off = SEG.size
        while off < seg.size:
            f.seek(off)
            h = parse_header(f.read(REC.size))
            if h is None:
                raise JournalCorruptError(f"journal segment {seg.path.name} at byte {off}: bad header")
            yield RecordRef(seg.path, off, h[0], h[1], h[2], h[3], h[4])
            off += REC.size + h[3]
