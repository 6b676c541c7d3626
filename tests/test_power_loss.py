"""A power loss that really loses what was not synced (memory_pool/fileio.py), the crash-state
checker (tools/crash_states.py) on a short sweep, and a real power loss under the file system:
ext4 on a loop device, frozen right after a SIGKILL and copied, then recovered from the copy."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import tool
from memory_pool import MemoryPool, fileio


@pytest.fixture
def watched(tmp_path):
    """A directory watched by the layer, as a pool of the power-sim tier is."""
    fileio.watch(tmp_path)
    yield tmp_path
    fileio.unwatch(tmp_path)


def _write_file(path: Path, data: bytes, *, sync: bool, sync_dir: bool, flags=os.O_CREAT | os.O_RDWR) -> None:
    fd = fileio.open(path, flags)
    try:
        fileio.pwrite(fd, data, 0)
        if sync:
            fileio.fdatasync(fd)
    finally:
        fileio.close(fd)
    if sync_dir:
        fileio.fsync_dir(path.parent)


# --------------------------------------------------------------------------- the layer, on real files
def test_an_overwrite_survives_a_power_loss_only_once_fdatasynced(watched):
    f = watched / "data"
    _write_file(f, b"A" * 10000, sync=True, sync_dir=True)
    _write_file(f, b"B" * 6000, sync=False, sync_dir=False)
    assert f.read_bytes() == b"B" * 6000 + b"A" * 4000       # the process sees its write
    fileio.unwatch(watched)
    rep = fileio.power_on(watched)
    assert rep.undone == 1 and f.read_bytes() == b"A" * 10000  # the power loss takes it back
    assert not (watched / fileio.LOG_DIR).exists()


def test_a_synced_overwrite_is_kept_by_a_power_loss(watched):
    f = watched / "data"
    _write_file(f, b"A" * 10000, sync=True, sync_dir=True)
    _write_file(f, b"B" * 6000, sync=True, sync_dir=False)
    fileio.unwatch(watched)
    fileio.power_on(watched)
    assert f.read_bytes() == b"B" * 6000 + b"A" * 4000


def test_an_append_past_the_end_is_cut_off_again(watched):
    f = watched / "log"
    _write_file(f, b"x" * 100, sync=True, sync_dir=True)
    fd = fileio.open(f, os.O_RDWR)
    fileio.pwrite(fd, b"y" * 5000, 100)
    fileio.close(fd)
    fileio.unwatch(watched)
    fileio.power_on(watched)
    assert f.read_bytes() == b"x" * 100


def test_a_new_file_is_gone_unless_its_directory_was_synced(watched):
    kept, lost = watched / "kept", watched / "lost"
    _write_file(kept, b"k", sync=True, sync_dir=True)
    _write_file(lost, b"l", sync=True, sync_dir=False)       # data synced, name not
    fileio.unwatch(watched)
    fileio.power_on(watched)
    assert kept.read_bytes() == b"k" and not lost.exists()


def test_a_rename_over_a_file_is_undone_unless_the_directory_was_synced(watched):
    old, tmp = watched / "MANIFEST", watched / ".MANIFEST.tmp"
    _write_file(old, b"old", sync=True, sync_dir=True)
    _write_file(tmp, b"new", sync=True, sync_dir=False)
    fileio.rename(tmp, old)
    assert old.read_bytes() == b"new"
    fileio.unwatch(watched)
    fileio.power_on(watched)
    assert old.read_bytes() == b"old" and not tmp.exists()


def test_a_rename_made_durable_by_its_directory_stays(watched):
    old, tmp = watched / "MANIFEST", watched / ".MANIFEST.tmp"
    _write_file(old, b"old", sync=True, sync_dir=True)
    _write_file(tmp, b"new", sync=True, sync_dir=False)
    fileio.rename(tmp, old)
    fileio.fsync_dir(watched)
    fileio.unwatch(watched)
    fileio.power_on(watched)
    assert old.read_bytes() == b"new" and not tmp.exists()
    assert not list(watched.glob(f"{fileio.LOG_DIR}/*"))      # the displaced file's copy is gone


def test_an_unlink_comes_back_unless_the_directory_was_synced(watched):
    a, b = watched / "a", watched / "b"
    _write_file(a, b"aa", sync=True, sync_dir=True)
    _write_file(b, b"bb", sync=True, sync_dir=True)
    fileio.unlink(a)
    fileio.unlink(b)
    fileio.fsync_dir(watched)                                  # both removals durable...
    _write_file(a, b"a2", sync=True, sync_dir=True)
    fileio.unlink(a)                                           # ...this one not
    fileio.unwatch(watched)
    fileio.power_on(watched)
    assert a.read_bytes() == b"a2" and not b.exists()


def test_an_atomic_write_without_its_fsyncs_is_lost_and_with_them_kept(watched):
    from memory_pool.durable import atomic_write

    atomic_write(watched / "doc", b"v1")
    atomic_write(watched / "doc", b"v2", durable=False)
    fileio.unwatch(watched)
    fileio.power_on(watched)
    assert (watched / "doc").read_bytes() == b"v1"


def test_a_store_through_a_shared_mapping_is_lost_unless_noted_and_synced(watched):
    import mmap

    f = watched / "image"
    _write_file(f, bytes(8192), sync=True, sync_dir=True)
    fd = fileio.open(f, os.O_RDWR)
    with mmap.mmap(fd, 8192) as m:
        view = torch.frombuffer(m, dtype=torch.uint8).view(32, 256)
        ids = torch.tensor([3, 17])
        fileio.note_rows(fd, ids.numpy(), 256, view.index_select(0, ids).numpy())
        view.index_copy_(0, ids, torch.full((2, 256), 7, dtype=torch.uint8))
        del view
    fileio.close(fd)
    assert f.read_bytes().count(7) == 512
    fileio.unwatch(watched)
    fileio.power_on(watched)
    assert f.read_bytes() == bytes(8192)


def test_a_prefix_keeps_the_first_unsynced_writes_in_order(watched):
    f = watched / "log"
    _write_file(f, b"", sync=True, sync_dir=True)
    fd = fileio.open(f, os.O_RDWR)
    for i in range(4):
        fileio.pwrite(fd, bytes([65 + i]) * 100, 100 * i)
    fileio.close(fd)
    fileio.unwatch(watched)
    assert fileio.unsynced_count(watched) == 4
    fileio.power_on(watched, fileio.Lose("prefix", keep=2))
    assert f.read_bytes() == b"A" * 100 + b"B" * 100


def test_a_torn_write_leaves_each_block_old_or_new(watched):
    f = watched / "seg"
    _write_file(f, b"o" * 65536, sync=True, sync_dir=True)
    fd = fileio.open(f, os.O_RDWR)
    fileio.pwrite(fd, b"n" * 65536, 0)
    fileio.close(fd)
    fileio.unwatch(watched)
    seen = set()
    for seed in range(12):
        copy = watched.parent / f"copy-{seed}"
        shutil.copytree(watched, copy)
        fileio.power_on(copy, fileio.Lose("subset", seed=seed, block=512))
        data = (copy / "seg").read_bytes()
        blocks = {data[i:i + 512] for i in range(0, 65536, 512)}
        assert blocks <= {b"o" * 512, b"n" * 512}               # whole blocks, never a mix inside
        seen.add(0 < data.count(b"n") < 65536)
    assert True in seen                                        # some state was really torn


# --------------------------------------------------------------------------- the pool
def test_power_sim_loses_rows_whose_journal_fdatasync_was_skipped(tmp_path, run_py):
    """The check the emulation exists for: with the pool's fdatasync calls skipped, rows that
    `persist` reported durable are gone after a SIGKILL (before the emulation they stayed, in the
    page cache, and no test saw it); with the syncs, they are there."""
    for skip in (False, True):
        d = tmp_path / f"pool-{skip}"
        with MemoryPool.create(d, tier="power-sim") as pool:
            pool.create_table("t", 64, 8)
        proc = run_py(f"""
            import os, signal, torch
            import memory_pool.fileio as fio
            if {skip}:
                fio.fdatasync = lambda fd: None   # every fdatasync call site of the pool skipped
            from memory_pool import MemoryPool
            pool = MemoryPool.open({str(d)!r})
            pool.table("t").write(torch.arange(4), torch.full((4, 8), 3.0))
            pool.persist()
            os.kill(os.getpid(), signal.SIGKILL)
        """, check=False)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        with MemoryPool.open(d) as pool:
            rows = pool.table("t").read(torch.arange(4))
        assert bool((rows == 3.0).all()) is (not skip), f"skip={skip}: {rows}"


@pytest.fixture(scope="module")
def states_tool():
    return tool("crash_states")


@pytest.mark.parametrize("tier", ["power-sim", "pmem"])
def test_every_crash_state_of_a_short_run_recovers_bit_exactly(tier, tmp_path, states_tool):
    lines = []
    # (one kill at a random moment, one where a write is always unsynced: two random kills once
    # both landed where everything was synced, and the sweep proved nothing)
    res = states_tool.sweep(tier=tier, steps=14, kills=2, states=4, seed=3, pool_dir=tmp_path, log=lines.append,
                            phases=("random", "mid-dense"))
    assert not res.reference_failed, res.reference_failed
    assert len(res.states) == 8 and not res.failed, "\n".join(lines)
    assert any(s.undone for s in res.states), "no state lost anything: the sweep proved nothing\n" + "\n".join(lines)
    assert res.resumed == 2


# --------------------------------------------------------------------------- a real power loss
def _can_loop() -> str | None:
    if os.geteuid() != 0:
        return "needs root (losetup, mount)"
    for tool in ("losetup", "mkfs.ext4", "blockdev", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not Path("/dev/loop-control").exists():
        return "no loop devices here"
    return None


def _sh(*cmd) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


class _Loop:
    """An ext4 file system on a loop device over ``img``, mounted at ``mnt``."""

    def __init__(self, img: Path, mnt: Path, *, make: bool):
        if make:
            _sh("truncate", "-s", "256M", str(img))
            _sh("mkfs.ext4", "-q", "-F", str(img))
        self.img, self.mnt = img, mnt
        self.dev = _sh("losetup", "-f", "--show", str(img))
        mnt.mkdir(parents=True, exist_ok=True)
        try:
            _sh("mount", self.dev, str(mnt))
        except BaseException:
            _sh("losetup", "-d", self.dev)
            raise

    def freeze_and_copy(self, copy: Path) -> None:
        """The power loss: from now on nothing reaches the device; what it holds is copied."""
        _sh("blockdev", "--setro", self.dev)
        _sh("cp", "--sparse=always", str(self.img), str(copy))

    def close(self) -> None:
        subprocess.run(["blockdev", "--setrw", self.dev], capture_output=True)
        subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)
        subprocess.run(["losetup", "-d", self.dev], capture_output=True)


@pytest.fixture(scope="module")
def loop_refs(tmp_path_factory):
    """Per-step reference digests of the runs the loop-device test kills (one Cli, one process)."""
    why = _can_loop()
    if why:
        pytest.skip(why)
    torture = tool("torture")
    states = tool("crash_states")
    cli = torture.Cli(env=states.SMALL_THRESHOLDS)
    d = tmp_path_factory.mktemp("loop-refs")
    yield cli, torture, {
        tier: cli.step_digests(["train", "--pool", str(d / tier), *_loop_flags(tier)], 20)
        for tier in ("pmem", "power-sim")}
    cli.close()
    from memory_pool import destroy_pool

    for pool in d.iterdir():   # (a pmem pool's applied mark lives in /dev/shm: destroy removes it)
        destroy_pool(pool)


def _loop_flags(tier):
    return ["--preset", "tiny", "--tier", tier, "--seed", "5", "--threads", "1", "--no-progress"]


@pytest.mark.parametrize("tier,kill", [("pmem", 9), ("power-sim", 13), ("pmem", 17)])
def test_a_real_power_loss_under_ext4_recovers_bit_exactly_and_resumes(tier, kill, tmp_path, loop_refs):
    """SIGKILL the trainer at a random moment of step ``kill`` (compaction and the overlay active),
    freeze the device at once and copy it: the copy holds what reached the device, nothing that
    was only in the page cache. Recovery from it is a plain recovery (not damage), at most 2 steps
    behind, bit-exact; resuming reaches the uninterrupted run's digest."""
    cli, torture, refs = loop_refs
    ref = refs[tier]
    loop = _Loop(tmp_path / "disk.img", tmp_path / "mnt", make=True)
    copied = None
    try:
        pool = loop.mnt / "pool"
        run = cli.run(["train", "--pool", str(pool), "--steps", "20", "--crash-at", f"{kill}:random",
                       *_loop_flags(tier)], timeout=300)
        loop.freeze_and_copy(tmp_path / "after-power-loss.img")
        assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    finally:
        loop.close()
    try:
        copied = _Loop(tmp_path / "after-power-loss.img", tmp_path / "mnt2", make=False)
        pool = copied.mnt / "pool"
        rec = cli.run(["recover", "--pool", str(pool), "--json"], timeout=300)
        assert rec.returncode == 0, rec.stderr[-2000:]
        rep = json.loads(rec.stdout)
        c = rep["committed_step"]
        assert kill - 2 <= c <= kill, rep
        assert rep["state_digest"] == ref[c]
        done = cli.run(["train", "--pool", str(pool), "--steps", "20", *_loop_flags(tier)], timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert torture.parse_digest(done.stdout) == ref[20]
    finally:
        if copied is not None:
            copied.close()


def test_a_real_power_loss_keeps_a_synced_write_even_when_its_undo_entry_reached_the_disk(tmp_path):
    """The layer's own sync: the kernel may write the undo log back at any moment, so its entry
    for a write can be on the disk while the write's fdatasync then returns. The marker that the
    sync cancels it must be durable too (``sync_log``): else the power loss would take back data
    the file system had made durable. ext4 on a loop device, frozen and copied as above."""
    why = _can_loop()
    if why:
        pytest.skip(why)
    loop = _Loop(tmp_path / "disk.img", tmp_path / "mnt", make=True)
    root = loop.mnt / "pool"
    copied = None
    try:
        root.mkdir()
        f = root / "data"
        _write_file(f, b"o" * 8192, sync=True, sync_dir=True)
        fileio.watch(root)
        try:
            fd = fileio.open(f, os.O_RDWR)
            fileio.pwrite(fd, b"n" * 8192, 0)                      # its undo entry goes to the log...
            for log in (root / fileio.LOG_DIR).glob("undo-*.log"):  # ...which the kernel writes back early
                lfd = os.open(log, os.O_RDONLY)
                os.fsync(lfd)
                os.close(lfd)
            fileio.fsync_dir(root / fileio.LOG_DIR)
            fileio.fsync_dir(root)
            fileio.fdatasync(fd)                                    # durable: the write must survive
            fileio.close(fd)
            fileio.pwrite(fileio.open(root / "other", os.O_CREAT | os.O_RDWR), b"x", 0)  # the log stays
            loop.freeze_and_copy(tmp_path / "after.img")
        finally:
            fileio.unwatch(root)
    finally:
        loop.close()
    try:
        copied = _Loop(tmp_path / "after.img", tmp_path / "mnt2", make=False)
        fileio.power_on(copied.mnt / "pool")
        assert (copied.mnt / "pool" / "data").read_bytes() == b"n" * 8192
    finally:
        if copied is not None:
            copied.close()


@pytest.mark.parametrize("when", ["inside", "after"])
def test_a_real_power_loss_right_after_a_directory_sync_leaves_the_log_able_to_undo_it(tmp_path, when):
    """The layer's log around a directory's fsync, which makes durable every name changed in the
    directory -- here a new run file and a manifest renamed over the old one.

    * ``inside`` (write-ahead for the log, ``fileio._log_first``): the rename's undo entry must be
      durable before that fsync. A power loss right after it (before the layer's markers) otherwise
      kept the new manifest with no entry to undo it, while the run's creation entry, synced
      earlier with the run's data, was undone: a manifest naming a missing run (seen once in the
      loop-device test above). Either state is fine, but never that one.
    * ``after`` (the marker's sync, ``fsync_dir``'s ``sync_log``): once the fsync has returned the
      names are durable, and the marker that says so must be too: else the power loss took back
      a rename the file system had made durable.

    ext4 on a loop device, frozen and copied inside or right after the fsync; with either sync
    removed, its case fails."""
    why = _can_loop()
    if why:
        pytest.skip(why)
    loop = _Loop(tmp_path / "disk.img", tmp_path / "mnt", make=True)
    runs = loop.mnt / "pool" / "runs"
    copied = None
    try:
        runs.mkdir(parents=True)
        _write_file(runs / "MANIFEST", b"old", sync=True, sync_dir=True)
        fileio.fsync_dir(runs.parent)
        fileio.watch(runs.parent)
        real = os.fsync
        try:
            _write_file(runs / "run-1.bin", b"r" * 4096, sync=True, sync_dir=False)  # its creation entry: synced
            _write_file(runs / "MANIFEST.tmp", b"new", sync=True, sync_dir=False)
            fileio.rename(runs / "MANIFEST.tmp", runs / "MANIFEST")

            def fsync_then_power_loss(fd):
                real(fd)
                os.fsync = real
                loop.freeze_and_copy(tmp_path / "after.img")

            if when == "inside":
                os.fsync = fsync_then_power_loss
                try:
                    fileio.fsync_dir(runs)
                except OSError:
                    pass  # (the markers after the sync meet the frozen device)
            else:
                fileio.fsync_dir(runs)
                loop.freeze_and_copy(tmp_path / "after.img")
        finally:
            os.fsync = real
            fileio.unwatch(runs.parent)
    finally:
        loop.close()
    try:
        copied = _Loop(tmp_path / "after.img", tmp_path / "mnt2", make=False)
        fileio.power_on(copied.mnt / "pool")
        after = copied.mnt / "pool" / "runs"
        manifest, run = (after / "MANIFEST").read_bytes(), (after / "run-1.bin").exists()
        assert manifest in (b"old", b"new")
        assert (manifest == b"new") == run, (manifest, run)  # never a manifest naming a missing run
        if when == "after":
            assert manifest == b"new" and run  # what the fsync made durable stays
    finally:
        if copied is not None:
            copied.close()


def _commit_three_records(j, tag) -> None:
    """A transaction of three 100-byte records and its END, appended to journal ``j``."""
    from memory_pool.journal import RecordType

    for _ in range(3):
        j.append(RecordType.UNDO, tag, [bytes(100)])
    j.end(tag, {"step": tag, "kind": "commit"})


def test_a_reused_segment_whose_records_never_came_is_not_damage_after_a_power_loss(tmp_path):
    """A reclaimed segment reused for new records gets a new header, synced before its rename
    (``Journal._reuse_free``): a power loss before the first record must leave a segment that
    reads as empty, not one named for the new life with the old life's header (damage)."""
    from memory_pool.journal import Journal

    commit = _commit_three_records
    fileio.watch(tmp_path)
    try:
        j = Journal(tmp_path, segment_bytes=700)
        for tag in range(8):
            commit(j, tag)
        j.reclaim(j.txns[-1].first_seq)
        assert list(tmp_path.glob("free-*.log")), "the test needs reclaimed segments"
        commit(j, 8)
        before, tags = j.recycled, [t.tag for t in j.txns]
        j.rotate()                       # the next segment: a reclaimed one, renamed, new header
        assert j.recycled == before + 1
        j.close()
    finally:
        fileio.unwatch(tmp_path)
    fileio.power_on(tmp_path)            # the power goes before any record is written into it
    back = Journal(tmp_path)
    assert [t.tag for t in back.txns] == tags and back.tail_damage is None
    commit(back, 9)
    back.close()
    assert [t.tag for t in Journal(tmp_path).txns] == tags + [9]


def test_a_finished_run_without_recovery_points_is_still_finished_after_a_power_loss(cli, tmp_path):
    """`--checkpoint none` marks a pool as being trained while it runs and removes the mark at its
    clean end, durably (the directory is synced): after a power loss the finished run must not
    read as one interrupted mid-way (recovery would refuse it: rows changed in place)."""
    pool = tmp_path / "pool"
    r = cli.run(["train", "--pool", str(pool), "--preset", "tiny", "--tier", "power-sim", "--steps", "4",
                 "--checkpoint", "none", "--no-progress"])
    assert r.returncode == 0, r.stderr[-2000:]
    rec = cli.run(["recover", "--pool", str(pool), "--json"])    # its open takes the power loss first
    assert rec.returncode == 0, rec.stderr[-2000:]
    assert json.loads(rec.stdout)["committed_step"] == 4


def test_an_empty_segment_left_by_a_power_loss_stays_gone_after_the_next_one(tmp_path):
    """A power loss right after a new segment was started (its name durable, its header not)
    leaves an empty segment file: the next writer removes it and appends to the segment before
    it. That removal must be durable before a commit in that segment is: else a second power
    loss brings the empty file back, named for sequence numbers the earlier segment now holds,
    and the journal reads as damaged (records "missing" before it)."""
    from memory_pool.journal import Journal

    commit = _commit_three_records
    fileio.watch(tmp_path)
    try:
        j = Journal(tmp_path)
        for tag in range(3):
            commit(j, tag)
        j.rotate()                       # a new segment: its name durable, its header not yet
        j.close()
    finally:
        fileio.unwatch(tmp_path)
    fileio.power_on(tmp_path)
    segs = sorted(tmp_path.glob("seg-*.log"))
    assert len(segs) == 2 and segs[-1].stat().st_size == 0, [(p.name, p.stat().st_size) for p in segs]
    fileio.watch(tmp_path)
    try:
        back = Journal(tmp_path)
        commit(back, 3)                  # removes the empty segment, appends to the one before
        back.close()
    finally:
        fileio.unwatch(tmp_path)
    fileio.power_on(tmp_path)            # what the commit's syncs made durable stays
    assert [t.tag for t in Journal(tmp_path).txns] == [0, 1, 2, 3]


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_commit_record_alone_costs_one_sync_and_every_record_before_an_end_survives(tmp_path, direct):
    """``Journal.flush`` skips an ``fdatasync`` with nothing to make durable (a step's commit
    record alone, inside a recovery window: one sync, not two). What it may never skip: the sync
    of records written since the last one, before the ``END`` that vouches for them (a new
    segment's header is synced with its first record). An emulated power loss after each kind
    of transaction, across segments and a reopen, keeps exactly the committed ones."""
    from memory_pool.journal import Journal, RecordType

    fileio.watch(tmp_path)
    try:
        j = Journal(tmp_path, segment_bytes=900, direct=direct)
        _commit_three_records(j, 0)
        syncs = j.syncs
        j.end(1, {"step": 1})                       # a commit record alone: one sync
        assert j.syncs == syncs + 1
        _commit_three_records(j, 2)                 # records, then their END: two
        assert j.syncs == syncs + 3
        for tag in range(3, 8):                     # across new segments (900 bytes each)
            _commit_three_records(j, tag) if tag % 2 else j.end(tag, {"step": tag})
        j.close()
        again = Journal(tmp_path, segment_bytes=900, direct=direct)   # a descriptor new to it
        again.append(RecordType.UNDO, 8, [b"x" * 300])
        again.end(8, {"step": 8})
        again.close()
    finally:
        fileio.unwatch(tmp_path)
    fileio.power_on(tmp_path)
    back = Journal(tmp_path)
    assert [t.tag for t in back.txns] == list(range(9))
    assert back.tail_damage is None
    assert bytes(back.read(back.txns[-1].records[0])) == b"x" * 300


def test_a_tail_segment_cut_by_recovery_stays_gone_after_a_power_loss(tmp_path):
    """``Journal.truncate_tail`` removes the segments after the newest ``END`` (a crashed
    transaction's records), and syncs the directory before anything is appended: else a power
    loss after the next commit brings the removed segment back, named for sequence numbers the
    segment before it now holds, and the journal reads as damaged (or replays the abandoned
    records). The next commit here goes into the segment before the removed one (buffered
    writes append to it), so no later directory sync hides a missing one."""
    from memory_pool.journal import Journal, RecordType

    commit = _commit_three_records
    fileio.watch(tmp_path)
    try:
        j = Journal(tmp_path, segment_bytes=4096)
        for tag in range(3):
            commit(j, tag)
        j.rotate()                       # a crash leaves records of step 3 in a segment of their own
        for _ in range(3):
            j.append(RecordType.UNDO, 3, [b"\xee" * 100])
        j.flush()
        j.close()
        back = Journal(tmp_path, segment_bytes=4096)
        assert back.tail and len(list(tmp_path.glob("seg-*.log"))) == 2
        back.truncate_tail()             # recovery: the abandoned step's segment removed
        assert len(list(tmp_path.glob("seg-*.log"))) == 1
        commit(back, 3)                  # appended to the first segment, synced
        back.close()
    finally:
        fileio.unwatch(tmp_path)
    fileio.power_on(tmp_path)
    after = Journal(tmp_path)
    assert len(list(tmp_path.glob("seg-*.log"))) == 1, sorted(p.name for p in tmp_path.glob("seg-*.log"))
    assert [t.tag for t in after.txns] == [0, 1, 2, 3] and not after.tail and after.tail_damage is None
    assert bytes(after.read(after.txns[-1].records[0])) == bytes(100)


def _fresh_pool(path):
    """A power-sim pool of table ``t`` (uniform) and its state, closed cleanly: its
    ``fresh.bits`` says every row is initial."""
    from memory_pool.fresh import FRESH_FILE

    with MemoryPool.create(path, tier="power-sim") as pool:
        pool.create_table("t", 200, 4, init="uniform", seed=5)
        pool.create_table("t.adagrad", 200, 1, init="zeros")
        pool.persist()
    assert (path / FRESH_FILE).exists()  # (the clean close's file survived that close's power loss)


def _rows_after_power_on(path, rows):
    """Rows ``rows`` of ``t`` as a DRAM cache brings them in after the power comes back (the
    killed writer's unsynced undone), and how many it created instead of reading."""
    from dlrm_cxl.fused import bind_cached

    pool = MemoryPool.open(path, dram_cache_bytes=64 << 10)
    try:
        arena = bind_cached(pool, [pool.table("t")], [pool.table("t.adagrad")], optimizer="rowwise_adagrad",
                            lr=0.1, eps=1e-8, batch_size=4).arena
        arena.prefetch([rows])
        g = arena.groups[0]
        return g.slots[0][g.row_slot[rows].to(torch.int64)].clone(), arena.stats.rows_created
    finally:
        pool.close()


def test_a_bulk_loads_removal_of_the_bitmap_is_durable_before_a_power_loss(tmp_path, run_py):
    """A journaled tier keeps ``fresh.bits`` while the pool is open (memory_pool/fresh.py). A
    bulk load writes the image itself, not through the journal, so it removes the file and
    syncs the directory before the image changes: without that sync an emulated power loss
    brings the file back, and it claims the loaded rows are still initial -- the cache would
    create their old values. (``FreshRows.written``'s ``_remove_durably``; a test of a sync must
    fail without it: ``tools/sync_mutants.py``.)"""
    path = tmp_path / "p"
    _fresh_pool(path)
    proc = run_py(f"""
        import os, signal, torch
        from memory_pool import MemoryPool
        pool = MemoryPool.open({str(path)!r})
        pool.table("t").load_(torch.full((200, 4), 2.0))
        os.kill(os.getpid(), signal.SIGKILL)
    """, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    values, created = _rows_after_power_on(path, torch.arange(6))
    assert torch.equal(values, torch.full((6, 4), 2.0)) and created == 0


def test_a_compactions_save_of_the_bitmap_is_durable_before_a_power_loss(tmp_path, run_py):
    """A compaction saves the bitmap durably before the journal's START moves past the records
    of rows 0-3: after a power loss no open clears them, and a file that came back older would
    say they are initial (``Compaction.compact``, ``FreshRows.save``'s ``atomic_write``)."""
    from test_fresh_rows import writer_killed

    path = tmp_path / "p"
    _fresh_pool(path)
    writer_killed(run_py, path, compact=True)
    values, created = _rows_after_power_on(path, torch.arange(6))
    assert torch.equal(values[:4], torch.full((4, 4), 3.0)) and created == 2


def _compacted_without_a_file(run_py, path, *, first: str, before_compact: str = ""):
    """A writer of ``path`` runs ``first``, trains rows 0-3 of ``t`` to 3.0, persists, runs
    ``before_compact`` and has a compaction move START past them, which must leave no
    ``fresh.bits``; it is killed; after the power comes back rows 0-3 must read 3.0, none created."""
    proc = run_py(f"""import os, signal, torch
from memory_pool import MemoryPool
pool = MemoryPool.open({str(path)!r})
{first}
pool.table("t").write(torch.arange(4), torch.full((4, 4), 3.0))
pool.persist()
{before_compact}
pool.compact()
assert not os.path.exists(os.path.join({str(path)!r}, "fresh.bits"))
os.kill(os.getpid(), signal.SIGKILL)
""", check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    values, created = _rows_after_power_on(path, torch.arange(6))
    assert torch.equal(values[:4], torch.full((4, 4), 3.0)) and created == 0


def test_a_failed_save_of_the_bitmap_removes_the_old_file_durably_before_the_journal_moves_on(tmp_path, run_py):
    """A save that fails (here the temporary file's name is taken by a directory: the write
    fails with EISDIR, as a full disk would fail it) removes the file saved before, durably:
    the compaction then moves START past rows 0-3, and that older file, back after a power loss,
    would say they are initial (``FreshRows.save``'s ``_remove_durably``)."""
    path = tmp_path / "p"
    _fresh_pool(path)
    _compacted_without_a_file(run_py, path, first="pool.persist()  # (the file saved again, every row initial)",
                              before_compact=f"os.mkdir({str(path / '.fresh.bits.tmp')!r})  # (no save can write)")


def test_a_save_with_no_bitmap_left_removes_the_old_file_durably(tmp_path, run_py):
    """Handing the tables' memory out without a cache (``arena_tensor``: the uncached fused
    kernels) drops every bitmap; the next save then has nothing to write and removes the file
    saved before, durably -- else a power loss brings back a file that says the rows written
    since are initial (``FreshRows._save``'s ``_remove_durably``)."""
    path = tmp_path / "p"
    _fresh_pool(path)
    _compacted_without_a_file(run_py, path, first="pool.arena_tensor()")


def test_a_direct_tiers_open_removes_the_bitmap_durably(watched):
    """On a direct tier (shm, real pmem) rows change in place and nothing lists them, so a
    writer's open removes the file before anything changes, and durably: after a power loss
    it must not come back (``FreshRows.load``'s ``_remove_durably``; real pmem is not on this
    machine, so the emulated power loss of a watched directory stands in)."""
    from memory_pool.fresh import FRESH_FILE, FreshRows, InitSpec

    spec = InitSpec("zeros")
    fresh = FreshRows()
    fresh.add("t", 64, spec)
    assert fresh.save(watched, "pool-id")
    loaded = FreshRows.load(watched, "pool-id", {"t": 64}, {"t": spec}, remove=True)
    assert loaded.count("t") == 64 and not (watched / FRESH_FILE).exists()
    fileio.unwatch(watched)
    fileio.power_on(watched)
    assert not (watched / FRESH_FILE).exists()


def test_a_resumed_writer_that_keeps_the_intact_bitmap_file_reads_its_trained_rows_after_a_power_loss(tmp_path,
                                                                                                      run_py):
    """A journaled writer that opened an intact ``fresh.bits`` does not write it again at its
    first persist (``TableSet.open_all``): the file, synced by the last clean close, still says
    rows 0-3 are initial, and only the journal records its persist synced make them trained.
    After an emulated power loss (the killed writer's unsynced writes undone) the open must
    replay those records and clear rows 0-3: read as 3.0, never created; rows 4-5 created."""
    from memory_pool.fresh import FRESH_FILE

    path = tmp_path / "p"
    _fresh_pool(path)
    ino = (path / FRESH_FILE).stat().st_ino
    proc = run_py(f"""
        import os, signal, torch
        from memory_pool import MemoryPool
        pool = MemoryPool.open({str(path)!r})
        pool.table("t").write(torch.arange(4), torch.full((4, 4), 3.0))
        pool.persist()
        assert os.stat(os.path.join({str(path)!r}, "fresh.bits")).st_ino == {ino}   # (not written again)
        os.kill(os.getpid(), signal.SIGKILL)
    """, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    values, created = _rows_after_power_on(path, torch.arange(6))
    assert torch.equal(values[:4], torch.full((4, 4), 3.0)) and created == 2
