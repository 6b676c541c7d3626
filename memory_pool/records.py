"""Payload formats of journal records, and their checksum.

``ROWS`` and ``UNDO`` records share one layout (:func:`encode_rows` / :func:`decode_rows`)::

    u16 name length, u32 row bytes, u64 n rows, name (utf-8), n x i64 ids, n x row bytes

Every payload (and every record header) is protected by crc32c (:func:`crc32c`, hardware
accelerated through google-crc32c).
"""

from __future__ import annotations

import struct
import warnings
from typing import Iterable

import google_crc32c
import numpy as np
import torch

# Payloads are decoded from read-only mappings of journal segments (torch.frombuffer warns about
# non-writable buffers; the tensors are only read, and copied by whoever keeps them).
warnings.filterwarnings("ignore", message="The given buffer is not writable")

__all__ = ["ROWS_HEAD", "encode_rows", "decode_rows", "crc32c"]

ROWS_HEAD = struct.Struct("<HIQ")         # name length, row bytes, n rows


def crc32c(parts: Iterable, crc: int = 0) -> int:
    for p in parts:
        # the C extension takes bytes or numpy arrays, not writable memoryviews/bytearrays
        crc = google_crc32c.extend(crc, p if isinstance(p, bytes) else np.frombuffer(p, dtype=np.uint8))
    return crc


def encode_rows(name: str, ids: torch.Tensor, rows: torch.Tensor) -> list:
    """Payload parts of a ROWS/UNDO record: name, ids (int64), raw row bytes. No copy of ``rows``."""
    nb = name.encode()
    ids = ids.to(torch.int64).contiguous()
    data = rows.contiguous().view(torch.uint8).reshape(ids.numel(), -1) if ids.numel() else rows.new_empty(0, dtype=torch.uint8)
    row_bytes = data.shape[1] if ids.numel() else rows.shape[-1] * rows.element_size()
    return [ROWS_HEAD.pack(len(nb), row_bytes, ids.numel()) + nb,
            memoryview(ids.numpy()).cast("B"), memoryview(data.reshape(-1).numpy()).cast("B")]


def decode_rows(payload) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(table name, ids int64 [n], raw rows uint8 [n, row_bytes]) of a ROWS/UNDO payload."""
    mv = memoryview(payload)
    nlen, row_bytes, n = ROWS_HEAD.unpack_from(mv)
    p = ROWS_HEAD.size
    name = bytes(mv[p:p + nlen]).decode()
    p += nlen
    if len(mv) != p + 8 * n + row_bytes * n:
        raise ValueError(f"row record of {len(mv)} bytes does not hold {n} rows of {row_bytes} bytes")
    ids = torch.frombuffer(mv[p:p + 8 * n], dtype=torch.int64) if n else torch.empty(0, dtype=torch.int64)
    p += 8 * n
    data = (torch.frombuffer(mv[p:], dtype=torch.uint8).view(n, row_bytes) if n
            else torch.empty(0, row_bytes, dtype=torch.uint8))
    return name, ids, data
