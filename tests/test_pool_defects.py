"""Durability defects of the pool found in a review (issue 25: 1, 2, 4, 8, 9 and the "pool
unchanged after a failed persist" check of 11), each shown for real: a full file system (a small
tmpfs mounted for the test), a compaction and a bulk load really running at the same time, an
EIO from the one ``os.fdatasync`` of the images, a SIGKILLed process, threads writing the header
together. Every check compares with a reference the test keeps, or with the bytes of the files."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from memory_pool import MemoryPool, PoolFullError, PoolIOError, read_header
from memory_pool.header import RUNS_FORMAT_VERSION
from memory_pool.overlay import MANIFEST, RUNS_DIR

DIM = 64                       # 256-byte rows, 16 a page
PER_PAGE = 4096 // (DIM * 4)
JOURNALED = ("pmem", "power-sim")


def _image(pool_dir: Path, name: str, dim: int = DIM) -> torch.Tensor:
    """The table image as the file holds it (not the pool's working copy)."""
    raw = np.fromfile(pool_dir / "tables" / f"{name}.bin", dtype=np.float32)
    return torch.from_numpy(raw.copy()).view(-1, dim)


# --------------------------------------------------------------------------- 1, 11: a full disk


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of 8 MiB mounted for the test (root only): a file system that really fills up."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` to its last block; returns the filler file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 20, 1 << 16, 4096, 512, 1):
            chunk = b"\xa5" * size
            while True:
                try:
                    if os.write(fd, chunk) < size:
                        break
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)
    return filler


@pytest.mark.parametrize("how", ["pool", "table"])
@pytest.mark.parametrize("tier", JOURNALED)
def test_a_persist_that_fails_on_a_full_disk_changes_nothing_and_its_retry_persists_the_rows(small_fs, tier, how):
    path = small_fs / "pool"
    pool = MemoryPool.create(path, tier=tier)
    try:
        t = pool.create_table("t", 1024, DIM, init="uniform", seed=1)
        ref = t.read(torch.arange(1024)).clone()
        t.write([0], torch.full((1, DIM), 2.0))       # a first commit: the journal has a segment
        pool.persist()
        ref[0] = 2.0
        ids = torch.arange(100, 400)
        new = torch.randn(ids.numel(), DIM, generator=torch.Generator().manual_seed(3))
        assert not torch.equal(ref[ids], new)
        filler = _fill(small_fs)
        t.write(ids, new)
        with pytest.raises(PoolFullError) as err:
            pool.persist() if how == "pool" else t.persist()
        assert err.value.hint and "disk" in err.value.hint
        # The pool is unchanged: a reader sees the committed rows, and nothing of the failed persist.
        with MemoryPool.open(path, read_only=True) as reader:
            assert torch.equal(reader.table("t").view(), ref)
        # The rows are still dirty: once there is room again, the retry persists them.
        assert torch.equal(t._region._dirty.nonzero().flatten(), ids)
        filler.unlink()
        n = pool.persist() if how == "pool" else t.persist()
        assert n == ids.numel() * DIM * 4
        ref[ids] = new
    finally:
        pool.close()
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(path, replay=replay) as p:
            assert torch.equal(p.table("t").view(), ref), replay


# --------------------------------------------------------------------------- 2: a load beside a compaction


def test_a_bulk_load_while_a_background_compaction_runs_keeps_the_loaded_rows(tmp_pool_dir, monkeypatch):
    """A pool without an overlay whose journal holds older rows of table "t" (1.0) behind a large
    table's rows: the background compaction takes a while before it reaches "t", and the load
    (5.0) runs meanwhile. The loaded rows must win, in memory and after a reopen."""
    monkeypatch.delenv("DLRM_CXL_RUNS_MB", raising=False)
    pool = MemoryPool.create(tmp_pool_dir, tier="power-sim")
    try:
        big = pool.create_table("big", 1 << 18, DIM)       # 64 MiB: its rows come first in the journal
        t = pool.create_table("t", 4096, DIM)
        assert pool.overlay_bound == 0
        big.write(torch.arange(1 << 18), torch.full((1 << 18, DIM), 3.0))
        t.write(torch.arange(4096), torch.full((4096, DIM), 1.0))
        pool.persist()
        pool.compact(wait=False)
        assert pool.compacting                             # the load starts while it runs
        t.load_(torch.full((4096, DIM), 5.0))
        assert torch.equal(t.view(), torch.full((4096, DIM), 5.0))
        pool.wait_compaction()
        assert pool.stats.compactions == 1
        assert torch.equal(t.view(), torch.full((4096, DIM), 5.0))
    finally:
        pool.close()
    assert torch.equal(_image(tmp_pool_dir, "t"), torch.full((4096, DIM), 5.0))
    with MemoryPool.open(tmp_pool_dir) as p:
        assert torch.equal(p.table("t").view(), torch.full((4096, DIM), 5.0))
        assert torch.equal(p.table("big").view()[::4096], torch.full((64, DIM), 3.0))


# --------------------------------------------------------------------------- 4: fdatasync after an EIO


@pytest.mark.parametrize("how", ["apply", "refresh"])
@pytest.mark.parametrize("tier", JOURNALED)
def test_after_an_eio_in_the_image_sync_the_next_compaction_rewrites_every_row_since_start(
        tmp_pool_dir, monkeypatch, tier, how):
    """The rows an unsynced write-back pass (apply) put in the image's page cache may be gone after
    a failed fdatasync (the kernel marks the pages clean; a retried fdatasync says success). The
    next compaction must write them again before it drops the journal. ``refresh``: the rows
    were written there by a refresh (a DRAM cache's evicted rows), which older records are
    otherwise not written over: after the failed sync they are, and the newest lands last."""
    monkeypatch.delenv("DLRM_CXL_RUNS_MB", raising=False)
    pool = MemoryPool.create(tmp_pool_dir, tier=tier)
    image = tmp_pool_dir / "tables" / "t.bin"
    try:
        t = pool.create_table("t", 4096, DIM, init="uniform", seed=1)
        ref = t.read(torch.arange(4096)).clone()
        old = ref.clone()
        a = torch.arange(0, 4096, 7)                      # written back by the pass, unsynced
        b = torch.arange(3, 4096, 11)                     # only in the journal at the compaction
        b = b[~torch.isin(b, a)]
        for ids, seed in ((a, 5), (b, 6)):
            vals = torch.randn(ids.numel(), DIM, generator=torch.Generator().manual_seed(seed))
            t.write(ids, vals)
            ref[ids] = vals
            pool.persist()
            if seed == 5 and how == "apply":
                pool.journal.rotate()
                pool.apply(wait=True)
                assert pool.stats.applies == 1
            elif seed == 5:
                assert pool.trim_working_copy(["t"], {"t": a}) and pool.stats.refreshes == 1
        assert torch.equal(_image(tmp_pool_dir, "t")[a], ref[a])   # in the image's page cache

        real = os.fdatasync
        failed = []

        def fdatasync(fd):
            if not failed and os.readlink(f"/proc/self/fd/{fd}") == str(image):
                failed.append(fd)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(fd)

        monkeypatch.setattr(os, "fdatasync", fdatasync)
        with pytest.raises(PoolIOError):
            pool.compact()
        assert failed
        # What a failed write-back may leave: the pages clean, the disk's (old) bytes in the file.
        with open(image, "r+b") as f:
            for r in a.tolist():
                f.seek(r * DIM * 4)
                f.write(old[r].numpy().tobytes())
        pool.compact()                                     # the sync works again
        assert pool.stats.compactions == 1
        on_disk = _image(tmp_pool_dir, "t")
        assert torch.equal(on_disk[b], ref[b])
        assert torch.equal(on_disk[a], ref[a]), "the rows of the failed sync were not written again"
        assert pool.journal.live_bytes < 4096 * DIM * 4 // 4   # the journal was dropped after them
    finally:
        pool.close()
    with MemoryPool.open(tmp_pool_dir) as p:
        assert torch.equal(p.table("t").view(), ref)


# --------------------------------------------------------------------------- 8: a crash in the reset


LOAD_CHILD = r"""
import os, sys, torch
os.environ["DLRM_CXL_RUNS_MB"] = "64"
from memory_pool import MemoryPool
path, saved = sys.argv[1], sys.argv[2]
with MemoryPool.open(path) as pool:
    a = pool.table("a")
    a.write([1], torch.full((1, a.embedding_dim), -7.0))   # a journal transaction of "a"
    pool.persist()
    end = pool.journal.end

    def end_then_die(tag, doc):
        txn = end(tag, doc)
        if doc.get("kind") == "reset":      # the reset marker is durable; nothing after it is done
            os.kill(os.getpid(), 9)
        return txn

    pool.journal.end = end_then_die
    a.load_(torch.load(saved))
raise SystemExit("not killed")
"""


def test_a_sigkill_between_the_reset_marker_and_the_manifest_keeps_the_loaded_rows(
        tmp_pool_dir, tmp_path, monkeypatch, run_py):
    monkeypatch.setenv("DLRM_CXL_RUNS_MB", "64")
    rows = 4096
    pool = MemoryPool.create(tmp_pool_dir, tier="power-sim")
    t = pool.create_table("a", rows, DIM, init="uniform", seed=1)
    sparse = [4 * PER_PAGE, 8 * PER_PAGE, 12 * PER_PAGE]     # alone in their pages: into a run
    t.write(sparse, torch.full((3, DIM), 9.0))
    pool.persist()
    pool.compact()
    pool.close()
    manifest = json.loads((tmp_pool_dir / RUNS_DIR / MANIFEST).read_text())
    assert len(manifest["runs"]) == 1 and not manifest["reset"]
    new = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(9))
    saved = tmp_path / "new.pt"
    torch.save(new, saved)
    proc = run_py(LOAD_CHILD, tmp_pool_dir, saved, check=False)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert json.loads((tmp_pool_dir / RUNS_DIR / MANIFEST).read_text()) == manifest   # killed before it
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(tmp_pool_dir, read_only=True, replay=replay) as p:
            assert torch.equal(p.table("a").view(), new), replay
    # A writer finishes the reset; compactions then drop the marker, and the loaded rows stay.
    with MemoryPool.open(tmp_pool_dir) as p:
        assert torch.equal(p.table("a").view(), new)
        p.table("a").write([2], torch.full((1, DIM), 4.0))
        p.persist()
        p.compact()
        p.table("a").write([3], torch.full((1, DIM), 6.0))
        p.persist()
        p.compact()
    new[2], new[3] = 4.0, 6.0
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(tmp_pool_dir, replay=replay) as p:
            assert torch.equal(p.table("a").view(), new), replay


# --------------------------------------------------------------------------- 9: the header


def test_concurrent_header_writers_lose_no_update(tmp_pool_dir):
    """set_meta, create_table and the compactor's format-version write, each on its own thread:
    pool.json ends with every meta key, every table and format version 3."""
    pool = MemoryPool.create(tmp_pool_dir, tier="power-sim")
    errors: list = []
    n = 40

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)
        return run

    def metas():
        for i in range(n):
            pool.set_meta(**{f"k{i}": i})

    def tables():
        for i in range(n):
            pool.create_table(f"t{i}", 8, 4)

    def compactor():
        # What a compaction does before the overlay's first manifest (MemoryPool.compact's absorb),
        # on the compactor's own thread.
        for _ in range(n):
            pool._write_header(format_version=RUNS_FORMAT_VERSION)

    try:
        threads = [threading.Thread(target=guard(f)) for f in (metas, tables, compactor)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
    finally:
        pool.close()
    h = read_header(tmp_pool_dir)
    assert h["format_version"] == RUNS_FORMAT_VERSION
    assert h["meta"] == {f"k{i}": i for i in range(n)}
    assert [x["name"] for x in h["tables"]] == [f"t{i}" for i in range(n)]
    with MemoryPool.open(tmp_pool_dir) as p:
        assert p.tables() == [f"t{i}" for i in range(n)]


@pytest.mark.parametrize("tier", JOURNALED)
def test_a_final_commit_of_checkpoint_none_that_fails_on_a_full_disk_is_retried_with_its_rows(small_fs, tier):
    """`--checkpoint none` commits a run's rows once, at its end (NoCheckpointer.checkpoint_now):
    a commit that fails on a full disk leaves the rows dirty, and the retry commits them."""
    import random

    from checkpointing import NoCheckpointer, recover

    def dense(step):
        return {"step": step, "model": {"w": torch.zeros(3)}, "optimizer": {"state": {}, "param_groups": []},
                "data_position": None, "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}

    path = small_fs / "pool"
    pool = MemoryPool.create(path, tier=tier)
    try:
        t = pool.create_table("t", 1024, DIM, init="uniform", seed=1)
        ref = t.read(torch.arange(1024)).clone()
        ck = NoCheckpointer(pool, dense)
        ids = torch.arange(100, 400)
        new = torch.randn(ids.numel(), DIM, generator=torch.Generator().manual_seed(3))
        assert not torch.equal(ref[ids], new)
        ck.begin_step(1)
        t.write(ids, new)
        filler = _fill(small_fs)
        with pytest.raises(PoolFullError):
            ck.checkpoint_now(1)
        filler.unlink()
        ck.checkpoint_now(1)          # the retry: the rows are still dirty
        ref[ids] = new
        ck.close()
    finally:
        pool.close()
    assert recover(path).committed_step == 1
    with MemoryPool.open(path) as p:
        assert torch.equal(p.table("t").view(), ref)
