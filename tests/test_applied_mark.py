"""The applied mark (memory_pool.persistence.AppliedMark): sealed journal segments are written
back into the images' page cache as they are sealed, and opening a pool after a crash of the
trainer replays only the journal after them -- but never trusts the page cache of another boot,
of other files, or on power-sim (which emulates a power loss at every crash). And a replay onto an
image that is not in the page cache asks for its pages first."""

from __future__ import annotations

import os
import shutil
import signal

import torch

import memory_pool
from memory_pool import MemoryPool, destroy_pool
from memory_pool import persistence
from memory_pool.persistence import APPLIED_PREFIX
from memory_pool.tiers import shm_root

from test_pool import all_rows, new_pool

ROWS, DIM, PER_TXN = 4096, 64, 16   # a transaction of 16 rows (~4.5 KB) fills a 4 KiB segment
SMALL_SEGMENTS = ("DLRM_CXL_SEGMENT_MB", str(4096 / (1 << 20)))


def marks_of(pool_dir) -> list:
    with MemoryPool.open(pool_dir, read_only=True) as pool:
        pool_id = pool.pool_id
    return sorted(shm_root().glob(f"{APPLIED_PREFIX}{pool_id}.*"))


def persist_txns(pool, values, first_row=0) -> torch.Tensor:
    """One transaction (persist) per value, each of PER_TXN fresh rows. Returns their ids."""
    t = pool.table("t")
    ids = []
    for i, v in enumerate(values):
        rows = torch.arange(first_row + i * PER_TXN, first_row + (i + 1) * PER_TXN)
        t.write(rows, torch.full((PER_TXN, DIM), float(v)))
        pool.persist()
        ids.append(rows)
    return torch.cat(ids)


def values_of(values) -> torch.Tensor:
    """The rows persist_txns writes for ``values``, in order."""
    return torch.repeat_interleave(torch.tensor(values, dtype=torch.float32), PER_TXN)[:, None].expand(-1, DIM)


def written_back_pool(path, tier, values, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool whose journal holds one transaction per value, written back by a pass (apply) and
    then closed. Returns (the ids written, every row as the pool must hold them)."""
    pool, _, ref = new_pool(path, tier, rows=ROWS, dim=DIM)
    pool.close()
    monkeypatch.setenv(*SMALL_SEGMENTS)
    with MemoryPool.open(path) as pool:
        ids = persist_txns(pool, values)
        pool.apply(wait=True)
        assert pool.stats.applies == 1 and pool.stats.bytes_written_back > 0
    ref[ids] = values_of(values)
    return ids, ref


def image_rows(pool_dir, ids) -> torch.Tensor:
    """Rows of table "t" as its image file holds them (through the page cache)."""
    raw = (pool_dir / "tables" / "t.bin").read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).view(ROWS, DIM)[ids]


def test_after_a_trainer_crash_opening_replays_only_what_follows_the_applied_mark(tmp_pool_dir, run_py):
    pool, _, ref = new_pool(tmp_pool_dir, "pmem", rows=ROWS, dim=DIM)
    pool.close()
    proc = run_py("""
        import os, signal, sys, torch
        from memory_pool import MemoryPool
        from test_applied_mark import persist_txns
        pool = MemoryPool.open(sys.argv[1])
        persist_txns(pool, [1, 2, 3, 4, 5, 6])            # six sealed segments...
        pool.apply(wait=True)                             # ...written back, and the mark after them
        persist_txns(pool, [9], first_row=200)            # after the mark
        os.kill(os.getpid(), signal.SIGKILL)
    """, tmp_pool_dir, env={SMALL_SEGMENTS[0]: SMALL_SEGMENTS[1], "PYTHONPATH": "tests"}, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    applied, after = torch.arange(6 * PER_TXN), torch.arange(200, 200 + PER_TXN)
    for i in range(6):
        ref[i * PER_TXN:(i + 1) * PER_TXN] = float(i + 1)
    ref[after] = 9.0
    # The images' page cache holds the applied rows (unsynced), not the ones after the mark.
    assert torch.equal(image_rows(tmp_pool_dir, applied), ref[applied])
    assert not torch.equal(image_rows(tmp_pool_dir, after), ref[after])
    assert marks_of(tmp_pool_dir)
    with MemoryPool.open(tmp_pool_dir) as pool:
        assert pool.stats.rows_replayed == PER_TXN    # not 7 * PER_TXN
        assert torch.equal(all_rows(pool.table("t")), ref)


def test_a_copy_of_the_pool_does_not_trust_the_original_applied_mark(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    pool, _, ref = new_pool(a, "pmem", rows=ROWS, dim=DIM)
    pool.close()
    monkeypatch.setenv(*SMALL_SEGMENTS)
    with MemoryPool.open(a) as pool:
        ids = persist_txns(pool, [1, 2, 3, 4])
    ref[ids] = values_of([1, 2, 3, 4])
    shutil.copytree(a, b)  # its images never get the rows: only its journal holds them
    with MemoryPool.open(a) as pool:
        pool.apply(wait=True)
    assert marks_of(a)
    with MemoryPool.open(a) as pool:  # the original's page cache holds them: nothing to replay
        assert pool.stats.rows_replayed == 0
        assert torch.equal(all_rows(pool.table("t")), ref)
    with MemoryPool.open(b) as pool:  # the copy (same pool id, other files) replays them all
        assert pool.stats.rows_replayed == ids.numel()
        assert torch.equal(all_rows(pool.table("t")), ref)


def test_a_mark_from_another_boot_is_not_trusted(tmp_pool_dir, tmp_path, monkeypatch):
    ids, ref = written_back_pool(tmp_pool_dir, "pmem", [5, 6, 7], monkeypatch)
    with MemoryPool.open(tmp_pool_dir) as pool:
        assert pool.stats.rows_replayed == 0
    boot = tmp_path / "boot_id"
    boot.write_text("another boot\n")
    monkeypatch.setattr(persistence, "BOOT_ID", str(boot))
    with MemoryPool.open(tmp_pool_dir) as pool:
        assert pool.stats.rows_replayed == ids.numel()
        assert torch.equal(all_rows(pool.table("t")), ref)


def test_power_sim_replays_the_whole_journal_whatever_was_written_back(tmp_pool_dir, monkeypatch):
    ids, ref = written_back_pool(tmp_pool_dir, "power-sim", [1, 2, 3], monkeypatch)
    assert not marks_of(tmp_pool_dir)
    with MemoryPool.open(tmp_pool_dir) as pool:
        assert pool.stats.rows_replayed == ids.numel()
        assert torch.equal(all_rows(pool.table("t")), ref)


def test_destroy_and_gc_remove_the_marks_of_pools_that_are_gone(tmp_path, monkeypatch):
    marks = {}
    for name in ("destroyed", "deleted by hand"):
        written_back_pool(tmp_path / name, "pmem", [1, 2], monkeypatch)
        marks[name] = marks_of(tmp_path / name)
        assert marks[name]
    destroy_pool(tmp_path / "destroyed")
    assert not any(p.exists() for p in marks["destroyed"])
    shutil.rmtree(tmp_path / "deleted by hand")
    assert all(p.exists() for p in marks["deleted by hand"])
    memory_pool.gc(under=tmp_path)
    assert not any(p.exists() for p in marks["deleted by hand"])


def test_a_replay_onto_an_image_out_of_the_page_cache_asks_for_its_pages_first(tmp_pool_dir, monkeypatch):
    ids, ref = written_back_pool(tmp_pool_dir, "power-sim", [3, 4, 5], monkeypatch)  # power-sim: all replayed
    image = tmp_pool_dir / "tables" / "t.bin"
    fd = os.open(image, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # as after a reboot: nothing cached
    finally:
        os.close(fd)
    with MemoryPool.open(tmp_pool_dir) as pool:
        assert pool.stats.rows_replayed == ids.numel()
        assert pool.stats.pages_prefetched == ids.numel() * DIM * 4 // 4096
        assert torch.equal(all_rows(pool.table("t")), ref)
    with MemoryPool.open(tmp_pool_dir) as pool:  # cached now: a few mincore calls, no advice
        assert pool.stats.rows_replayed == ids.numel() and pool.stats.pages_prefetched == 0


def test_a_compaction_after_trusting_the_mark_syncs_the_images_an_earlier_process_wrote_back(
        tmp_pool_dir, run_py, monkeypatch):
    """The rows below the mark are in the images' page cache, unsynced, written by the crashed
    process; the compaction that drops their journal records must make them durable first, even
    when it writes nothing into those images itself."""
    pool, _, ref = new_pool(tmp_pool_dir, "pmem", rows=ROWS, dim=DIM)
    pool.close()
    proc = run_py("""
        import os, signal, sys
        from memory_pool import MemoryPool
        from test_applied_mark import persist_txns
        pool = MemoryPool.open(sys.argv[1])
        persist_txns(pool, [1, 2, 3, 4])
        pool.apply(wait=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """, tmp_pool_dir, env={SMALL_SEGMENTS[0]: SMALL_SEGMENTS[1], "PYTHONPATH": "tests"}, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    synced = []
    orig = memory_pool.tiers.FileRegion.sync
    monkeypatch.setattr(memory_pool.tiers.FileRegion, "sync",
                        lambda self, **kw: (synced.append(self.path.name), orig(self, **kw))[1])
    with MemoryPool.open(tmp_pool_dir) as pool:
        assert pool.stats.rows_replayed == 0          # everything was below the mark
        pool.compact()
        assert pool.stats.bytes_compacted > 0
    assert "t.bin" in synced


def test_a_write_back_into_an_image_out_of_the_page_cache_asks_for_its_pages_first(tmp_pool_dir, monkeypatch):
    """A write-back stores rows through a shared mapping of the image: a page out of the page
    cache is read by its fault, one synchronous read after another. Where they are mostly not
    cached (a DRAM cache's trims give an image's pages back), they are asked for all at once
    first (``FileRegion._will_store``); where they are cached, nothing is asked. The rows land
    the same either way."""
    pool, _, ref = new_pool(tmp_pool_dir, "pmem", rows=ROWS, dim=DIM)
    pool.close()
    monkeypatch.setenv(*SMALL_SEGMENTS)
    with MemoryPool.open(tmp_pool_dir) as pool:
        ids = persist_txns(pool, [3, 4, 5])
        fd = os.open(tmp_pool_dir / "tables" / "t.bin", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (clean: the rows are in the journal)
        finally:
            os.close(fd)
        pool.apply(wait=True)
        assert pool.stats.applies == 1
        assert pool.stats.pages_prefetched == ids.numel() * DIM * 4 // 4096
        more = persist_txns(pool, [6], first_row=0)              # the same pages, cached now
        pool.apply(wait=True)
        assert pool.stats.applies == 2 and pool.stats.pages_prefetched == ids.numel() * DIM * 4 // 4096
    ref[ids] = values_of([3, 4, 5])
    ref[more] = values_of([6])
    assert torch.equal(image_rows(tmp_pool_dir, ids), ref[ids])
    with MemoryPool.open(tmp_pool_dir) as pool:
        assert torch.equal(all_rows(pool.table("t")), ref)


def test_a_write_back_pass_does_not_put_an_older_value_under_rows_a_refresh_wrote(tmp_pool_dir, monkeypatch):
    """A refresh (a DRAM cache's dirty rows evicted into the working copy, written into the
    image, which is mapped afresh) writes rows newer than journal records not written back
    yet. A pass that then writes those records (sealed segments, record after record) must
    skip the rows the refresh wrote, or the working copy, which reads the image, shows an older
    value: the next miss of the row would train on it."""
    pool, _, ref = new_pool(tmp_pool_dir, "pmem", rows=ROWS, dim=DIM)
    pool.close()
    monkeypatch.setenv("DLRM_CXL_SEGMENT_MB", str(3 * 4096 / (1 << 20)))   # two transactions a segment
    with MemoryPool.open(tmp_pool_dir) as pool:
        t = pool.table("t")
        ids = persist_txns(pool, [1])                # rows 0..15 = 1
        other = persist_txns(pool, [5], first_row=64)  # rows no refresh writes: written back as usual
        pool.journal.rotate()                        # (both sealed)
        persist_txns(pool, [3])                      # rows 0..15 = 3, in the segment being written
        assert pool.trim_working_copy(["t"], {"t": ids})   # a refresh: 3 into the image
        pool.apply(wait=True)                        # the sealed segment: 1 and 5
        assert pool.stats.applies == 1 and pool.stats.refreshes == 1
        assert torch.equal(t.read(ids), values_of([3]))
        assert torch.equal(image_rows(tmp_pool_dir, other), values_of([5]))
    ref[ids], ref[other] = values_of([3]), values_of([5])
    with MemoryPool.open(tmp_pool_dir) as pool:
        assert torch.equal(all_rows(pool.table("t")), ref)


def test_a_write_back_pass_gives_back_the_journal_pages_it_read(tmp_pool_dir, monkeypatch):
    """The journal of a disk tier is written with direct writes: its pages are in the page cache
    only because a write-back pass (or a compaction) read them, and nothing reads them again.
    Left there they counted against a DRAM cache's budget (1.1 GB of `kaggle`'s journal after 270
    steps). After the pass the sealed segments it read hold no cached page; the rows it wrote
    back are the same."""
    from memory_pool.residency import page_cache_bytes

    pool, _, ref = new_pool(tmp_pool_dir, "pmem", rows=ROWS, dim=DIM)
    pool.close()
    monkeypatch.setenv(*SMALL_SEGMENTS)
    with MemoryPool.open(tmp_pool_dir) as pool:
        assert pool.journal.direct, "the test needs a journal written with direct writes"
        ids = persist_txns(pool, [3, 4, 5, 6])
        sealed = sorted((tmp_pool_dir / "journal").glob("seg-*.log"))[:-1]   # (the last one is written to)
        assert len(sealed) >= 3
        pool.apply(wait=True)
        assert pool.stats.applies == 1 and pool.stats.bytes_written_back > 0
        # (direct writes: a segment's last block at most, cached when an append reopens it)
        assert page_cache_bytes(sealed) <= 4096 * len(sealed), "the journal pages a pass read are still cached"
    ref[ids] = values_of([3, 4, 5, 6])
    assert torch.equal(image_rows(tmp_pool_dir, ids), ref[ids])
    with MemoryPool.open(tmp_pool_dir) as pool:
        assert torch.equal(all_rows(pool.table("t")), ref)
