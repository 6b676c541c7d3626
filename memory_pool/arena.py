"""One contiguous range of virtual memory holding every table of a pool.

fbgemm's table-batched embedding kernels take *one* flat weight tensor and an element offset per
table (``weights_offsets``), and one flat optimizer-state tensor likewise. To run them in place
on pool memory without copying and without changing the on-media layout (one file per table),
the pool reserves one range of address space (``PROT_NONE``, nothing committed) and maps each
table's file (or anonymous memory, for ``dram``) into it with ``MAP_FIXED`` at a page-aligned
offset. :meth:`Arena.flat` is then a tensor over the whole range: every table is a slice of it,
and a kernel that writes row ``r`` of table ``t`` at ``offset[t] + r * dim`` writes the table's
own mapping.

Lifetime: tensors made by :meth:`Arena.tensor` (and buffers by :meth:`Arena.buffer`) keep the
arena object alive (through the buffer they were made from), and the range is unmapped only when
the last of them is gone, so a view used after ``pool.close()`` never touches unmapped memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

__all__ = ["Arena", "PAGE", "page_round", "populated"]

PAGE = mmap.PAGESIZE
_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, mmap.PROT_READ, mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE, _MAP_ANON = mmap.MAP_SHARED, mmap.MAP_PRIVATE, mmap.MAP_ANONYMOUS
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_RANDOM = 1
_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MADV_PAGEOUT = 21


def adjacent_runs(idx: torch.Tensor) -> tuple[list[int], list[int]]:
    """``(firsts, lasts)`` of the runs of adjacent indexes in ``idx`` (sorted, distinct, not
    empty): one read request each, for the callers that ask for pages or blocks ahead."""
    brk = torch.nonzero(idx[1:] != idx[:-1] + 1).flatten() + 1
    return torch.cat([idx[:1], idx[brk]]).tolist(), torch.cat([idx[brk - 1], idx[-1:]]).tolist()


def will_need(addr: int, nbytes: int) -> bool:
    """``MADV_WILLNEED`` over ``[addr, addr + nbytes)`` (``addr`` page-aligned) of a file mapping:
    the kernel starts reading the pages not in the page cache and returns (``vfs_fadvise``'s
    ``WILLNEED``). Advice only: returns whether it was taken."""
    return _libc.madvise(addr, page_round(max(nbytes, 1)), _MADV_WILLNEED) == 0


def page_round(n: int) -> int:
    return -(-n // PAGE) * PAGE


def populated(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh anonymous memory (uint8), its pages made present by one call
    (``MAP_POPULATE``), not by a fault each, for a large buffer about to be filled whole. On
    this VM a first fault costs ~1.9 us a page and populating ~1 us (256 MB: 0.12 against
    0.065 s of CPU; allocated and filled by a scattered copy, 0.235 against 0.20 s). Below
    1 MiB, ``torch.empty``. The memory goes with the last view of it."""
    if nbytes < (1 << 20):
        return torch.empty(nbytes, dtype=torch.uint8)
    m = mmap.mmap(-1, page_round(nbytes), flags=_MAP_PRIVATE | _MAP_ANON | getattr(mmap, "MAP_POPULATE", 0))
    return torch.frombuffer(m, dtype=torch.uint8)[:nbytes]


def _mmap(addr, length, prot, flags, fd=-1, off=0) -> int:
    p = _libc.mmap(addr, length, prot, flags, fd, off)
    if p is None or p == _FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes failed: {os.strerror(err)}")
    return p


class Arena:
    """A reserved range of ``capacity`` bytes; tables are placed in it with :meth:`place`."""

    def __init__(self, capacity: int):
        self.capacity = page_round(max(capacity, PAGE))
        # Reserve only: no access, no memory, no swap accounted (NORESERVE).
        self.base = _mmap(None, self.capacity, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE)
        self.used = 0
        self._flat: torch.Tensor | None = None

    def place(self, nbytes: int) -> int | None:
        """A page-aligned offset for ``nbytes`` more bytes, or None when the range is full."""
        off = self.used
        if off + page_round(nbytes) > self.capacity:
            return None
        self.used = off + page_round(nbytes)
        return off

    def map_file(self, offset: int, fd: int, nbytes: int, *, shared: bool, writable: bool, file_offset: int = 0) -> int:
        """Map ``fd`` (``nbytes`` long, from its page-aligned ``file_offset``) at ``offset``.
        ``shared``: stores reach the file's page cache (MAP_SHARED); else copy-on-write
        (MAP_PRIVATE): stores stay in this process."""
        prot = _PROT_READ | (_PROT_WRITE if writable or not shared else 0)
        flags = (_MAP_SHARED if shared else _MAP_PRIVATE) | _MAP_FIXED
        return _mmap(self.base + offset, max(nbytes, 1), prot, flags, fd, file_offset)

    def advise_random(self, offset: int, nbytes: int) -> None:
        """``MADV_RANDOM`` over ``[offset, offset + nbytes)``: a fault there reads its own page
        of the file, not a readahead window around it (rows read a few at a time from a home far
        larger than the DRAM budget would otherwise bring their neighbours into the page cache)."""
        _libc.madvise(self.base + offset, page_round(max(nbytes, 1)), _MADV_RANDOM)

    def drop_pages(self, offset: int, nbytes: int) -> bool:
        """``MADV_DONTNEED`` over ``[offset, offset + nbytes)``: its pages are unmapped where they
        are; a private file mapping's copy-on-write pages are discarded, and a later access reads
        the file (its page cache) again. The mapping itself stays. First ``MADV_PAGEOUT`` (Linux
        5.4): the clean file pages mapped only here are reclaimed, dropped from the page cache
        without writing anything back. Returns whether that was done."""
        addr, n = self.base + offset, page_round(max(nbytes, 1))
        reclaimed = _libc.madvise(addr, n, _MADV_PAGEOUT) == 0
        if _libc.madvise(addr, n, _MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
        return reclaimed

    def release(self, offset: int, nbytes: int) -> None:
        """Give ``[offset, offset + nbytes)`` back to the reservation: a file mapped there is
        unmapped (its pages and, once deleted, its blocks are freed); nothing may read it after."""
        _mmap(self.base + offset, page_round(max(nbytes, 1)), _PROT_NONE,
              _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE | _MAP_FIXED)

    def map_anon(self, offset: int, nbytes: int) -> int:
        return _mmap(self.base + offset, page_round(max(nbytes, 1)), _PROT_READ | _PROT_WRITE,
                     _MAP_PRIVATE | _MAP_ANON | _MAP_FIXED)

    def buffer(self, offset: int, nbytes: int) -> ctypes.Array:
        """``[offset, offset + nbytes)`` of the arena as a ctypes char array (no copy) that keeps
        the arena, and so its mappings, alive for as long as it or a view made from it lives."""
        buf = (ctypes.c_char * nbytes).from_address(self.base + offset)
        buf.owner = self  # the view holds buf, buf holds the arena: unmapped after the last view
        return buf

    def tensor(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor over [offset, offset + nbytes) of the arena (no copy)."""
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.buffer(offset, nbytes), dtype=dtype)

    def flat(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole used range as one flat tensor (what fbgemm's kernels index with offsets)."""
        return self.tensor(0, self.used, dtype)

    def rows_at_every_offset(self, row_bytes: int) -> torch.Tensor:
        """Every ``row_bytes``-long run of the used range's bytes, one per byte offset: a
        ``[used - row_bytes + 1, row_bytes]`` uint8 view (no copy), so that rows at any offset
        (a journal or a run does not align them) are gathered with one ``index_select``,
        whatever record, segment or run they are in."""
        flat = self.tensor(0, self.used, torch.uint8)
        return flat.as_strided((flat.numel() - row_bytes + 1, row_bytes), (1, 1))

    def __del__(self):
        try:
            _libc.munmap(self.base, self.capacity)
        except Exception:
            pass
