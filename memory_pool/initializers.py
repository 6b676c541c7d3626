"""Table initialisation: deterministic in the seed, computable for any one row.

A row's initial value is a **counter-based hash** of ``(seed, row, column)``, not the next draws of
a generator's stream (initializer version :data:`INIT_VERSION`, recorded per table in the pool's
header: ``MemoryPool.create_table``). Two things follow:

* a table is initialised in blocks of :data:`INIT_BLOCK_ROWS` rows on a few threads (numpy
  releases the GIL), and a row's value depends on the seed, its row and the table's width only --
  not on the number of threads, the chunking or the tier -- so a table is initialised identically
  on every tier and on whichever rank holds it;
* a row never written since can be **created instead of read** (:func:`uniform_rows`): a DRAM
  cache in front of a table larger than DRAM makes a missed row that is still at its initial
  value from the hash, in microseconds, instead of reading its page from the device
  (``memory_pool/fresh.py``). On `kaggle` most misses of a run's first hundreds of steps are such
  rows (docs/tiering-measurements.md).

The hash: a 64-bit per-row key ``k = fmix64(fmix64(seed ^ C) + row * G)`` (splitmix64's
finaliser), then for column ``j`` the 32-bit ``z = fmix32(hi32(k) + j * G32)`` (murmur3's
finaliser); the top 24 bits of ``z`` are ``x`` uniform in ``[0, 1)`` in steps of 2^-24. The
distribution is TorchRec's default: uniform in ``[-scale, scale)``, ``x * 2 scale - scale`` in
float32. ``tests/test_pool.py`` checks it against this definition written out in Python integers.

Version 1 (pools made before 2026-12-05) drew blocks of 32k rows from one SFC64 stream each: one
row cost its block's prefix. Those pools keep their rows (they are stored); their header records
no initializer, so no row of theirs is ever created from a hash.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np
import torch

from ._native import rowhash
from .validation import env_int

__all__ = ["INIT_BLOCK_ROWS", "INIT_VERSION", "uniform_rows", "uniform_rows_numpy", "uniform_block", "uniform_chunks", "init_workers"]

INIT_BLOCK_ROWS = 1 << 15  # rows generated at a time by one thread (not part of any value's definition)
INIT_VERSION = 2          # the row hash above; 1: SFC64 blocks (stored pools only, never generated again)
_PIECE_FLOATS = 1 << 16    # floats generated and scaled at a time (256 KiB: in cache between the two)


def init_workers() -> int:
    """Threads a table's initialisation uses: the cores this process may run on, at most 8
    (``DLRM_CXL_INIT_THREADS`` overrides)."""
    env = env_int("DLRM_CXL_INIT_THREADS", lo=1, hint="unset DLRM_CXL_INIT_THREADS to use every core, or give e.g. 2")
    if env is not None:
        return env
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        n = os.cpu_count() or 1
    return max(1, min(8, n))


_G64 = np.uint64(0x9E3779B97F4A7C15)
_SEED_MIX = np.uint64(0x5851F42D4C957F2D)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_G32 = np.uint32(0x9E3779B9)
_C1, _C2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def _fmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place on uint64 (numpy's uint64 arithmetic wraps)."""
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def uniform_rows(seed: int, rows, dim: int, scale: float, out: np.ndarray | None = None, *,
                 at: np.ndarray | None = None) -> np.ndarray:
    """The initial values of rows ``rows`` (int64, any order) of a table initialised from
    ``seed``, uniform in ``[-scale, scale)``: float32 ``[len(rows), dim]``, into ``out`` if given
    (C-contiguous); with ``at`` (int64, one per row, each ``< len(out)``), row ``i`` goes to
    ``out[at[i]]`` instead. See the module for the definition.

    Computed by ``memory_pool/_rowhash.c`` when it was built (one pass, ~10x faster on a
    cache's ~100-row calls), else by :func:`uniform_rows_numpy`: the same bits."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    fn = rowhash()
    if out is None:
        if at is not None:
            raise ValueError("uniform_rows: at= needs out=, the rows it places")
        out = np.empty((rows.size, dim), dtype=np.float32)
    if at is not None:
        at = np.ascontiguousarray(at, dtype=np.int64)
        if at.shape != rows.shape or (at.size and (int(at.min()) < 0 or int(at.max()) >= out.shape[0])):
            raise ValueError(f"uniform_rows: {at.size} places for {rows.size} rows, or a place outside {out.shape[0]}")
    if out.dtype != np.float32 or out.ndim != 2 or out.shape[1] != dim or not out.flags.c_contiguous \
            or (at is None and out.shape[0] != rows.size):
        raise ValueError(f"uniform_rows: out must be C-contiguous float32 [rows, {dim}], got {out.dtype} {out.shape}")
    if fn is None:
        if at is None:
            return uniform_rows_numpy(seed, rows, dim, scale, out)
        out[at] = uniform_rows_numpy(seed, rows, dim, scale)
        return out
    if rows.size:
        fn(seed % (1 << 64), rows.ctypes.data, rows.size, dim, float(np.float32(2.0 * scale / (1 << 24))),
           float(np.float32(scale)), out.ctypes.data, at.ctypes.data if at is not None else None, dim)
    return out


def uniform_rows_numpy(seed: int, rows, dim: int, scale: float, out: np.ndarray | None = None) -> np.ndarray:
    """:func:`uniform_rows` in NumPy: the definition (the C one computes the same bits)."""
    rows = np.asarray(rows, dtype=np.int64)
    n = rows.size
    key = _fmix64(np.array([seed % (1 << 64)], dtype=np.uint64) ^ _SEED_MIX)
    k = rows.astype(np.uint64)
    k *= _G64
    k += key
    k = (_fmix64(k) >> np.uint64(32)).astype(np.uint32)
    out = np.empty((n, dim), dtype=np.float32) if out is None else out
    two_s = np.float32(2.0 * scale / (1 << 24))
    col = np.arange(dim, dtype=np.uint32) * _G32
    step = max(1, _PIECE_FLOATS // max(dim, 1))
    for a in range(0, n, step):  # (pieces that stay in cache between the passes)
        b = min(a + step, n)
        z = k[a:b, None] + col[None, :]
        t = np.empty_like(z)
        for shift, mul in ((16, _C1), (13, _C2), (16, None)):  # fmix32
            np.right_shift(z, shift, out=t)
            z ^= t
            if mul is not None:
                z *= mul
        z >>= np.uint32(8)
        piece = out[a:b]
        # x * 2 scale in float32: x (24 bits) is exact in float32, and float32's product of two
        # float32s is the exact product rounded once -- what float64's exact product rounded to
        # float32 is (this function's first form, uint32 * float32 promoting to float64: the
        # same bits for every x, checked over all 2^24, at 1/3 of the time).
        np.copyto(piece, z, casting="unsafe")
        np.multiply(piece, two_s, out=piece)
        np.subtract(piece, np.float32(scale), out=piece)
    return out


def uniform_block(seed: int, block: int, scale: float, out: np.ndarray) -> None:
    """Block ``block``'s rows of a table initialised from ``seed`` (rows ``block *
    INIT_BLOCK_ROWS`` on, as many as ``out`` [rows, dim] float32 C-contiguous has)."""
    a = block * INIT_BLOCK_ROWS
    uniform_rows(seed, np.arange(a, a + out.shape[0], dtype=np.int64), out.shape[1], scale, out)


def uniform_chunks(num_rows: int, dim: int, seed: int, scale: float, *,
                   dest: torch.Tensor | None = None, workers: int | None = None
                   ) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first_row, values [rows, dim] float32)`` for every block of a table, in row order,
    generated ``workers`` at a time, a few blocks ahead of the consumer. With ``dest`` (the
    table's own float32 [num_rows, dim] memory, contiguous) each block is generated in place and
    the values yielded are that view of ``dest``; without it each block gets a buffer of its own
    (the consumer writes it wherever the rows live)."""
    workers = init_workers() if workers is None else workers
    blocks = range(0, num_rows, INIT_BLOCK_ROWS)

    def make(a: int) -> torch.Tensor:
        b = min(a + INIT_BLOCK_ROWS, num_rows)
        out = dest[a:b] if dest is not None else torch.empty(b - a, dim, dtype=torch.float32)
        uniform_block(seed, a // INIT_BLOCK_ROWS, scale, out.numpy())
        return out

    if workers <= 1 or len(blocks) <= 1:
        for a in blocks:
            yield a, make(a)
        return
    ahead = 2 * workers  # blocks in flight: bounded, so that buffers stay a few MB each
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dlrm-cxl-init") as pool:
        pending: deque = deque()
        it = iter(blocks)
        try:
            for a in it:
                pending.append((a, pool.submit(make, a)))
                if len(pending) >= ahead:
                    a0, fut = pending.popleft()
                    yield a0, fut.result()
            while pending:
                a0, fut = pending.popleft()
                yield a0, fut.result()
        finally:
            for _, fut in pending:  # (the consumer stopped early: nothing more is started)
                fut.cancel()
