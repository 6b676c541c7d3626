"""Durable small files, for every package of the project: one home for the fsync ordering and
for checksummed JSON documents (pool.json, job.json, a shm region's OWNER).

The rule everywhere (after SQLite's atomic-commit write-up): a file that marks something as
done is written to a temporary name, fsynced, renamed over the real name, and then the directory
is fsynced — the rename is only durable once the directory entry is.

A checksummed JSON document carries ``crc32``: the crc32 of its canonical JSON (the object
without ``crc32``, sorted keys, compact separators), so reformatting never breaks it and any
changed value does.
"""

from __future__ import annotations

import errno
import json
import os
import zlib
from pathlib import Path
from typing import Callable

from . import fileio
from .errors import PoolCorruptError, PoolFullError, PoolIOError

__all__ = ["atomic_write", "atomic_write_with", "fsync_dir", "pwrite_all", "raise_if_full", "json_crc", "json_with_crc", "json_crc_ok", "parse_json_object",
           "FULL_ERRNOS"]

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})  # "the disk is full", in its forms


def raise_if_full(exc: OSError, what: str, *, hint: str | None = None) -> None:
    """Turn disk-full style OSErrors into :class:`PoolFullError` (``hint``: what to do, where
    its default -- raise the pool's capacity -- does not apply) and device errors (EIO) into
    :class:`PoolIOError`; re-raise anything else."""
    if exc.errno in FULL_ERRNOS:
        raise PoolFullError(f"{what}: {os.strerror(exc.errno)}", hint=hint) from exc
    if exc.errno == errno.EIO:
        raise PoolIOError(f"{what}: {os.strerror(exc.errno)}") from exc
    raise exc


# (Both through the I/O layer, memory_pool/fileio.py, which an emulated power loss watches.)
pwrite_all = fileio.pwrite
fsync_dir = fileio.fsync_dir


def atomic_write(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old or the new file."""
    atomic_write_with(path, lambda fd: fileio.pwrite(fd, data, 0), durable=durable)


def atomic_write_with(path: str | os.PathLike, fill: Callable[[int], None], *, durable: bool = True,
                      full_hint: str | None = None) -> None:
    """Replace ``path`` with what ``fill(fd)`` writes into a new file (``fd`` open for reading
    and writing, through :mod:`fileio`), so that a crash leaves either the old or the new file.
    Whatever stops it (an error, an interrupt) removes the new file and leaves the old one; a
    full disk is :class:`PoolFullError` (``full_hint``: see :func:`raise_if_full`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = fileio.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            fill(fd)
            if durable:
                fileio.fsync(fd)  # contents durable before the name points at them
        finally:
            fileio.close(fd)
        fileio.rename(tmp, path)
        if durable:
            fsync_dir(path.parent)  # the rename itself is durable only once the directory is
    except BaseException as exc:
        try:
            fileio.unlink(tmp, missing_ok=True)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise_if_full(exc, f"writing {path}", hint=full_hint)
        raise


def json_crc(body: dict) -> int:
    """crc32 of the canonical JSON of ``body`` (its ``crc32`` key, if any, left out)."""
    body = {k: v for k, v in body.items() if k != "crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def json_with_crc(body: dict, *, indent: int | None = None) -> bytes:
    """The bytes of ``body`` plus its ``crc32``, ready for :func:`atomic_write`."""
    body = {k: v for k, v in body.items() if k != "crc32"}
    return (json.dumps({**body, "crc32": json_crc(body)}, indent=indent, sort_keys=True) + "\n").encode()


def json_crc_ok(doc: dict) -> bool:
    """True when ``doc`` carries the right ``crc32`` for the rest of it."""
    return isinstance(doc, dict) and "crc32" in doc and doc["crc32"] == json_crc(doc)


def parse_json_object(raw: bytes, where, what: str, hint: str | None = None) -> dict:
    """``raw`` as a JSON object, or ``PoolCorruptError`` naming ``where`` and ``what`` (a
    truncated or damaged file: not JSON, or JSON but not an object)."""
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise PoolCorruptError(f"{where}: {what} is not valid JSON ({exc}): truncated or damaged", hint=hint) from None
    return doc
