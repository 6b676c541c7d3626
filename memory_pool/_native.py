"""Thin ctypes bindings: PMDK's libpmem, when installed; this package's own C functions (the
row hash, ``memory_pool/_rowhash.c``; the step's row sets, ``memory_pool/_rowsets.c``; a
compaction's newest rows, ``memory_pool/_newest.c``), when they were built.

libpmem (Debian ``libpmem1``) is optional. When present, persisting a range of a mapping goes
through ``pmem_persist`` if the range is real persistent memory (``pmem_is_pmem``: a DAX
mapping, flushed with cache-line flushes from user space) and ``pmem_msync`` otherwise. Without
it a pmem pool is emulated through the journal (``memory_pool/tiers.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.machinery
import os
from pathlib import Path

__all__ = ["libpmem", "LibPmem", "LIBPMEM", "rowhash", "distinct_rows", "first_touch", "newest_places",
           "copy_rows_at"]

LIBPMEM = "libpmem"   # PMDK's library, as the dynamic linker names it


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
        name = ctypes.util.find_library(LIBPMEM.removeprefix("lib"))  # (it takes the name without "lib")
        lib = None
        if name:
            try:
                lib = LibPmem(ctypes.CDLL(name, use_errno=True), name)
            except (OSError, AttributeError):
                lib = None
        _cached.append(lib)
    return _cached[0]


def _load(stem: str, symbol: str, restype, argtypes: list, *, keep_gil: bool = False):
    """``symbol`` of this package's C library ``stem`` (built by ``setup.py`` beside its
    source), or None when it was not built. The call lets go of the GIL (``ctypes.CDLL``)
    unless ``keep_gil`` (``ctypes.PyDLL``: for a call of tens of microseconds on the trainer's
    thread, which would otherwise hand the GIL to the prefetch thread and wait to get it back)."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{stem}{suffix}"
        if path.exists():
            try:
                fn = getattr((ctypes.PyDLL if keep_gil else ctypes.CDLL)(str(path)), symbol)
            except (OSError, AttributeError):
                continue
            fn.restype = restype
            fn.argtypes = argtypes
            return fn
    return None


_loaded: dict = {}


def _once(stem: str, symbol: str, restype, argtypes: list, *, keep_gil: bool = False):
    """:func:`_load`, once per symbol; None whenever ``DLRM_CXL_NO_NATIVE=1``."""
    if os.environ.get("DLRM_CXL_NO_NATIVE") == "1":
        return None
    if symbol not in _loaded:
        _loaded[symbol] = _load(stem, symbol, restype, argtypes, keep_gil=keep_gil)
    return _loaded[symbol]


_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def rowhash():
    """``dlrm_uniform_rows`` of ``memory_pool/_rowhash.c`` (see there), or None when it was not
    built (no C compiler at install: ``setup.py`` makes it optional) or ``DLRM_CXL_NO_NATIVE=1``
    (then NumPy computes the same values: ``memory_pool.initializers``)."""
    return _once("_rowhash", "dlrm_uniform_rows", None,
                 [ctypes.c_uint64, _P, _I64, _I64, ctypes.c_float, ctypes.c_float, _P, _P, _I64])


def distinct_rows():
    """``dlrm_distinct_rows`` of ``memory_pool/_rowsets.c``, or None (as :func:`rowhash`; then
    NumPy's sort computes the same rows: ``memory_pool.rowsets``)."""
    return _once("_rowsets", "dlrm_distinct_rows", _I64, [_P, _I64, _P, _I64, _P, _P, _P, _P])


def first_touch():
    """``dlrm_first_touch`` of ``memory_pool/_rowsets.c``, or None (as :func:`distinct_rows`).
    Keeps the GIL: ~50 us on the trainer's thread."""
    return _once("_rowsets", "dlrm_first_touch", _I64, [_P, _I64, _P, _I64, _P], keep_gil=True)


def newest_places():
    """``dlrm_newest_places`` of ``memory_pool/_newest.c``, or None (as :func:`rowhash`; then
    torch computes the same plan: ``memory_pool.newest.newest_places``)."""
    return _once("_newest", "dlrm_newest_places", _I64, [_P, _I64, _I64, _P, _P, _P, _P, _P, _P])


def copy_rows_at():
    """``dlrm_copy_rows_at`` of ``memory_pool/_newest.c``, or None (as :func:`newest_places`;
    then ``index_select`` and ``index_copy_``: ``memory_pool.records.copy_rows_at``)."""
    return _once("_newest", "dlrm_copy_rows_at", _I64, [_P, _I64, _P, _P, _I64, _P, _I64, _I64])
