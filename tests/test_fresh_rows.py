"""Rows never written since their initialisation, created by a DRAM cache's miss instead of read
(memory_pool/fresh.py): what the bitmap claims, how it is kept and lost, and that it never
claims a row that changed -- through real pools, a real SIGKILL and an emulated power loss."""

from __future__ import annotations

import signal

import pytest
import torch

from dlrm_cxl.fused import bind_cached
from memory_pool import MemoryPool
from memory_pool.fresh import FRESH_FILE, InitSpec

ROWS, DIM = 200, 4


def make_pool(path, tier="pmem"):
    """Table ``t`` (uniform) and its optimizer state ``t.adagrad`` (zeros), closed cleanly."""
    with MemoryPool.create(path, tier=tier) as pool:
        pool.create_table("t", ROWS, DIM, init="uniform", seed=5)
        pool.create_table("t.adagrad", ROWS, 1, init="zeros")
        pool.persist()
    return path


def open_cached(path, budget=64 << 10):
    pool = MemoryPool.open(path, dram_cache_bytes=budget)
    bags = bind_cached(pool, [pool.table("t")], [pool.table("t.adagrad")], optimizer="rowwise_adagrad",
                       lr=0.1, eps=1e-8, batch_size=4)
    return pool, bags.arena


def storage(pool) -> "Path":  # noqa: F821
    return pool.storage_dir


@pytest.mark.parametrize("tier", ["shm", "pmem", "power-sim"])
def test_a_miss_of_a_row_never_written_is_created_equal_to_its_stored_value_without_a_read(tmp_path, tier):
    path = make_pool(tmp_path / "p", tier)
    with MemoryPool.open(path, read_only=True) as ro:
        stored = ro.table("t").read(torch.arange(ROWS))
    pool, arena = open_cached(path)
    try:
        assert pool.fresh.count("t") == ROWS and pool.fresh.count("t.adagrad") == ROWS
        rows = torch.tensor([3, 17, 150])
        arena.prefetch([rows])
        g = arena.groups[0]
        slot = g.row_slot[rows].to(torch.int64)
        assert torch.equal(g.slots[0][slot], stored[rows])            # weights: the initializer's values
        assert torch.equal(g.slots[1][slot], torch.zeros(3, 1))       # optimizer state: zeros
        assert arena.stats.rows_created == 3 and arena.stats.bytes_read_home == 0
        assert pool.fresh.count("t") == ROWS - 3                        # (cleared on admission)
        # Evicted and missed again: read from the home now, not created (it may have changed).
        arena.groups[0].row_slot.fill_(-1), arena.groups[0].slot_row.fill_(-1)
        arena.prefetch([rows])
        assert arena.stats.rows_created == 3 and arena.stats.bytes_read_home == 3 * (DIM + 1) * 4
    finally:
        pool.close()


def test_the_bitmap_survives_a_clean_close_and_every_write_path_clears_its_rows(tmp_path):
    path = make_pool(tmp_path / "p")
    with MemoryPool.open(path) as pool:
        # (kept while the pool is open on a journaled tier; a direct tier's open takes it:
        # test_a_killed_writers_trained_rows_are_read_and_only_a_journaled_tier_keeps_the_bitmap)
        assert (storage(pool) / FRESH_FILE).exists()
        assert pool.fresh.count("t") == ROWS
        t = pool.table("t")
        t.write(torch.tensor([0, 1]), torch.ones(2, DIM))
        t.scatter_rows(torch.tensor([2]), torch.ones(1, DIM))
        t.restore_raw(torch.tensor([3]), torch.ones(1, DIM).view(torch.uint8))
        t.mark_dirty(torch.tensor([4]))
        pool.table("t.adagrad").write(torch.tensor([9]), torch.ones(1, 1))
        pool.persist()
    assert (path / FRESH_FILE).exists()
    with MemoryPool.open(path) as pool:
        assert pool.fresh.count("t") == ROWS - 5 and pool.fresh.count("t.adagrad") == ROWS - 1
        assert pool.describe()["fresh_rows"] == {"t": ROWS - 5, "t.adagrad": ROWS - 1}
        pool.table("t").load_(torch.zeros(ROWS, DIM))          # a bulk load: no row is initial now
        assert pool.fresh.count("t") == 0


def test_a_group_shares_one_bitmap_so_a_write_to_its_state_makes_the_row_read(tmp_path):
    path = make_pool(tmp_path / "p")
    pool, arena = open_cached(path)
    try:
        pool.table("t.adagrad").write(torch.tensor([7]), torch.full((1, 1), 2.0))
        arena.prefetch([torch.tensor([7, 8])])
        assert arena.stats.rows_created == 1                     # 8 only
        g = arena.groups[0]
        assert float(g.slots[1][int(g.row_slot[7])]) == 2.0     # 7 read, with its written state
    finally:
        pool.close()


def test_handing_out_a_tables_memory_without_a_cache_drops_its_bitmap(tmp_path):
    """The uncached fused kernels write the arena directly (``arena_tensor``); a view may be
    written too: no row of such a table can be claimed initial afterwards."""
    path = make_pool(tmp_path / "p")
    with MemoryPool.open(path) as pool:
        pool.table("t.adagrad").view()
        assert pool.fresh.count("t.adagrad") == 0 and pool.fresh.count("t") == ROWS
        pool.arena_tensor()
        assert pool.fresh.count("t") == 0
    with MemoryPool.open(path) as pool:
        assert pool.fresh.count("t") == 0
    # A cache that claimed its tables first keeps them through both.
    make_pool(tmp_path / "q")
    pool, arena = open_cached(tmp_path / "q")
    try:
        pool.arena_tensor(), pool.table("t").view()
        assert pool.fresh.count("t") == ROWS
    finally:
        pool.close()


def test_a_damaged_bitmap_file_is_dropped_with_a_note_and_every_row_is_read(tmp_path):
    path = make_pool(tmp_path / "p")
    f = path / FRESH_FILE
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with MemoryPool.open(path) as pool:
        assert pool.fresh.count("t") == 0 and "damaged" in pool.fresh.note
        assert not f.exists()


def test_an_initializer_this_version_cannot_recreate_gives_no_bitmap():
    assert InitSpec.from_dict({"kind": "uniform", "seed": 1, "scale": 0.1, "version": 1}) is None  # (SFC64 blocks)
    assert InitSpec.from_dict({"kind": "normal", "version": 2}) is None
    assert InitSpec.from_dict({"kind": "zeros", "version": 2}) == InitSpec("zeros")


def writer_killed(run_py, path, *, compact: bool = False, create: bool = False) -> None:
    """A writer of ``path`` trains rows 0-3 of ``t`` to 3.0 and persists them -- after a first
    persist that saves the file again, every row still initial (``create``: it makes the pool
    itself instead, and has no such persist) -- then (``compact``) has a compaction move the
    journal's START past them; then it is killed (SIGKILL)."""
    if create:
        head = f"""pool = MemoryPool.create({str(path)!r}, tier="pmem")
pool.create_table("t", {ROWS}, {DIM}, init="uniform", seed=5)
pool.create_table("t.adagrad", {ROWS}, 1, init="zeros")"""
    else:
        head = f"pool = MemoryPool.open({str(path)!r})\npool.persist()"
    tail = "start = pool.journal.start_seq\npool.compact()\nassert pool.journal.start_seq > start" if compact else ""
    proc = run_py(f"""import os, signal, torch
from memory_pool import MemoryPool
{head}
pool.table("t").write(torch.arange(4), torch.full((4, {DIM}), 3.0))
pool.persist()
{tail}
os.kill(os.getpid(), signal.SIGKILL)
""", check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def cached_after_kill(path) -> tuple[int, int, int]:
    """Open ``path`` behind a cache and bring rows 0-5 in: (rows of ``t`` known initial at the
    open, rows created, rows journaled at the open); rows 0-3 must hold the killed writer's 3.0."""
    pool, arena = open_cached(path)
    try:
        fresh = pool.fresh.count("t")
        arena.prefetch([torch.arange(6)])
        g = arena.groups[0]
        assert torch.equal(g.slots[0][g.row_slot[:4].to(torch.int64)], torch.full((4, DIM), 3.0))
        return fresh, arena.stats.rows_created, pool.stats.journal_rows_at_open
    finally:
        pool.close()


@pytest.mark.parametrize("tier", ["shm", "pmem"])
def test_a_killed_writers_trained_rows_are_read_and_only_a_journaled_tier_keeps_the_bitmap(tmp_path, run_py, tier):
    """A direct tier (shm) changes rows in place: its open takes the file, and a crash comes
    back with none. A journaled one (emulated pmem) keeps it, and the open clears the rows of
    the journal's records: without that the cache would create rows 0-3 with their initial
    values (a SIGKILL alone: the page cache kept)."""
    path = make_pool(tmp_path / "p", tier)
    writer_killed(run_py, path)
    fresh, created, _ = cached_after_kill(path)
    kept = tier == "pmem"
    assert fresh == (ROWS - 4 if kept else 0) and created == (2 if kept else 0)   # (rows 4 and 5)


def test_a_compaction_saves_the_bitmap_before_the_journal_lets_go_of_its_rows(tmp_path, run_py):
    """Once a compaction has moved the journal's START past a record, no open clears its
    rows: the bitmap saved before that move must show them trained. Without the save
    (``Compaction.compact``) the clean close's file says rows 0-3 are initial, and the cache
    creates them."""
    path = make_pool(tmp_path / "p", "pmem")
    writer_killed(run_py, path, compact=True)
    fresh, created, journaled = cached_after_kill(path)
    assert journaled == 0 and fresh == ROWS - 4 and created == 2   # (nothing left for the open to clear)


def test_a_write_back_pass_saves_the_bitmap_before_the_applied_mark_moves_past_its_rows(tmp_path, run_py):
    """On emulated pmem a write-back pass writes sealed journal records into the images' page
    cache and moves the applied mark past them; an open after a crash of the trainer replays
    only what follows the mark, so it clears none of those rows: the bitmap saved before the
    mark moved must show them trained (``Compaction.apply``; a SIGKILL, which keeps the page
    cache the mark vouches for). Without that save the cache creates rows 0-3."""
    path = make_pool(tmp_path / "p", "pmem")
    proc = run_py(f"""
        import os, signal, torch
        from memory_pool import MemoryPool
        pool = MemoryPool.open({str(path)!r})
        pool.persist()   # (its first: the file saved again, every row still initial)
        pool.table("t").write(torch.arange(4), torch.full((4, {DIM}), 3.0))
        pool.persist()
        pool.journal.rotate()
        assert pool.keeps_applied_mark and pool.overlay_bound == 0
        pool.apply(wait=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    fresh, created, journaled = cached_after_kill(path)
    assert journaled == 0 and fresh == ROWS - 4 and created == 2   # (the mark: nothing replayed)


def test_a_pool_made_by_a_writer_that_is_killed_keeps_its_bitmap(tmp_path, run_py):
    """A pool made and trained by one process has no clean close behind it: its first
    persist saves the file (``TableSet.save_fresh(once=True)``), so a crash does not send every
    row to the device."""
    path = tmp_path / "p"
    writer_killed(run_py, path, create=True)
    fresh, created, _ = cached_after_kill(path)
    assert fresh == ROWS - 4 and created == 2


def test_inspect_reports_the_rows_never_trained_and_leaves_the_file_to_the_writer(cli, tmp_path):
    pool = tmp_path / "p"
    flags = ["--preset", "tiny", "--tier", "pmem", "--threads", "1", "--no-progress", "--dram-cache", "150K"]
    res = cli.run(["train", "--pool", pool, *flags, "--steps", 6])
    assert res.returncode == 0, res.stderr[-2000:]
    assert (pool / FRESH_FILE).exists()
    with MemoryPool.open(pool, read_only=True) as ro:
        names = [n for n in ro.tables() if not n.endswith(".adagrad")]   # (the embedding tables)
        left = sum(ro.fresh.count(n) for n in names)
        total = sum(ro.table(n).num_embeddings for n in names)
    assert 0 < left < total
    out = cli.run(["inspect", "--pool", pool, "--no-digest"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"rows known never trained: {left:,} of {total:,} (a DRAM cache creates" in out.stdout, out.stdout
    assert (pool / FRESH_FILE).exists()   # (a reader's open takes nothing)



def test_a_bitmap_file_whose_table_list_is_damaged_is_dropped_too(tmp_path):
    """A flipped digit in the JSON part (here a table's row count would still parse) is caught
    by its checksum, not trusted."""
    path = make_pool(tmp_path / "p")
    f = path / FRESH_FILE
    raw = f.read_bytes()
    at = raw.index(b'"seed": 5')
    f.write_bytes(raw[:at] + b'"seed": 6' + raw[at + 9:])
    with MemoryPool.open(path) as pool:
        assert pool.fresh.count("t") == 0 and "damaged" in pool.fresh.note


def test_a_journaled_writer_keeps_the_intact_file_it_opened_with_as_it_is_at_its_first_persist(tmp_path, run_py):
    """The first persist of a writer saves the bitmap only where no intact file was read at
    the open (``TableSet.save_fresh(once=True)``: a pool made by this process). An intact one is
    still true -- the rows the open clears are in the journal records every later open replays
    -- and writing it again cost the first step of every resume two fsyncs. After a SIGKILL the
    rows that writer trained are read, not created."""
    path = make_pool(tmp_path / "p")
    f = path / FRESH_FILE
    before = f.stat().st_ino
    with MemoryPool.open(path) as pool:
        pool.table("t").write(torch.arange(4), torch.full((4, DIM), 3.0))
        pool.persist()
        assert f.stat().st_ino == before   # (a save renames a new file in)
    writer_killed(run_py, path)
    fresh, created, _ = cached_after_kill(path)
    assert fresh == ROWS - 4 and created == 2   # (rows 4 and 5; rows 0-3 read: checked there)
