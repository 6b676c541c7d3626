"""The step's row sets (memory_pool/rowsets.py): the C functions of memory_pool/_rowsets.c
against their NumPy definitions, and the errors of both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import need_native
from memory_pool import DistinctRows, _native, distinct_sorted, first_touch
from memory_pool.rowsets import first_touch_numpy

# Tables around the bitmaps' word (64 rows) and summary-word (4096 rows) boundaries, one empty.
SIZES = [1, 63, 64, 65, 0, 4095, 4097, 200_000]


def _batches(rng, base, n=12):
    for _ in range(n):
        lengths = rng.integers(0, 300, size=len(SIZES))
        lengths[SIZES.index(0)] = 0
        parts = [rng.integers(0, s, size=k) if s else np.zeros(0, np.int64) for s, k in zip(SIZES, lengths)]
        # (each table's edge rows too, and duplicates)
        parts = [np.concatenate([p, [0, s - 1, s - 1]]) if s else p for p, s in zip(parts, SIZES)]
        yield torch.from_numpy(np.concatenate(parts).astype(np.int64)), np.array([p.size for p in parts])


def _need_c(fn):
    need_native(fn, "memory_pool/_rowsets.c")


@pytest.fixture(params=["c", "numpy"])
def either(request, monkeypatch):
    """Runs a test with the C functions, then with NumPy's definitions."""
    if request.param == "c":
        _need_c(_native.distinct_rows)
        _need_c(_native.first_touch)
    else:
        monkeypatch.setenv("DLRM_CXL_NO_NATIVE", "1")
    return request.param


def test_the_c_distinct_rows_are_the_sorted_distinct_shifted_ids_batch_after_batch():
    _need_c(_native.distinct_rows)
    base = np.concatenate([[0], np.cumsum(SIZES)])
    c = DistinctRows(base)
    for values, lengths in _batches(np.random.default_rng(5), base):
        want = torch.unique(values + torch.from_numpy(np.repeat(base[:-1], lengths)))
        got = c(values, lengths)
        # (a bitmap left set by a batch would add its rows to the next one's)
        assert torch.equal(got, want)
        assert not c._bits.any() and not c._summary.any()
    assert c(torch.zeros(0, dtype=torch.int64), np.zeros(len(SIZES), np.int64)).numel() == 0


def test_an_id_outside_its_table_is_refused_by_name_and_the_next_batch_is_right(either):
    base = np.concatenate([[0], np.cumsum(SIZES)])
    c = DistinctRows(base)
    lengths = np.array([1, 2, 1, 0, 0, 0, 0, 0])
    for bad, pos in ((64, 3), (-1, 3)):
        values = torch.tensor([0, 5, 62, bad], dtype=torch.int64)   # table 2 has 64 rows
        with pytest.raises(ValueError, match=rf"id {bad} \(position {pos}\) is outside table 2's 64 rows"):
            c(values, lengths)
    good = torch.tensor([0, 5, 62, 63], dtype=torch.int64)
    assert c(good, lengths).tolist() == [0, 1 + 5, 1 + 62, 1 + 63 + 63]
    with pytest.raises(ValueError, match="8 lengths summing to 3"):
        c(good, np.array([1, 2, 0, 0, 0, 0, 0, 0]))


def test_without_the_c_functions_numpy_gives_the_same_rows_and_first_touches(monkeypatch):
    base = np.concatenate([[0], np.cumsum(SIZES)])
    batches = list(_batches(np.random.default_rng(9), base, n=4))
    with_c = [DistinctRows(base)(v, n) for v, n in batches]
    monkeypatch.setenv("DLRM_CXL_NO_NATIVE", "1")
    assert _native.distinct_rows() is None and _native.first_touch() is None
    plain = DistinctRows(base)
    for (v, n), want in zip(batches, with_c):
        assert torch.equal(plain(v, n), want)
        assert torch.equal(plain(v, n), distinct_sorted(v + torch.from_numpy(np.repeat(base[:-1], n))))


def test_the_c_first_touch_keeps_the_unmarked_rows_in_order_and_marks_them():
    _need_c(_native.first_touch)
    rng = np.random.default_rng(3)
    seen_c, seen_np = np.zeros(10_000, bool), np.zeros(10_000, bool)
    for i in range(8):
        rows = np.sort(rng.choice(10_000, size=700, replace=False)).astype(np.int64)
        got, want = first_touch(rows, seen_c), first_touch_numpy(rows, seen_np)
        assert np.array_equal(got, want) and np.array_equal(seen_c, seen_np)
        assert 0 < got.size < rows.size or i == 0   # (later: some rows seen before, some not)
    fresh = np.array([10, 3, 7], dtype=np.int64)
    assert first_touch(fresh, np.zeros(11, bool)) is fresh   # (all new: no copy)


def test_a_first_touch_outside_the_map_is_refused_and_marks_nothing(either):
    seen = np.zeros(8, bool)
    with pytest.raises(ValueError, match="row 8 outside a map of 8 rows"):
        first_touch(np.array([1, 2, 8], dtype=np.int64), seen)
    assert not seen.any()
    with pytest.raises(ValueError, match="the map must be a contiguous bool array"):
        first_touch(np.array([1], dtype=np.int64), np.zeros(8, np.uint8))
