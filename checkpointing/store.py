"""On-media formats of the checkpointer: undo-log slots, dense snapshots, the commit record.

Everything lives in ``<pool storage_dir>/ckpt/`` — the same tier as the table rows, so the log
survives exactly what the rows survive.

Undo-log slot (``undo/slot-NNNN.log``), reused round-robin once its step is no longer needed::

    [0, 64)        seal: magic "DCXUNDO1", step, payload_len, n_records, 0, crc32(seal)
    [4096, ...)    records, each: magic "REC1", step, name_len, row_bytes, n_rows, crc32,
                   then name, ids (int64 x n_rows), before-image bytes (n_rows x row_bytes)

Ordering rule: the payload is written and fdatasync'ed *before* the seal, and the seal is
fdatasync'ed before any row it covers is changed. So a slot whose seal names step k is a
complete, durable before-image of step k; a crash while the payload is being written leaves
the seal of the slot's previous (already committed, hence ignored) step. A seal that fails its
checksum, or a sealed payload that fails a record checksum, is damage: recovery refuses.

Dense snapshot (``dense-NNNNNNNNNNNN.pt``): a 32-byte header (magic "DCXDENS1", step, length,
crc32) and a ``torch.save`` payload, written to a temporary name, fsynced, renamed, directory
fsynced.

Commit record (``COMMIT``): JSON {step, dense_file, dense_crc32, crc32}, written last and the
same atomic way. It names the newest step at which the rows are durable (persisted), the dense
snapshot exists, and every undo record of later steps is retained.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from memory_pool._fs import atomic_write, fsync_dir, raise_if_full
from memory_pool.errors import PoolCorruptError

__all__ = ["SEAL", "REC", "SlotInfo", "UndoRecord", "write_slot", "scan_slots", "read_slot",
           "invalidate_slot", "write_dense", "read_dense", "write_commit", "read_commit", "ckpt_dir"]

SEAL = struct.Struct("<8sQQQII")
SEAL_MAGIC = b"DCXUNDO1"
PAYLOAD_OFFSET = 4096
REC = struct.Struct("<4sQHIQI")
REC_MAGIC = b"REC1"
DENSE = struct.Struct("<8sQQI4x")
DENSE_MAGIC = b"DCXDENS1"
COMMIT = "COMMIT"


def ckpt_dir(storage_dir: Path) -> Path:
    return Path(storage_dir) / "ckpt"


@dataclass
class UndoRecord:
    table: str
    ids: torch.Tensor      # int64 [n]
    before: torch.Tensor   # [n, dim] old values

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * 8 + self.before.numel() * self.before.element_size()


@dataclass
class SlotInfo:
    path: Path
    state: str        # "empty" | "sealed" | "damaged"
    step: int = -1
    payload_len: int = 0
    n_records: int = 0
    problem: str = ""


def _seal_bytes(step: int, payload_len: int, n_records: int) -> bytes:
    body = SEAL.pack(SEAL_MAGIC, step, payload_len, n_records, 0, 0)
    crc = zlib.crc32(body[:-4])
    return SEAL.pack(SEAL_MAGIC, step, payload_len, n_records, 0, crc)


def _record_parts(step: int, rec: UndoRecord) -> tuple[list, int]:
    name = rec.table.encode()
    ids = rec.ids.contiguous().numpy()
    data = rec.before.contiguous().view(torch.uint8).numpy()
    row_bytes = rec.before.shape[1] * rec.before.element_size()
    head_wo_crc = REC.pack(REC_MAGIC, step, len(name), row_bytes, ids.shape[0], 0)[:-4]
    crc = zlib.crc32(data, zlib.crc32(ids, zlib.crc32(name, zlib.crc32(head_wo_crc))))
    head = REC.pack(REC_MAGIC, step, len(name), row_bytes, ids.shape[0], crc)
    # Flattened first: a record of no rows (a table this step does not touch) is a [0, row_bytes]
    # array, and memoryview cannot cast a view with a zero in a multi-dimensional shape.
    parts = [head, name, memoryview(ids.reshape(-1)).cast("B"), memoryview(data.reshape(-1)).cast("B")]
    return parts, sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)


def write_slot(path: Path, step: int, records: list[UndoRecord],
               mid_write: Callable[[], None] | None = None) -> int:
    """Write the undo records of ``step`` into slot ``path``; durable when it returns.

    Returns payload bytes. ``mid_write`` runs after half the payload is written (crash tests).
    """
    parts, total = [], 0
    for r in records:
        p, n = _record_parts(step, r)
        parts.extend(p)
        total += n
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        off = PAYLOAD_OFFSET
        half = len(parts) // 2
        for i, part in enumerate(parts):
            if mid_write is not None and i == half:
                mid_write()
            view = memoryview(part).cast("B")
            while view:
                n = os.pwrite(fd, view, off)
                off += n
                view = view[n:]
        # Payload durable first: only then may a seal vouch for it.
        os.fdatasync(fd)
        os.pwrite(fd, _seal_bytes(step, total, len(records)), 0)
        # Seal durable before the caller changes any row it covers (the write-ahead rule).
        os.fdatasync(fd)
    except OSError as exc:
        raise_if_full(exc, f"writing undo log {path}")
    finally:
        os.close(fd)
    return total


def _read_seal(path: Path) -> SlotInfo:
    with open(path, "rb") as f:
        raw = f.read(SEAL.size)
    if not raw or raw == b"\0" * SEAL.size:
        return SlotInfo(path, "empty")
    if len(raw) < SEAL.size:
        # write_slot writes the payload at PAYLOAD_OFFSET first, so a slot that was ever written
        # is either empty (created, nothing written yet) or longer than the seal. A shorter file
        # is a truncated one, whose seal may have covered rows changed in place: damage.
        return SlotInfo(path, "damaged", problem=f"{path.name}: truncated to {len(raw)} bytes (seal cut off)")
    magic, step, plen, nrec, _, crc = SEAL.unpack(raw)
    if magic != SEAL_MAGIC or zlib.crc32(raw[:-4]) != crc:
        return SlotInfo(path, "damaged", problem=f"{path.name}: seal fails its checksum")
    return SlotInfo(path, "sealed", step, plen, nrec)


def scan_slots(undo_dir: Path) -> list[SlotInfo]:
    if not undo_dir.is_dir():
        return []
    return [_read_seal(p) for p in sorted(undo_dir.glob("slot-*.log"))]


def read_slot(info: SlotInfo) -> list[UndoRecord]:
    """Every record of a sealed slot, verified; PoolCorruptError on any damage or truncation."""
    with open(info.path, "rb") as f:
        f.seek(PAYLOAD_OFFSET)
        payload = f.read(info.payload_len)
    where = f"undo log {info.path.name} (step {info.step})"
    if len(payload) != info.payload_len:
        raise PoolCorruptError(f"{where}: truncated: {len(payload)} of {info.payload_len} bytes")
    out, off = [], 0
    mv = memoryview(payload)
    for i in range(info.n_records):
        if off + REC.size > len(payload):
            raise PoolCorruptError(f"{where}: record {i} truncated")
        magic, step, nlen, row_bytes, n, crc = REC.unpack_from(payload, off)
        if magic != REC_MAGIC or step != info.step:
            raise PoolCorruptError(f"{where}: record {i} has a bad header")
        end = off + REC.size + nlen + 8 * n + row_bytes * n
        if end > len(payload):
            raise PoolCorruptError(f"{where}: record {i} runs past the payload")
        body = mv[off + REC.size:end]
        if zlib.crc32(body, zlib.crc32(mv[off:off + REC.size - 4])) != crc:
            raise PoolCorruptError(f"{where}: record {i} fails its checksum (bit flip or torn write)")
        name = bytes(body[:nlen]).decode()
        ids = torch.frombuffer(bytearray(body[nlen:nlen + 8 * n]), dtype=torch.int64) if n else torch.empty(0, dtype=torch.int64)
        data = torch.frombuffer(bytearray(body[nlen + 8 * n:]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out.append(UndoRecord(name, ids, data.view(n, row_bytes)))  # raw bytes; caller views as dtype
        off = end
    if off != len(payload):
        raise PoolCorruptError(f"{where}: {len(payload) - off} stray bytes after the last record")
    return out


def invalidate_slot(path: Path) -> None:
    """Zero a slot's seal, durably: its step will never be rolled back again."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"\0" * SEAL.size, 0)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def write_dense(directory: Path, step: int, state: dict, mid_write: Callable[[], None] | None = None) -> tuple[str, int, int]:
    """Durably write a dense snapshot; returns (file name, crc32, bytes)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    crc = zlib.crc32(payload)
    name = f"dense-{step:012d}.pt"
    path = directory / name
    tmp = directory / f".{name}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, DENSE.pack(DENSE_MAGIC, step, len(payload), crc))
            half = len(payload) // 2
            view = memoryview(payload)
            pos = 0
            while pos < len(payload):
                if mid_write is not None and pos >= half:
                    mid_write()
                    mid_write = None
                pos += os.write(fd, view[pos:min(len(payload), pos + max(1, half))])
            os.fsync(fd)  # contents before the name
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(directory)  # the name before the COMMIT record that points at it
    except OSError as exc:
        raise_if_full(exc, f"writing dense snapshot {path}")
    return name, crc, DENSE.size + len(payload)


def read_dense(path: Path, expect_crc: int | None = None) -> dict:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PoolCorruptError(f"dense snapshot {path} is missing") from None
    if len(raw) < DENSE.size:
        raise PoolCorruptError(f"dense snapshot {path.name} is truncated")
    magic, step, n, crc = DENSE.unpack_from(raw)
    payload = memoryview(raw)[DENSE.size:]
    if magic != DENSE_MAGIC or len(payload) != n:
        raise PoolCorruptError(f"dense snapshot {path.name} is truncated or not a snapshot")
    if zlib.crc32(payload) != crc or (expect_crc is not None and crc != expect_crc):
        raise PoolCorruptError(f"dense snapshot {path.name} fails its checksum")
    return torch.load(io.BytesIO(payload), weights_only=False)


def write_commit(directory: Path, step: int, dense_file: str, dense_crc: int, extra: dict | None = None) -> None:
    body = {"step": step, "dense_file": dense_file, "dense_crc32": dense_crc, **(extra or {})}
    crc = zlib.crc32(json.dumps(body, sort_keys=True).encode())
    atomic_write(directory / COMMIT, json.dumps({**body, "crc32": crc}, sort_keys=True).encode())


def read_commit(directory: Path) -> dict | None:
    p = directory / COMMIT
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        body = {k: v for k, v in doc.items() if k != "crc32"}
        ok = zlib.crc32(json.dumps(body, sort_keys=True).encode()) == doc["crc32"]
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise PoolCorruptError(f"commit record {p} is damaged (checksum)")
    return doc
