"""The row overlay behind a DRAM cache (memory_pool/overlay.py, ``Compaction.bound``): a journaled
pool whose tables are behind a cache writes the committed rows a trim or a compaction takes out of
the journal into packed runs, not each into its image page, and reads a row given back from the
working copy from its run again (``Overlay.repend``). Real pools, real files; bit-exact training
with it is checked in tests/test_dram_cache.py (the 50-step and interleaved tests)."""

from __future__ import annotations

import signal

import pytest
import torch

from memory_pool import MemoryPool
from memory_pool.residency import page_cache_bytes
from test_dram_cache import anonymous_bytes_at

ROWS, DIM = 1 << 15, 64          # 8 MiB: 16 rows of 256 bytes a page


def run_files(pool) -> list:
    return sorted((pool.storage_dir / "runs").glob("run-*.bin"))


def image_rows(t) -> torch.Tensor:
    """What table ``t``'s image file holds (its page cache: not the process's working copy)."""
    return torch.from_file(str(t.region.path), size=ROWS * DIM).view(ROWS, DIM).clone()


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_a_trim_behind_a_cache_packs_the_committed_rows_into_a_run_and_reads_them_back_from_it(tmp_path, tier):
    """A row alone in its page is not read and written back as a page: the trim's compaction
    appends it to a run. The working copy is given back all the same (no anonymous page left),
    the rows are pending, read from the run when first needed -- and after a reopen."""
    path = tmp_path / "p"
    pool = MemoryPool.create(path, tier=tier)
    t = pool.create_table("t", ROWS, DIM, init="uniform", seed=1)
    pool.bound_working_copy(["t"])
    ids = torch.arange(3, ROWS, 16)                                          # one row in every page
    vals = torch.randn(ids.numel(), DIM)
    t.write(ids, vals)
    t.persist()
    expected = t.view().clone()
    before = image_rows(t)
    assert not torch.equal(before[ids], vals)
    assert anonymous_bytes_at(t.region.tensor.data_ptr()) >= 8 << 20         # (every page copied)

    assert pool.trim_working_copy(["t"]) and pool.stats.trims == 1
    assert pool.stats.bytes_to_runs >= ids.numel() * DIM * 4 and pool.stats.bytes_written_back == 0
    assert torch.equal(image_rows(t), before)                                # not one page written home
    assert anonymous_bytes_at(t.region.tensor.data_ptr()) == 0               # the working copy given back
    assert page_cache_bytes(run_files(pool)) == 0                            # (and the run's pages)
    assert pool.rows_pending == ids.numel()
    assert torch.equal(t.read(ids[:100]), vals[:100])                        # from the run, when needed
    assert pool.stats.run_rows_replayed == 100 and pool.rows_pending == ids.numel() - 100
    assert torch.equal(t.view(), expected)
    pool.close()
    with MemoryPool.open(path) as again:
        assert torch.equal(again.table("t").view(), expected)


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_the_first_trim_after_an_open_leaves_the_journal_rows_no_step_needed_pending_from_their_run_or_home(
        tmp_path, tier):
    """Reopened on demand, a pool behind a cache has its journal's rows pending. Its first trim
    puts them in a run (a row alone in its page) or home (a dense page) and maps the working
    copy afresh: the rows are handed over, pending from there, not copied into the working
    copy first (a copy-on-write fault and an image page read each, for pages dropped right
    after). Every value reads the same -- a table the trim did not map afresh too, whose rows
    only the overlay now says where to find -- before and after another reopen."""
    path = tmp_path / "p"
    pool = MemoryPool.create(path, tier=tier)
    t = pool.create_table("t", ROWS, DIM, init="uniform", seed=1)
    u = pool.create_table("u", ROWS, DIM, init="uniform", seed=2)
    sparse = torch.arange(3, ROWS // 2, 16)                                  # one row a page: a run
    dense = torch.arange(ROWS // 2, ROWS // 2 + 16 * 64)                     # whole pages: home
    ids = torch.cat([sparse, dense])
    vals, uvals = torch.randn(ids.numel(), DIM), torch.randn(sparse.numel(), DIM)
    t.write(ids, vals)
    u.write(sparse, uvals)
    t.persist()
    u.persist()
    expected = {"t": t.view().clone(), "u": u.view().clone()}
    pool.close()

    with MemoryPool.open(path, replay="on-demand") as again:
        t, u = again.table("t"), again.table("u")
        again.bound_working_copy(["t", "u"])
        assert again.journal_rows_pending == ids.numel() + sparse.numel()
        assert torch.equal(t.read(ids[:10]), vals[:10])                      # (ten of them needed)
        assert again.stats.rows_replayed == 10
        before = image_rows(t)
        assert again.trim_working_copy(["t"])                                # (u's working copy kept)
        assert again.stats.rows_handed_over == ids.numel() - 10 + sparse.numel()
        assert again.stats.rows_replayed == 10                                # none applied by the trim
        assert again.journal_rows_pending == 0
        home = image_rows(t)
        assert torch.equal(home[dense], vals[sparse.numel():])               # the dense pages went home
        assert torch.equal(home[sparse], before[sparse])                     # the others into the run
        assert again.stats.bytes_to_runs >= sparse.numel() * DIM * 4
        assert torch.equal(u.read(sparse), uvals)                             # from the run: pending there
        assert torch.equal(t.read(ids), vals)                                 # from the run, or the image
        assert torch.equal(t.view(), expected["t"]) and torch.equal(u.view(), expected["u"])
    with MemoryPool.open(path, replay="on-demand") as third:
        assert all(torch.equal(third.table(n).view(), v) for n, v in expected.items())


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_rows_given_back_again_are_read_from_their_run_again(tmp_path, tier):
    """A refresh drops the working copy's copy of rows taken from a run: they are pending again,
    and read from the run again, not from the image (which holds their initial values)."""
    pool = MemoryPool.create(tmp_path / "p", tier=tier)
    t = pool.create_table("t", ROWS, DIM, init="uniform", seed=1)
    pool.bound_working_copy(["t"])
    ids = torch.arange(0, ROWS, 64)
    vals = torch.randn(ids.numel(), DIM)
    t.write(ids, vals)
    t.persist()
    assert pool.trim_working_copy(["t"])
    assert torch.equal(t.read(ids), vals) and pool.rows_pending == 0
    assert pool.trim_working_copy(["t"], {"t": torch.empty(0, dtype=torch.int64)})   # a refresh
    assert pool.rows_pending == ids.numel()
    assert torch.equal(t.read(ids), vals)
    assert pool.stats.run_rows_replayed == 2 * ids.numel()
    pool.close()


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_a_cleaning_moves_pending_run_rows_on_pending_without_copying_them_into_the_working_copy(
        tmp_path, tier, monkeypatch):
    """Behind a cache every run row is pending after a trim. When the runs pass their bound, the
    oldest run's live rows move into the new run: still pending, read from there when needed --
    not each copied into the working copy first (a copy-on-write fault of a home page a row: 3/4
    of a compaction's CPU on `kaggle` at the bound). Right values after the move and a reopen."""
    monkeypatch.setenv("DLRM_CXL_RUNS_MB", "0.75")   # both runs (~0.8 MiB) over it; the live rows (~0.54) under 3/4
    path = tmp_path / "p"
    pool = MemoryPool.create(path, tier=tier)
    t = pool.create_table("t", ROWS, DIM, init="uniform", seed=1)
    pool.bound_working_copy(["t"])
    expected = t.view().clone()      # (reads every row: taken from there on below, so kept here)
    ids = torch.arange(3, ROWS, 16)                                          # one row a page: all into runs
    expected[ids] = torch.randn(ids.numel(), DIM)
    t.write(ids, expected[ids])
    t.persist()
    pool.compact()                                                           # a run, the journal dropped
    first = run_files(pool)
    assert pool.trim_working_copy(["t"]) and pool.rows_pending == ids.numel()   # all pending
    expected[ids[::2]] = torch.randn(ids.numel() // 2, DIM)
    t.write(ids[::2], expected[ids[::2]])                                    # half of them again
    t.persist()
    taken = pool.stats.run_rows_replayed
    assert pool.rows_pending == ids.numel() // 2
    pool.compact()                                                           # the first run is cleaned
    assert len(first) == 1 and first[0] not in run_files(pool)
    assert pool.stats.run_rows_replayed == taken                             # moved on, not taken
    assert pool.rows_pending == ids.numel() // 2
    assert anonymous_bytes_at(t.region.tensor.data_ptr()) == ids.numel() // 2 * 4096   # the pages written, no more
    assert torch.equal(t.read(ids[1::2]), expected[ids[1::2]])               # from the new run
    assert torch.equal(t.view(), expected)
    pool.close()
    with MemoryPool.open(path, replay="on-demand") as again:
        assert torch.equal(again.table("t").view(), expected)


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_pending_run_rows_a_cleaning_writes_home_are_read_from_the_image_until_the_working_copy_is_remapped(
        tmp_path, tier, monkeypatch):
    """When the runs' live rows alone pass 3/4 of the bound, the oldest run's go home in place.
    Behind a cache they are pending (a trim gave the working copy back), and a page of the
    working copy copied since (a neighbour written) holds the image's old value of them: they
    stay pending, from the image (``HOME``), not each copied into the working copy first (a
    copy-on-write fault of a home page a row). A trim, which maps the working copy afresh,
    ends that; every value is right before, after and across a reopen."""
    monkeypatch.setenv("DLRM_CXL_RUNS_MB", "0.5")
    path = tmp_path / "p"
    pool = MemoryPool.create(path, tier=tier)
    t = pool.create_table("t", ROWS, DIM, init="uniform", seed=1)
    pool.bound_working_copy(["t"])
    expected = t.view().clone()      # (reads every row: kept here, before any row is pending)
    ids = torch.arange(3, ROWS, 16)                                          # one row a page: into a run
    expected[ids] = torch.randn(ids.numel(), DIM)
    t.write(ids, expected[ids])
    t.persist()
    pool.compact()
    assert pool.trim_working_copy(["t"]) and pool.rows_pending == ids.numel()   # all pending
    near = ids[: ids.numel() // 2] + 2                                       # a neighbour in half the pages
    expected[near] = torch.randn(near.numel(), DIM)
    t.write(near, expected[near])                                            # (those pages copied on write)
    t.persist()
    taken = pool.stats.run_rows_replayed
    pool.compact()                                                           # the first run's rows go home
    assert pool.stats.bytes_written_back >= ids.numel() * DIM * 4
    assert torch.equal(image_rows(t)[ids], expected[ids])
    assert not torch.equal(t.region.tensor[ids[:8]], expected[ids[:8]])      # the copied pages: old values
    assert pool.stats.run_rows_replayed == taken                             # written home, not taken
    assert pool.rows_pending == ids.numel()                                  # pending, from the image
    assert torch.equal(t.read(ids[:8]), expected[ids[:8]])
    assert pool.rows_pending == ids.numel() - 8
    assert pool.trim_working_copy(["t"])                                     # mapped afresh: the image's own
    assert pool.rows_pending == near.numel()                                 # (only the second run's rows)
    assert torch.equal(t.view(), expected)
    pool.close()
    with MemoryPool.open(path, replay="on-demand") as again:
        assert torch.equal(again.table("t").view(), expected)


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_a_row_a_refresh_wrote_home_outlives_its_older_run_value_after_a_reopen(tmp_path, tier):
    """Row 5 goes into a run (alone in its page), then changes; a refresh writes the new value
    home (a DRAM cache's evicted dirty row). At the next compaction its page is dense (half of it
    changed) and goes home in place: the run's older value of row 5 must get a tombstone then,
    or a reopen reads it back over the newer one in the image."""
    path = tmp_path / "p"
    pool = MemoryPool.create(path, tier=tier)
    t = pool.create_table("t", ROWS, DIM, init="uniform", seed=1)
    pool.bound_working_copy(["t"])
    t.write(torch.tensor([5]), torch.full((1, DIM), 1.0))
    t.persist()
    pool.compact()
    assert pool.stats.bytes_to_runs > 0 and len(run_files(pool)) == 1      # row 5 in a run
    t.write(torch.arange(8), torch.full((8, DIM), 2.0))                     # half of page 0
    t.persist()
    assert pool.trim_working_copy(["t"], {"t": torch.tensor([5])})           # row 5 written home
    pool.compact()                                                           # page 0 home, in place
    expected = t.view().clone()
    assert torch.equal(expected[5], torch.full((DIM,), 2.0))
    pool.close()
    with MemoryPool.open(path) as again:
        assert torch.equal(again.table("t").view(), expected)


@pytest.mark.parametrize("kill_after", ["refresh", "compaction"])
def test_a_power_loss_keeps_the_newest_value_of_a_row_written_home_behind_a_cache(tmp_path, run_py, kill_after):
    """The same history on power-sim, the writer SIGKILLed and everything it did not sync lost
    (an emulated power loss): right after the refresh (its write home unsynced -- the journal
    still holds the newer value, and replays it over the run's older one), or right after the
    compaction that wrote the page home (synced, the run's value tombstoned)."""
    path = tmp_path / "p"
    proc = run_py(f"""
        import os, signal, torch
        from memory_pool import MemoryPool
        pool = MemoryPool.create({str(path)!r}, tier="power-sim")
        t = pool.create_table("t", {ROWS}, {DIM}, init="uniform", seed=1)
        pool.bound_working_copy(["t"])
        t.write(torch.tensor([5]), torch.full((1, {DIM}), 1.0))
        t.persist()
        pool.compact()
        t.write(torch.arange(8), torch.full((8, {DIM}), 2.0))
        t.persist()
        assert pool.trim_working_copy(["t"], {{"t": torch.tensor([5])}})
        if {kill_after!r} == "compaction":
            pool.compact()
        os.kill(os.getpid(), signal.SIGKILL)
    """, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with MemoryPool.open(path) as again:
        t = again.table("t")
        assert torch.equal(t.read(torch.arange(8)), torch.full((8, DIM), 2.0))
        if kill_after == "compaction":
            assert again.stats.rows_replayed == 0  # (from the image and the runs: the journal was empty)


def test_a_trim_keeps_the_newest_recovery_point_so_a_run_behind_a_cache_resumes_again_and_again(tmp_path):
    """A pool behind a cache, trained, closed and resumed twice on pmem. Each resumed run's open
    replays journal rows into the working copy, so its first recovery point trims -- through
    the row overlay, into a run. That trim once dropped the journal's segments with them, the
    newest recovery point's transaction included: the next resume found "tables but no
    checkpoint". The runs end bit-identical to one uninterrupted uncached run."""
    import os

    from test_dram_cache import BUDGET, train

    os.environ["DLRM_CXL_SEGMENT_MB"] = str(64 / 1024)  # (sealed segments: there is something to drop)
    try:
        pool = tmp_path / "resumed"
        trims, runs = 0, []
        # (a window of 2 steps: each resumed run of 4 steps has a recovery point before its last
        # step, where it trims -- none is given back at a run's last step, Trainer.run_step)
        for steps in (8, 12, 16, 20):
            _, summary, _ = train(pool, steps, tier="pmem", dram_cache_bytes=BUDGET, window=2)
            trims += summary.pool_stats["memory"]["trims"]
            # (what a run that did not trim had: journal rows its open replayed, compactions)
            runs.append({k: summary.pool_stats.get(k) for k in ("journal_rows_at_open", "compactions", "refreshes")}
                        | {"trims": summary.pool_stats["memory"]["trims"]})
        digest = train(pool, 20, tier="pmem", dram_cache_bytes=BUDGET, window=2)[0]  # (one more open)
    finally:
        del os.environ["DLRM_CXL_SEGMENT_MB"]
    # (each resumed run: its open replayed journal rows, so its one recovery point trims, whatever
    # the working copy was measured to have grown -- WorkingCopyBound.after_commit)
    assert all(r["journal_rows_at_open"] and r["trims"] >= 1 for r in runs[1:]), (trims, runs)
    assert digest == train(tmp_path / "plain", 20)[0]


def test_a_run_gives_nothing_back_at_its_last_step_and_resumes_bit_exact(tmp_path):
    """A resumed run behind a cache trims at its first recovery point (its open replayed journal
    rows into the working copy) -- unless that is its last step: the pool is closed next, which
    gives the whole working copy back, so a trim there is work for nothing (most of `dlrm-cxl
    recover`'s time on an old `kaggle` pool, whose replay ends at that recovery point). The
    next resume still ends bit-identical to an uninterrupted uncached run."""
    from test_dram_cache import BUDGET, train

    pool = tmp_path / "resumed"
    train(pool, 8, tier="pmem", dram_cache_bytes=BUDGET, window=4)
    _, last_only, _ = train(pool, 12, tier="pmem", dram_cache_bytes=BUDGET, window=4)  # (a recovery point at 12 only)
    _, earlier, _ = train(pool, 16, tier="pmem", dram_cache_bytes=BUDGET, window=2)     # (at 14 and 16)
    assert last_only.pool_stats["journal_rows_at_open"] and earlier.pool_stats["journal_rows_at_open"]
    assert last_only.pool_stats["memory"]["trims"] == 0
    assert earlier.pool_stats["memory"]["trims"] == 1   # (at 14, not at 16)
    assert train(pool, 20, tier="pmem", dram_cache_bytes=BUDGET)[0] == train(tmp_path / "plain", 20)[0]


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_a_compaction_of_older_segments_does_not_bring_back_an_older_value_of_a_row_a_refresh_wrote(tmp_path, tier):
    """A compaction writes each row's newest record among the segments it drops; the segment
    being written is kept. A row a refresh wrote home with a value from the kept segment is
    newer than any record the compaction holds: it must read that value after the compaction,
    whether the compaction would have put the row into its run (a row alone in its page: read
    back from the run after the next refresh made it pending) or home in place (a page of
    rows), and after a reopen."""
    path = tmp_path / "p"
    pool = MemoryPool.create(path, tier=tier)
    t = pool.create_table("t", ROWS, DIM, init="uniform", seed=1)
    pool.bound_working_copy(["t"])
    alone = torch.arange(3, ROWS // 2, 16)                                   # one row in a page
    paged = torch.arange(ROWS // 2, ROWS // 2 + 64)                          # four whole pages
    ids = torch.cat([alone, paged])
    t.write(ids, torch.full((ids.numel(), DIM), 1.0))                        # the older records ...
    t.persist()
    pool.journal.rotate()                                                    # ... in a sealed segment
    new = torch.randn(ids.numel(), DIM)
    t.write(ids, new)                                                        # the newer, in the one written
    t.persist()
    assert pool.trim_working_copy(["t"], {"t": ids})                         # a refresh writes them home
    pool.compact(pool.journal.next_seq)                                      # drops the older segment only
    assert pool.stats.compactions == 1 and pool.journal.start_seq > 0
    assert pool.trim_working_copy(["t"], {"t": torch.empty(0, dtype=torch.int64)})  # (repend)
    assert torch.equal(t.read(ids), new)
    pool.close()
    with MemoryPool.open(path) as again:
        assert torch.equal(again.table("t").read(ids), new)


def test_a_power_loss_after_a_compaction_keeps_the_value_a_refresh_wrote_of_a_row_it_did_not_write(tmp_path, run_py):
    """The rows a refresh wrote home with their newest value are left out of a later compaction
    whose records of them are no newer (above): their image pages must then be synced by that
    compaction, as the journal's START moves past the records. SIGKILLed on power-sim right
    after it, everything not synced lost: the rows read what the refresh wrote."""
    path = tmp_path / "p"
    proc = run_py(f"""
        import os, signal, torch
        from memory_pool import MemoryPool
        pool = MemoryPool.create({str(path)!r}, tier="power-sim")
        t = pool.create_table("t", {ROWS}, {DIM}, init="uniform", seed=1)
        pool.bound_working_copy(["t"])
        ids = torch.arange(3, {ROWS}, 16)
        t.write(ids, torch.full((ids.numel(), {DIM}), 3.0))
        t.persist()
        assert pool.trim_working_copy(["t"], {{"t": ids}})
        pool.journal.rotate()
        pool.compact(pool.journal.next_seq)
        assert pool.stats.compactions == 1 and pool.journal.start_seq > 0
        os.kill(os.getpid(), signal.SIGKILL)
    """, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with MemoryPool.open(path) as again:
        ids = torch.arange(3, ROWS, 16)
        assert torch.equal(again.table("t").read(ids), torch.full((ids.numel(), DIM), 3.0))
        assert again.stats.rows_replayed == 0
