"""Thin ctypes bindings: libc ``msync`` and, when installed, PMDK's libpmem.

libpmem (Debian ``libpmem1``) is optional. When present, persisting a range of a mapping goes
through ``pmem_persist`` if the range is real persistent memory (``pmem_is_pmem``: a DAX
mapping, flushed with cache-line flushes from user space) and ``pmem_msync`` otherwise. Without
it we call ``msync(MS_SYNC)`` ourselves. Both paths take page-unaligned ranges.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

__all__ = ["PAGE", "libpmem", "msync_range", "LibPmem"]

PAGE = mmap.PAGESIZE
_MS_SYNC = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.msync.restype = ctypes.c_int


def msync_range(addr: int, length: int) -> None:
    """msync(MS_SYNC) the pages covering [addr, addr+length)."""
    if length <= 0:
        return
    start = addr - (addr % PAGE)
    if _libc.msync(ctypes.c_void_p(start), ctypes.c_size_t(addr + length - start), _MS_SYNC) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"msync failed: {os.strerror(err)}")


class LibPmem:
    """The few libpmem calls we use. Construct with :func:`libpmem`."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        self._lib = lib
        lib.pmem_is_pmem.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_is_pmem.restype = ctypes.c_int
        lib.pmem_persist.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_persist.restype = None
        lib.pmem_msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_msync.restype = ctypes.c_int

    def is_pmem(self, addr: int, length: int) -> bool:
        return bool(self._lib.pmem_is_pmem(ctypes.c_void_p(addr), ctypes.c_size_t(length)))

    def persist(self, addr: int, length: int, is_pmem: bool) -> None:
        if length <= 0:
            return
        if is_pmem:
            self._lib.pmem_persist(ctypes.c_void_p(addr), ctypes.c_size_t(length))
        elif self._lib.pmem_msync(ctypes.c_void_p(addr), ctypes.c_size_t(length)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pmem_msync failed: {os.strerror(err)}")


_cached: list = []


def libpmem() -> LibPmem | None:
    """The loaded libpmem, or None when it is not installed (or DLRM_CXL_NO_LIBPMEM=1)."""
    if os.environ.get("DLRM_CXL_NO_LIBPMEM") == "1":
        return None
    if not _cached:
        name = ctypes.util.find_library("pmem")
        lib = None
        if name:
            try:
                lib = LibPmem(ctypes.CDLL(name, use_errno=True), name)
            except (OSError, AttributeError):
                lib = None
        _cached.append(lib)
    return _cached[0]
