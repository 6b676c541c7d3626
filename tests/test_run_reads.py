"""A compaction's bulk reads of a run (``Run.rows(bulk=True)``: large direct reads, each needed
block verified from what was read) give the bytes the run holds, as the mapped path does, and
refuse damage the same way."""

from __future__ import annotations

import os

import pytest
import torch

from memory_pool import runfile
from memory_pool.runfile import BLOCK, BULK_ROWS, Run, RunCorruptError, write_run


def _run(path, *, seed=0):
    """A run of three tables (rows of 256, 4 and 100 bytes: rows that straddle blocks), its
    rows random, and the rows by table."""
    g = torch.Generator().manual_seed(seed)
    tables, values = {}, {}
    for name, rb, n, total in (("a", 256, 40_000, 100_000), ("s", 4, 30_000, 60_000), ("odd", 100, 20_000, 50_000)):
        ids = torch.randperm(total, generator=g)[:n].sort().values
        rows = torch.randint(0, 256, (n, rb), dtype=torch.uint8, generator=g)
        tables[name] = (rb, ids, rows, torch.empty(0, dtype=torch.int64))
        values[name] = (ids, rows)
    write_run(path, 1, tables)
    return Run.open(path), values


@pytest.mark.parametrize("pick", ["every-row", "dense", "sparse", "straddling-spans"])
def test_bulk_reads_give_the_rows_the_mapped_reads_and_the_writer_give(tmp_path, pick):
    run, values = _run(tmp_path / "run.bin")
    g = torch.Generator().manual_seed(1)
    for name, (ids, rows) in values.items():
        n = ids.numel()
        if pick == "every-row":
            at = torch.arange(n)
        elif pick == "dense":
            at = torch.randperm(n, generator=g)[: n // 2].sort().values
        elif pick == "sparse":   # (gaps past GAP_BLOCKS: many spans, none read through)
            at = torch.arange(0, n, max(1, (runfile.GAP_BLOCKS + 2) * BLOCK // rows.shape[1]))
        else:                    # (spans cut by SPAN within one stretch: rows on both sides of a cut)
            at = torch.arange(0, n, 3)
        if at.numel() < BULK_ROWS:
            at = torch.arange(min(n, BULK_ROWS))
        want = rows.index_select(0, at)
        fresh = Run.open(tmp_path / "run.bin")
        assert not fresh.verified.any()
        got = fresh.rows(name, ids[at], bulk=True)
        assert torch.equal(got, want)
        assert fresh.verified.any()                                  # (the blocks it read were checked)
        assert torch.equal(run.rows(name, ids[at]), want)            # (the mapped path agrees)
        # Unsorted ids come back in their order, as from the mapped path.
        perm = torch.randperm(at.numel(), generator=g)
        assert torch.equal(fresh.rows(name, ids[at][perm], bulk=True), want[perm])


def test_bulk_reads_below_the_threshold_take_the_mapped_path(tmp_path, monkeypatch):
    run, values = _run(tmp_path / "run.bin")
    ids, rows = values["a"]
    monkeypatch.setattr(Run, "_read_rows", lambda *a: pytest.fail("a read of few rows went in bulk"))
    assert torch.equal(run.rows("a", ids[: BULK_ROWS - 1], bulk=True), rows[: BULK_ROWS - 1])


def test_a_bit_flip_in_a_block_a_bulk_read_needs_is_refused(tmp_path):
    path = tmp_path / "run.bin"
    run, values = _run(path)
    ids, rows = values["a"]
    t = run.tables["a"]
    row = 5000   # (its bytes flipped in the file: the bulk read does not go through the mapping's cache)
    with open(path, "r+b") as f:
        f.seek(run.data_off + t.start + row * 256 + 7)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    fresh = Run.open(path)
    assert torch.equal(fresh.rows("a", ids[:BULK_ROWS], bulk=True), rows[:BULK_ROWS])   # (not read: not refused)
    with pytest.raises(RunCorruptError, match="fail their checksum"):
        fresh.rows("a", ids[row - BULK_ROWS // 2: row + BULK_ROWS // 2], bulk=True)


def test_a_run_cut_short_after_it_was_opened_is_refused_by_a_bulk_read(tmp_path):
    path = tmp_path / "run.bin"
    run, values = _run(path)
    ids, _ = values["odd"]
    os.truncate(path, run.data_off + run.tables["odd"].start + 100 * 1000)
    with pytest.raises(RunCorruptError, match="truncated"):
        run.rows("odd", ids, bulk=True)


def test_bulk_reads_where_o_direct_is_refused_read_the_same_rows_through_the_page_cache(tmp_path, monkeypatch):
    run, values = _run(tmp_path / "run.bin")
    asked = []
    monkeypatch.setattr(runfile.fileio, "set_direct", lambda fd, on: asked.append(on) or False)
    ids, rows = values["odd"]
    assert torch.equal(Run.open(tmp_path / "run.bin").rows("odd", ids, bulk=True), rows)
    assert asked == [True]


def test_a_run_deleted_under_an_open_pool_is_refused_by_a_bulk_read_as_missing(tmp_path):
    path = tmp_path / "run.bin"
    run, values = _run(path)
    ids, rows = values["a"]
    path.unlink()
    assert torch.equal(run.rows("a", ids[:10]), rows[:10])   # (the mapping still holds it)
    with pytest.raises(RunCorruptError, match="is missing"):
        run.rows("a", ids, bulk=True)
