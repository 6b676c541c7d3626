"""Sets of rows a step touches, computed once per step: a batch's distinct rows in one numbering
over a group of tables (the plan's, ``dlrm_cxl.model``: table ``f``'s row ``r`` is
``base[f] + r``), and a recovery window's first touches (``checkpointing.window``).

Computed by ``memory_pool/_rowsets.c`` when it was built (a bitmap instead of a sort: on
`small`'s 53k ids a step 0.18 against 0.87 ms of one thread; on `kaggle`'s 0.39 against 1.06),
else with NumPy: :func:`distinct_sorted` and :func:`first_touch_numpy` are the definitions, and
``tests/test_rowsets.py`` checks that both give the same arrays.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ._native import distinct_rows as _c_distinct
from ._native import first_touch as _c_first_touch

__all__ = ["DistinctRows", "distinct_sorted", "first_touch", "first_touch_numpy", "isin_sorted"]


def isin_sorted(a: torch.Tensor, sorted_b: torch.Tensor) -> torch.Tensor:
    """``a[i] in sorted_b`` for every i (``sorted_b`` sorted ascending): a bool mask over ``a``."""
    if not sorted_b.numel() or not a.numel():
        return torch.zeros(a.numel(), dtype=torch.bool)
    pos = torch.searchsorted(sorted_b, a).clamp_(max=sorted_b.numel() - 1)
    return sorted_b[pos] == a


def distinct_sorted(ids, *, narrow: bool = False) -> torch.Tensor:
    """The distinct values of ``ids`` (1-D integers: a tensor or a NumPy array), sorted, as a CPU
    int64 tensor: ``torch.unique(ids, sorted=True)``, with a sort and a neighbour mask.
    ``narrow``: every value fits in int32 (4-byte keys sort faster).

    Which sort: torch's, measured on `small`'s 53k ids a step (one thread, best of 7 over 32
    batches, 2026-12-05, AMD EPYC with AVX-512): 0.59 ms with the mask, against 1.10 for NumPy's
    and ~0.8 for ``torch.unique``. (On 2026-12-03's host NumPy's took 0.39: the sorts' ranking is
    the CPU's; torch's has the smaller spread.)"""
    t = torch.as_tensor(ids).cpu()
    if narrow and t.dtype != torch.int32:
        t = t.to(torch.int32)
    s = torch.sort(t).values.numpy()
    if s.size:
        keep = np.empty(s.size, dtype=bool)
        keep[0] = True
        np.not_equal(s[1:], s[:-1], out=keep[1:])
        s = s[keep]
    return torch.from_numpy(s.astype(np.int64, copy=False))


class DistinctRows:
    """The distinct rows of a batch's ids in one numbering over tables with ``base`` (int64
    ``[F + 1]``: table ``f`` holds rows ``base[f]..base[f + 1]``), sorted: what the plan of every
    step needs once (the undo log's rows, the write-back cache's dirty marks, the DRAM cache's
    lookahead). Keeps two bitmaps (a bit a row, and a bit per 64 rows: ``base[-1] / 8`` bytes,
    4.2 MB for `kaggle`'s 34M rows) that are all zero between calls; one call at a time (a lock:
    the plan runs on the prefetch thread, a replay's on the trainer's)."""

    def __init__(self, base):
        self.base = np.ascontiguousarray(np.asarray(base, dtype=np.int64))
        if self.base.ndim != 1 or self.base.size < 1 or self.base[0] != 0 or (np.diff(self.base) < 0).any():
            raise ValueError(f"DistinctRows: base must start at 0 and never decrease, got {self.base.tolist()[:8]}")
        self._lock = threading.Lock()
        self._bits: np.ndarray | None = None   # (allocated at the first call that uses C)
        self._summary: np.ndarray | None = None

    def __call__(self, values: torch.Tensor, lengths) -> torch.Tensor:
        """``values``: 1-D integer ids, table 0's ``lengths[0]`` first, then table 1's, ...;
        each within its table (``ValueError`` naming the first that is not). Returns the
        distinct rows in the one numbering, sorted (int64)."""
        lengths = np.ascontiguousarray(np.asarray(lengths, dtype=np.int64))
        if lengths.shape != (self.base.size - 1,) or int(lengths.sum()) != values.numel():
            raise ValueError(f"DistinctRows: {lengths.size} lengths summing to {int(lengths.sum())} "
                             f"for {self.base.size - 1} tables and {values.numel()} ids")
        fn = _c_distinct()
        if fn is None:
            return self._numpy(values, lengths)
        ids = values.to(device="cpu", dtype=torch.int64).contiguous()   # (its address is read in C)
        out = np.empty(ids.numel(), dtype=np.int64)
        with self._lock:
            if self._bits is None:
                words = (int(self.base[-1]) + 63) // 64
                self._bits = np.zeros(words, dtype=np.uint64)
                self._summary = np.zeros((words + 63) // 64, dtype=np.uint64)
            n = fn(ids.data_ptr(), ids.numel(), lengths.ctypes.data, lengths.size, self.base.ctypes.data,
                   self._bits.ctypes.data, self._summary.ctypes.data, out.ctypes.data)
        if n < 0:
            self._refuse(ids, lengths, -n - 1)
        return torch.from_numpy(out[:n])

    def _numpy(self, values: torch.Tensor, lengths: np.ndarray) -> torch.Tensor:
        """The definition: each table's ids shifted by its base, then one sort."""
        v = values.cpu().numpy()
        if v.size:
            bad = np.flatnonzero((v < 0) | (v >= np.repeat(np.diff(self.base), lengths)))
            if bad.size:
                self._refuse(values, lengths, int(bad[0]))
        narrow = int(self.base[-1]) < 2**31
        shifted = v.astype(np.int32 if narrow else np.int64)
        shifted += np.repeat(self.base[:-1].astype(shifted.dtype), lengths)
        return distinct_sorted(shifted)

    def _refuse(self, values: torch.Tensor, lengths: np.ndarray, i: int):
        f = int(np.searchsorted(np.cumsum(lengths), i, side="right"))
        raise ValueError(f"id {int(values[i])} (position {i}) is outside table {f}'s "
                         f"{int(self.base[f + 1] - self.base[f])} rows")


def first_touch_numpy(rows: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """The definition of :func:`first_touch`."""
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= seen.size):
        bad = rows[(rows < 0) | (rows >= seen.size)][0]
        raise ValueError(f"first_touch: row {int(bad)} outside a map of {seen.size} rows")
    new = rows[~seen[rows]] if rows.size else rows
    if new.size:
        seen[new] = True
    return new


def first_touch(rows: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """Of ``rows`` (distinct integers, each ``< len(seen)``: ``ValueError`` otherwise, nothing
    marked), those whose mark in ``seen`` (a contiguous bool map) is not set, in order; their
    marks are set. Returns ``rows`` itself when every one is new and it is contiguous int64."""
    if seen.dtype != np.bool_ or not seen.flags.c_contiguous:
        raise ValueError(f"first_touch: the map must be a contiguous bool array, got {seen.dtype}")
    fn = _c_first_touch()
    if fn is None or not rows.size:
        return first_touch_numpy(rows, seen)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    out = np.empty(rows.size, dtype=np.int64)
    n = fn(rows.ctypes.data, rows.size, seen.ctypes.data, seen.size, out.ctypes.data)
    if n < 0:
        raise ValueError(f"first_touch: row {int(rows[-n - 1])} outside a map of {seen.size} rows")
    return rows if n == rows.size else out[:n]
