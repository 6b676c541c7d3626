"""``dlrm-cxl export``: the state_dict of an equivalent TorchRec ``DLRM`` written to a file as
``torch.save`` writes it, with the tables streamed from the pool, never held in memory.

How (one pass over the tables, one write of the file):

1. ``torch.save`` under ``torch.serialization.skip_data()`` writes the archive -- the pickle,
   every record's header, the central directory -- and seeks over each tensor's bytes. The
   tables' tensors there are ``torch.empty`` of their shape: never touched, so no memory.
2. Each tensor's bytes are written at its record's place: the dense parameters from the model,
   each table read from the pool in pieces of 64 MiB by ``Table.snapshot`` (a read-only copy:
   no pending row applied into the working copy, no DRAM cache flushed, rows never trained made
   from the initializer).
3. Each record's crc32, computed as its bytes went out, is written where the archive keeps it
   (the data descriptor after its bytes, and its central directory entry), so that the file
   checks as a zip (``zipfile.ZipFile.testzip``) as ``torch.save``'s own output does.
4. fsync, rename over the output's name, fsync the directory (``durable.atomic_write_with``):
   a crash leaves the old file or the new one, never a torn one.

Before, the export held every table three times (a copy, the serialised bytes, a copy of
those): more than this machine's 24 GB for `kaggle`'s 8.8 GB.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from pathlib import Path

import torch

from memory_pool import InOrder, fileio
from memory_pool.durable import atomic_write_with

from .model import PoolDLRM, torchrec_table_key

__all__ = ["write_torchrec_state"]

PIECE_BYTES = 64 << 20   # a table is read and written this much at a time
# A zip's local file header (30 bytes): signature, version, flags, (method, time, date, crc32 at
# 14, sizes), name and extra lengths. A central directory entry (46 bytes): signature, (versions,
# flags, method, time, date), crc32 at 16, the two sizes, name, extra and comment lengths, (disk,
# attributes), the local header's offset.
_LOCAL = struct.Struct("<4s2sH18sHH")
_CENTRAL = struct.Struct("<4s12sIIIHHH8sI")


class _FdWriter:
    """A file object over ``fd`` for ``torch.save``: writes through ``fileio.pwrite``, seeks
    (``skip_data`` seeks over the bytes it leaves out)."""

    def __init__(self, fd: int):
        self.fd, self.offset = fd, 0
        self.error: OSError | None = None  # (torch.save reports a failed write as a RuntimeError)

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        try:
            fileio.pwrite(self.fd, data, self.offset)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.offset += n
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.offset}.get(whence)
        self.offset = (os.fstat(self.fd).st_size if base is None else base) + offset
        return self.offset

    def tell(self) -> int:
        return self.offset

    def flush(self) -> None:
        pass


def write_torchrec_state(model: PoolDLRM, path) -> int:
    """Write ``model``'s TorchRec ``DLRM`` state_dict (the keys and values of
    ``PoolDLRM.export_torchrec``) to ``path``, atomically and durably, with the tables streamed
    (see the module). Returns the file's size. A full disk raises ``PoolFullError`` with the
    old file (if any) in place and nothing of this one left."""
    path = Path(path)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    tables = {torchrec_table_key(t.name): t for t in model.tables}
    for key, t in tables.items():
        state[key] = torch.empty(t.num_embeddings, t.embedding_dim, dtype=t.dtype)  # (untouched: no memory)
    size = [0]

    def fill(fd: int) -> None:
        out = _FdWriter(fd)
        try:
            with torch.serialization.skip_data():
                torch.save(state, out)
        except RuntimeError:
            if out.error is not None:  # (the write that failed, not torch's wrapping of it)
                raise out.error from None
            raise
        size[0] = out.offset
        # (each piece's crc32 on a thread of its own while the next piece is read: zlib's
        # crc32 of `kaggle`'s 8.6 GB took 18 s of the export's 58 on the one thread)
        with InOrder("dlrm-cxl-export-crc") as crcs:
            for (data_at, crc_at), (key, value) in zip(_records(fd, state), state.items()):
                t = tables.get(key)
                crc, at = _Crc32(), data_at
                for piece in ([value] if t is None else _pieces(t)):
                    raw = piece.contiguous().view(-1).view(torch.uint8).numpy()
                    fileio.pwrite(fd, raw, at)
                    crcs.feed(crc.extend, raw)
                    at += raw.nbytes
                crcs.drain()
                for where in crc_at:
                    fileio.pwrite(fd, struct.pack("<I", crc.value), where)

    atomic_write_with(path, fill, full_hint=f"free disk space in {path.parent}: the file takes about the tables' "
                                            f"bytes and the dense model's")
    return size[0]


class _Crc32:
    """A crc32 extended piece by piece, in order (``InOrder`` feeds it)."""

    def __init__(self):
        self.value = 0

    def extend(self, raw) -> None:
        self.value = zlib.crc32(raw, self.value)


def _pieces(t):
    step = max(1, PIECE_BYTES // max(t.config.row_bytes, 1))
    for lo in range(0, t.num_embeddings, step):
        yield t.snapshot(lo, min(lo + step, t.num_embeddings))


def _records(fd: int, state: dict) -> list[tuple[int, list[int]]]:
    """Per value of ``state``, in order: where its bytes go in the archive ``torch.save`` just
    wrote (a record ``data/<key>``, keys numbered in the order the pickle met the storages:
    the state's order, one storage each), and where its crc32 goes (the data descriptor after
    the bytes, and the central directory entry)."""
    with os.fdopen(os.dup(fd), "rb") as f, zipfile.ZipFile(f) as zf:  # (the file being written)
        infos = {i.filename.split("/", 1)[1]: i for i in zf.infolist()}
        start = zf.start_dir
    central = _central_entries(fd, start, len(infos))
    out = []
    for k, value in enumerate(state.values()):
        info = infos.get(f"data/{k}")
        if info is None or info.file_size != value.numel() * value.element_size():
            raise RuntimeError(f"export: torch.save's record data/{k} is not the state's value {k} "
                               f"({None if info is None else info.file_size} bytes)")
        head = os.pread(fd, _LOCAL.size, info.header_offset)
        sig, _, flags, _, n, m = _LOCAL.unpack(head)
        data_at = info.header_offset + _LOCAL.size + n + m
        # (torch's writer puts each record's crc32 in a data descriptor after its bytes --
        # signature, crc32, sizes -- and in the central directory; the local header's is 0)
        if not flags & 0x8 or os.pread(fd, 4, data_at + info.file_size) != b"PK\x07\x08":
            raise RuntimeError(f"export: record data/{k} has no data descriptor after its bytes")
        out.append((data_at, [data_at + info.file_size + 4, central[info.header_offset]]))
    return out


def _central_entries(fd: int, start: int, count: int) -> dict[int, int]:
    """The central directory's entries: local header offset -> where the entry's crc32 is."""
    out, at = {}, start
    for _ in range(count):
        sig, _, _, csize, usize, n, m, c, _, local = _CENTRAL.unpack(os.pread(fd, _CENTRAL.size, at))
        if sig != b"PK\x01\x02":
            raise RuntimeError("export: not a central directory entry where expected")
        if local == 0xFFFFFFFF:  # (zip64: the real offset is in the extra field, after the sizes that are)
            skip = 8 * ((usize == 0xFFFFFFFF) + (csize == 0xFFFFFFFF))
            local = _zip64_offset(os.pread(fd, m, at + _CENTRAL.size + n), skip)
        out[local] = at + 16
        at += _CENTRAL.size + n + m + c
    return out


def _zip64_offset(extra: bytes, skip: int) -> int:
    i = 0
    while i + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, i)
        if tag == 1:  # the zip64 extra field: the sizes that overflowed, then the local header offset
            return struct.unpack_from("<Q", extra, i + 4 + skip)[0]
        i += 4 + size
    raise RuntimeError("export: a zip64 central entry without its local header offset")
