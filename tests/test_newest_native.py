"""A compaction's newest rows in C (memory_pool/_newest.c) against their torch definitions: the
plan (``newest_places``: each row's newest value, where it comes from and where it goes) and the
row copies (``copy_rows_at``), and the errors of both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import need_native
from memory_pool import _native
from memory_pool.newest import newest_places
from memory_pool.records import copy_rows, copy_rows_at

# Tables around the bitmaps' word (64 rows) and summary-word (4096 rows) boundaries.
ROWS = [1, 63, 64, 65, 4095, 4097, 300_000]


def _need_c():
    need_native(_native.newest_places, "memory_pool/_newest.c")
    need_native(_native.copy_rows_at, "memory_pool/_newest.c")


def _plan(ids, counts, rows, scratch=None):
    kept, places = newest_places(ids, counts, rows, scratch)
    return kept.tolist(), [(j, p.tolist(), d.tolist()) for j, p, d in places]


def _torch_plan(monkeypatch, *args):
    with monkeypatch.context() as m:
        m.setenv("DLRM_CXL_NO_NATIVE", "1")
        _native._loaded.clear()
        try:
            return _plan(*args)
        finally:
            _native._loaded.clear()


def _parts(rng, rows, nparts=9):
    counts = rng.integers(0, 400, size=nparts).tolist()
    counts[2] = 0   # (a record with none of the table's rows)
    ids = [rng.integers(0, rows, size=c) for c in counts]
    ids[-1] = np.concatenate([ids[-1], [0, rows - 1, rows - 1]])   # (the edge rows, a duplicate)
    counts[-1] += 3
    return torch.from_numpy(np.concatenate(ids).astype(np.int64)), counts


def test_the_c_plan_is_the_torch_plan_on_every_table_size_with_a_dirty_scratch(monkeypatch):
    _need_c()
    rng = np.random.default_rng(11)
    # (one scratch for every table, left dirty by the one before: its contents must not matter)
    scratch = torch.full((max(ROWS),), 7, dtype=torch.int32)
    for rows in ROWS:
        for _ in range(3):
            ids, counts = _parts(rng, rows)
            got = _plan(ids, counts, rows, scratch)
            assert got == _torch_plan(monkeypatch, ids, counts, rows, scratch.clone())
            # (an independent reference: every id once, sorted; each place holds its last value)
            kept, places = got
            assert kept == sorted(set(ids.tolist()))
            last = {int(v): i for i, v in enumerate(ids.tolist())}
            starts = np.concatenate([[0], np.cumsum(counts)])
            for j, local, dst in places:
                for p, d in zip(local, dst):
                    assert last[kept[d]] == starts[j] + p


def test_the_c_plan_leaves_its_bitmaps_clear_for_the_next_table(monkeypatch):
    """A bit left set by one table would add a row to the next one's ``kept``."""
    _need_c()
    ids = torch.tensor([5, 9, 5, 4000, 70], dtype=torch.int64)
    assert _plan(ids, [2, 3], 4097) == _torch_plan(monkeypatch, ids, [2, 3], 4097)
    again = torch.tensor([3, 3], dtype=torch.int64)
    assert _plan(again, [2], 4097) == ([3], [(0, [1], [0])])


def test_an_id_outside_its_table_is_refused_and_the_next_plan_is_right():
    _need_c()
    with pytest.raises(ValueError, match="id 64 outside the table's 64 rows"):
        newest_places(torch.tensor([1, 2, 64, 3]), [4], 64)
    with pytest.raises(ValueError, match="id -1 outside"):
        newest_places(torch.tensor([-1]), [1], 64)
    assert _plan(torch.tensor([1, 2, 1]), [1, 2], 64) == ([1, 2], [(1, [0, 1], [1, 0])])


@pytest.mark.parametrize("rb", [4, 12, 64, 130])
def test_rows_copied_at_their_places_match_the_torch_copy(rb):
    _need_c()
    rng = np.random.default_rng(rb)
    src = torch.from_numpy(rng.integers(0, 256, size=(500, rb), dtype=np.uint8))
    places = torch.from_numpy(rng.permutation(800)[:300].astype(np.int64))
    rows = torch.from_numpy(rng.integers(0, 500, size=300).astype(np.int64))
    want = copy_rows(torch.zeros(800, rb, dtype=torch.uint8), places, src.index_select(0, rows))
    got = copy_rows_at(torch.zeros(800, rb, dtype=torch.uint8), places, src, rows)
    assert got.any() and torch.equal(got, want)


def test_a_row_copy_out_of_range_is_refused_with_nothing_copied():
    _need_c()
    src = torch.arange(12, dtype=torch.uint8).view(3, 4)
    dst = torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises(IndexError, match="row 3 of 3 to place 0"):
        copy_rows_at(dst, torch.tensor([1, 0]), src, torch.tensor([0, 3]))
    with pytest.raises(IndexError, match="place 2 of 2"):
        copy_rows_at(dst, torch.tensor([2]), src, torch.tensor([0]))
    assert not dst.any()
