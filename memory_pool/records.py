"""Payload formats of journal records, and their checksum.

``ROWS`` and ``UNDO`` records hold a *row set*: rows of one or more tables that share a row size,
one record per row size per step (the checkpointer gathers every table of a row size with one
kernel into one buffer, and writes it as one record: 2 records a step instead of ~50, one
checksum pass each)::

    "RSET", u32 n tables, u32 row bytes, u32 ids offset, u64 n rows   (24 bytes)
    n tables x (u16 name length, u64 rows of this table)
    the names (utf-8, concatenated), zero padding up to the ids offset (8-aligned)
    [UNDO records of a writer that writes logged marks: the undo group, the 16 bytes before
     the ids: "UGRP", u32 0, u64 sequence number of the step's first UNDO record]
    n rows x i64 ids      (table after table, in the order above)
    n rows x row bytes    (the same order)

Payloads written before row sets existed (one table, no magic: ``u16 name length, u32 row
bytes, u64 n rows, name, ids, rows``) are still read (:func:`decode_row_set`).

The logged mark (``LOGGED`` records, :mod:`checkpointing.undo`): a step's undo records are
durable and its rows may change from here on. Payload: ``"LOGD", u32 the step's UNDO records,
u64 the sequence number of the first`` (16 bytes); they are the records right before the mark.

Both are compatible with readers that predate them: those skip records of a type they do not
know (every reader picks the types it reads), and find a row set's ids at the offset its header
gives, whatever lies between the names and the ids (:func:`undo_group_of` reads it).

Every payload (and every record header) is protected by crc32c (:func:`crc32c`, hardware
accelerated: :func:`crc32c_extend`).
"""

from __future__ import annotations

import struct
import warnings
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np
import torch
from crc32c import crc32c as _crc32c

from ._native import copy_rows_at as _c_copy_rows_at

# Payloads are decoded from read-only mappings of journal segments (torch.frombuffer warns about
# non-writable buffers; the tensors are only read, and copied by whoever keeps them).
warnings.filterwarnings("ignore", message="The given buffer is not writable")

__all__ = ["ROW_SET", "LOGGED_MARK", "Fill", "encode_row_set", "encode_rows", "decode_row_set", "decode_row_set_ids",
           "row_set_ids_end", "decode_rows",
           "undo_group_of", "encode_logged_mark", "decode_logged_mark", "crc32c", "crc32c_extend", "part_bytes",
           "materialize", "row_words", "copy_rows", "copy_rows_at"]

ROW_SET = struct.Struct("<4sIIIQ")        # magic, n tables, row bytes, ids offset, n rows
_TABLE = struct.Struct("<HQ")             # name length, rows
_LEGACY = struct.Struct("<HIQ")           # name length, row bytes, n rows (one table, no magic)
_MAGIC = b"RSET"
_GROUP = struct.Struct("<4sIQ")           # "UGRP", 0 (reserved), first sequence number of the step's UNDO records
_GROUP_MAGIC = b"UGRP"
LOGGED_MARK = struct.Struct("<4sIQ")      # "LOGD", the step's UNDO records, sequence number of the first
_LOGGED_MAGIC = b"LOGD"


class Fill(NamedTuple):
    """A payload part written in place: the journal hands ``fn`` a writable uint8 numpy view of
    ``nbytes`` bytes where the part goes (in the segment's mapping, or in the aligned buffer a
    direct write is made from) and ``fn`` fills it. No intermediate copy: the dense state is
    copied from the parameters straight to where it is written."""

    nbytes: int
    fn: Callable[[np.ndarray], None]


def part_bytes(p) -> int:
    """Size of a payload part: a buffer or a :class:`Fill`."""
    return p.nbytes if isinstance(p, Fill) else memoryview(p).nbytes


def materialize(parts: Iterable) -> bytearray:
    """A payload's parts as one buffer (filling the :class:`Fill` parts): for readers and tests
    that want the bytes a record would hold."""
    out = bytearray(sum(part_bytes(p) for p in parts))
    view, at = np.frombuffer(out, dtype=np.uint8), 0
    for p in parts:
        n = part_bytes(p)
        if isinstance(p, Fill):
            p.fn(view[at:at + n])
        else:
            view[at:at + n] = np.frombuffer(p, dtype=np.uint8)
        at += n
    return out


def crc32c(parts: Iterable, crc: int = 0) -> int:
    """crc32c of the concatenated ``parts`` (buffers), continuing from ``crc``."""
    for p in parts:
        crc = crc32c_extend(crc, p)
    return crc


GIL_FREE_BYTES = 32 << 10  # from this size on, a checksum is computed without holding the GIL


def crc32c_extend(crc: int, buf) -> int:
    """crc32c of ``buf`` (bytes, a numpy array or any buffer) continuing from ``crc``.

    Computed by the ``crc32c`` package (ICRAR's): SSE4.2's crc32 instruction on three interleaved
    streams, 26 GB/s here against 5.9 GB/s for google-crc32c's single stream (8 MiB: 0.32 against
    1.41 ms), which the journal writer used to spend on every recovery point's ~8 MB. The values
    are the same function (the tests check them against google-crc32c). From ``GIL_FREE_BYTES``
    on it lets go of the GIL for the call: the journal writer and the compactor checksum megabytes
    beside the trainer's thread, whose every op needs the GIL to start."""
    if isinstance(buf, np.ndarray) and not buf.flags.c_contiguous:
        buf = np.ascontiguousarray(buf)
    return _crc32c(buf, crc, 1 if memoryview(buf).nbytes >= GIL_FREE_BYTES else 0)


def encode_row_set(tables: Sequence[tuple[str, torch.Tensor]], rows: torch.Tensor | Fill,
                   row_bytes: int | None = None, *, undo_group: int | None = None) -> list:
    """Payload parts of a ROWS/UNDO record: ``tables`` is ``[(name, ids)]``, ``rows`` the rows of
    all of them in that order (``[sum of ids, ...]``, one row size). No copy of ``rows``. Or
    ``rows`` is a :class:`Fill` that writes them where the record goes (``row_bytes`` each).
    ``undo_group``: the sequence number of the step's first UNDO record (an UNDO record of a
    writer that writes logged marks; see :func:`undo_group_of`)."""
    names = [n.encode() for n, _ in tables]
    counts = [int(ids.numel()) for _, ids in tables]
    total = sum(counts)
    data = None
    if isinstance(rows, Fill):
        if row_bytes is None or rows.nbytes != total * row_bytes:
            raise ValueError(f"row set of {total} ids of {row_bytes} bytes got a fill of {rows.nbytes} bytes")
    else:
        if rows.shape[0] != total:
            raise ValueError(f"row set of {total} ids got {rows.shape[0]} rows")
        data = rows.contiguous().view(torch.uint8).reshape(total, -1) if total else None
        row_bytes = data.shape[1] if total else (rows.shape[-1] if rows.dim() > 1 else 1) * rows.element_size()
    fixed = ROW_SET.size + _TABLE.size * len(tables) + sum(len(n) for n in names)
    ids_at = -(-fixed // 8) * 8
    group = b"" if undo_group is None else _GROUP.pack(_GROUP_MAGIC, 0, undo_group)
    head = ROW_SET.pack(_MAGIC, len(tables), row_bytes, ids_at + len(group), total) + \
        b"".join(_TABLE.pack(len(n), c) for n, c in zip(names, counts)) + b"".join(names) + \
        bytes(ids_at - fixed) + group
    if not total:
        return [head]
    ids = tables[0][1] if len(tables) == 1 else torch.cat([i for _, i in tables])
    ids = ids.to(torch.int64).contiguous()
    body = rows if data is None else memoryview(data.reshape(-1).numpy()).cast("B")
    return [head, memoryview(ids.numpy()).cast("B"), body]


def encode_rows(name: str, ids: torch.Tensor, rows: torch.Tensor) -> list:
    """Payload parts of a ROWS/UNDO record of one table."""
    return encode_row_set([(name, ids)], rows)


def row_words(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (``[n, row_bytes]`` uint8) viewed as ``[n, row_bytes / w]`` of the widest
    integer of ``w`` bytes (8, 4, 2) that divides ``row_bytes`` and the view's offset; ``rows``
    itself where none does. Row copies (``index_copy_``, ``index_select``, a mask) then move
    ``w`` bytes an element: torch moves a uint8 row byte by byte -- 1 M rows of 256 B took
    346 ms by ``index_copy_`` against 127 ms as int64, on this machine. The bytes are the same:
    copy between two tensors viewed alike (``row_words`` of both, same ``row_bytes``)."""
    if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.stride(1) != 1:
        return rows
    rb = rows.shape[1]
    for dtype, w in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if rb % w == 0 and rows.storage_offset() % w == 0 and (rows.shape[0] < 2 or rows.stride(0) % w == 0):
            return rows.view(dtype)
    return rows


def copy_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.index_copy_(0, index, src)`` for ``[n, row_bytes]`` uint8 rows, a word at a time
    where both views allow it (:func:`row_words`). Returns ``dst``."""
    dw, sw = row_words(dst), row_words(src)
    if dw.dtype == sw.dtype:
        dw.index_copy_(0, index, sw)
    else:
        dst.index_copy_(0, index, src)
    return dst


def copy_rows_at(dst: torch.Tensor, places: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``dst[places] = src[rows]`` for ``[n, row_bytes]`` uint8 rows (``places``, ``rows``: int64
    indexes, ``places`` distinct): with ``memory_pool/_newest.c`` a memcpy a row, straight from
    ``src`` to its place (the GIL let go); else :func:`copy_rows` of ``src.index_select(0,
    rows)``, the definition, which copies every row twice. Raises ``IndexError`` for an index
    out of range, as torch does. Returns ``dst``."""
    fn = _c_copy_rows_at()
    if (fn is None or dst.dim() != 2 or src.dim() != 2 or dst.dtype != torch.uint8 or src.dtype != torch.uint8
            or dst.shape[1] != src.shape[1] or not dst.is_contiguous() or not src.is_contiguous()
            or places.dtype != torch.int64 or rows.dtype != torch.int64 or places.numel() != rows.numel()):
        return copy_rows(dst, places, src.index_select(0, rows))
    places, rows = places.contiguous(), rows.contiguous()
    got = fn(dst.data_ptr(), dst.shape[0], places.data_ptr(), src.data_ptr(), src.shape[0], rows.data_ptr(),
             places.numel(), dst.shape[1])
    if got < 0:
        k = -got - 1
        raise IndexError(f"copy_rows_at: row {int(rows[k])} of {src.shape[0]} to place {int(places[k])} "
                         f"of {dst.shape[0]}: out of range")
    return dst


def decode_row_set(payload) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``[(table name, ids int64 [n], raw rows uint8 [n, row_bytes])]`` of a ROWS/UNDO payload
    (views of ``payload``). Raises ``ValueError`` when the payload does not hold what it says."""
    mv = memoryview(payload)
    if bytes(mv[:4]) != _MAGIC:
        return [_decode_legacy(mv)]
    row_bytes, ids_at, total, entries = _row_set_tables(mv)
    ids, data = _ids_and_rows(mv, ids_at, total, row_bytes)
    out, at = [], 0
    for name, count in entries:
        out.append((name, ids[at:at + count], data[at:at + count]))
        at += count
    return out


def decode_row_set_ids(payload) -> tuple[torch.Tensor, list[tuple[str, int]], int]:
    """``(ids int64 [n], [(table name, rows)], row bytes)`` of a ROWS/UNDO payload, or of its
    first :func:`row_set_ids_end` bytes: every table's ids in one tensor (a view of
    ``payload``), the tables' in the order of the list. Raises ``ValueError`` as
    :func:`decode_row_set` does."""
    mv = memoryview(payload)
    if bytes(mv[:4]) != _MAGIC:
        name, ids, raw = _decode_legacy(mv)
        return ids, [(name, ids.numel())], raw.shape[1]
    row_bytes, ids_at, total, entries = _row_set_tables(mv)
    if len(mv) < ids_at + 8 * total:
        raise ValueError(f"row record of {len(mv)} bytes does not hold the ids of {total} rows")
    ids = torch.frombuffer(mv[ids_at:ids_at + 8 * total], dtype=torch.int64) if total else \
        torch.empty(0, dtype=torch.int64)
    return ids, entries, row_bytes


def row_set_ids_end(head) -> int | None:
    """Where a row record's ids end (bytes from its payload's start), read off ``head``, its
    first bytes; None when they do not say (another format, or too short)."""
    mv = memoryview(head)
    if len(mv) < ROW_SET.size or bytes(mv[:4]) != _MAGIC:
        return None
    _, _, _, ids_at, total = ROW_SET.unpack_from(mv)
    return ids_at + 8 * total


def _row_set_tables(mv: memoryview) -> tuple[int, int, int, list[tuple[str, int]]]:
    """(row bytes, ids offset, rows, [(table name, rows)]) of a row set's header."""
    if len(mv) < ROW_SET.size:
        raise ValueError(f"row record of {len(mv)} bytes is shorter than its header")
    _, ntables, row_bytes, ids_at, total = ROW_SET.unpack_from(mv)
    p = ROW_SET.size
    counts = []
    for _ in range(ntables):
        if p + _TABLE.size > len(mv):
            raise ValueError("row record is shorter than its table list")
        counts.append(_TABLE.unpack_from(mv, p))
        p += _TABLE.size
    if sum(c for _, c in counts) != total:
        raise ValueError(f"row record's tables hold {sum(c for _, c in counts)} rows, its header says {total}")
    entries = []
    for nlen, count in counts:
        if p + nlen > ids_at:
            raise ValueError("row record's table names run past its ids")
        entries.append((bytes(mv[p:p + nlen]).decode(), count))
        p += nlen
    return row_bytes, ids_at, total, entries


def undo_group_of(payload) -> int | None:
    """The undo group of a row set (the sequence number of its step's first UNDO record), or
    None: a record without one (a ROWS record, an UNDO record of a writer without logged marks,
    the earlier one-table layout) or one that does not hold what it says (decode_row_set says
    what is wrong). Recovery asks it of valid records that follow a bad one: a record of the
    same step's undo group, written before its mark, vouches for nothing."""
    mv = memoryview(payload)
    if len(mv) < ROW_SET.size or bytes(mv[:4]) != _MAGIC:
        return None
    _, ntables, _, ids_at, _ = ROW_SET.unpack_from(mv)
    end = ROW_SET.size + _TABLE.size * ntables
    if end > ids_at or ids_at > len(mv):
        return None
    end += sum(_TABLE.unpack_from(mv, ROW_SET.size + _TABLE.size * i)[0] for i in range(ntables))
    if ids_at - end < _GROUP.size:
        return None
    magic, _, group = _GROUP.unpack_from(mv, ids_at - _GROUP.size)
    return group if magic == _GROUP_MAGIC else None


def encode_logged_mark(first_seq: int, count: int) -> list:
    """Payload of a LOGGED record: the step's ``count`` UNDO records, from sequence number
    ``first_seq`` on, are durable (they are the records right before the mark)."""
    return [LOGGED_MARK.pack(_LOGGED_MAGIC, count, first_seq)]


def decode_logged_mark(payload) -> tuple[int, int]:
    """(sequence number of the first UNDO record, number of them) of a LOGGED payload; raises
    ``ValueError`` when it is not one."""
    mv = memoryview(payload)
    if len(mv) != LOGGED_MARK.size or bytes(mv[:4]) != _LOGGED_MAGIC:
        raise ValueError(f"a logged mark of {len(mv)} bytes is not one")
    _, count, first = LOGGED_MARK.unpack_from(mv)
    return first, count


def decode_rows(payload) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(table name, ids, raw rows) of a ROWS/UNDO payload of exactly one table."""
    got = decode_row_set(payload)
    if len(got) != 1:
        raise ValueError(f"row record holds {len(got)} tables, expected one")
    return got[0]


def _decode_legacy(mv: memoryview) -> tuple[str, torch.Tensor, torch.Tensor]:
    if len(mv) < _LEGACY.size:
        raise ValueError(f"row record of {len(mv)} bytes is shorter than its header")
    nlen, row_bytes, n = _LEGACY.unpack_from(mv)
    name = bytes(mv[_LEGACY.size:_LEGACY.size + nlen]).decode()
    return (name, *_ids_and_rows(mv, _LEGACY.size + nlen, n, row_bytes))


def _ids_and_rows(mv: memoryview, at: int, n: int, row_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` ids (i64) at byte ``at`` and the ``n`` rows after them, which end the payload."""
    if len(mv) != at + n * (8 + row_bytes):
        raise ValueError(f"row record of {len(mv)} bytes does not hold {n} rows of {row_bytes} bytes")
    if not n:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, row_bytes, dtype=torch.uint8)
    ids = torch.frombuffer(mv[at:at + 8 * n], dtype=torch.int64)
    return ids, torch.frombuffer(mv[at + 8 * n:], dtype=torch.uint8).view(n, row_bytes)
