"""A pool directory's writer lock, ``DIR/LOCK``: an ``flock`` on that file, in one place.

Exactly one writer at a time holds it exclusively (and writes its pid into the file); a reader
that must not see a step half applied holds it shared. Every attempt is non-blocking. The lock
belongs to the open file description: closing the descriptor releases it, and the kernel drops
it when the holder dies, even by SIGKILL, so a crashed writer never leaves a stale lock behind.

:func:`take_lock` is what a pool's open and create take (``memory_pool/pooldir.py``);
:func:`try_lock` and :func:`lock_holder` are its parts; :func:`lock_held` probes the lock without
taking it (``lifecycle``'s region status, ``dlrm-cxl train`` on a pool already at its step,
``dlrm-cxl destroy`` of a job).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import PoolLockedError

__all__ = ["LOCK_FILE", "try_lock", "lock_holder", "lock_held", "take_lock"]

LOCK_FILE = "LOCK"


def try_lock(fd: int, *, shared: bool = False) -> bool:
    """Take the lock of the open ``LOCK`` file ``fd`` without waiting (exclusive, or ``shared``):
    True when taken, False when another open file holds it. Any other error is raised."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_holder(pool_dir: str | os.PathLike) -> str:
    """The pid the writer wrote into ``pool_dir/LOCK``; ``""`` when it cannot be read."""
    try:
        return (Path(pool_dir) / LOCK_FILE).read_text().strip()
    except OSError:
        return ""


def lock_held(pool_dir: str | os.PathLike) -> bool | None:
    """True when a process holds ``pool_dir/LOCK`` (a writer, or a reader's shared lock), False
    when none does or there is no ``LOCK`` file, None when it cannot be tried (the file cannot
    be opened or locked). Changes nothing: a non-blocking flock released at once, on a
    descriptor opened read-only (flock needs no write access), and ``LOCK`` is never created."""
    try:
        fd = os.open(Path(pool_dir) / LOCK_FILE, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return None
    try:
        return not try_lock(fd)
    except OSError:
        return None
    finally:
        os.close(fd)  # (also releases the probe's lock)


def take_lock(path: Path, *, shared: bool = False) -> int | None:
    """The writer lock (exclusive), or a reader's shared lock, of pool directory ``path``; the
    open descriptor (close it to release the lock). ``LOCK`` is made if missing. The writer
    writes its pid into it. Raises ``PoolLockedError`` when it is held; a shared lock on a
    directory no one can write to is None (no writer there either)."""
    if shared:
        try:
            fd = os.open(path / LOCK_FILE, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            return None  # a directory no one can write to has no writer either
    else:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    if not try_lock(fd, shared=shared):
        os.close(fd)
        holder = lock_holder(path)
        if shared:
            raise PoolLockedError(
                f"{path} is being trained (writer pid {holder or '?'}): a reader beside it could see a step "
                f"half applied", hint="wait until training stops (or use `inspect --no-digest`)")
        raise PoolLockedError(f"{path} is locked by another writer (pid {holder or '?'}) or held by a "
                              f"reader (inspect, eval, export)")
    if not shared:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
