"""Durable file primitives shared by the pool and the checkpointer.

The rule everywhere (after SQLite's atomic-commit write-up): a file that marks something as
done is written to a temporary name, fsynced, renamed over the real name, and then the directory
is fsynced — the rename is only durable once the directory entry is.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .errors import PoolFullError

__all__ = ["atomic_write", "fsync_dir", "raise_if_full"]

_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def raise_if_full(exc: OSError, what: str) -> None:
    """Turn disk-full style OSErrors into :class:`PoolFullError`; re-raise anything else."""
    if exc.errno in _FULL_ERRNOS:
        raise PoolFullError(f"{what}: {os.strerror(exc.errno)}") from exc
    raise exc


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old or the new file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if durable:
                os.fsync(fd)  # contents durable before the name points at them
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)  # the rename itself is durable only once the directory is
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise_if_full(exc, f"writing {path}")
