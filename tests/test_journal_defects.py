"""Issue 25, defects 3, 5, 6 and 13, each shown for real (real files, real processes, a real file
system that refuses O_DIRECT, a real full file system; no mocks of the pool or the disk):

* 3: a journal on a file system that refuses O_DIRECT (ramfs here; tmpfs before Linux 6.6, many
  FUSE file systems) is written through the page cache -- every append used to fail with a
  ValueError -- and so is a journal after O_DIRECT refused one write (EINVAL); an append that
  fails after such a fallback changes nothing durable;
* 5: a background compaction that fails reaches the trainer (the next persist or commit) as a
  typed error, instead of letting the journal grow until the disk fills;
* 6: any number of compactions through the row overlay (its 126 run slots used to run out at the
  127th), and a pool left with 126 runs reopens and compacts;
* 13: a journal cut below a commit that was durable (the committed mark) is damage: refused,
  naming the missing steps, nothing changed -- not a torn tail going back many steps.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import wait as futures_wait
from pathlib import Path

import pytest
import torch

from memory_pool import MemoryPool
from memory_pool.journal import MARK, Journal, JournalCorruptError, RecordType
from memory_pool.overlay import MANIFEST, MAX_RUNS, RUNS_DIR
from memory_pool.errors import CompactionError

REPO = Path(__file__).resolve().parents[1]


def _files(d: Path) -> dict[str, str]:
    """sha256 of every file under ``d`` but LOCK (which records the last writer's pid)."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != "LOCK"}


def _child(tmp_path: Path, code: str) -> Path:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(code))
    return path


def _cli(*argv, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dlrm_cxl", *map(str, argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})


_NS: list | None = None


def _in_mount_namespace(tmp_path: Path) -> list[str]:
    """The command prefix that runs a shell command in a mount namespace of its own, where it may
    mount ramfs and tmpfs (root: ``unshare -m``; else a user namespace, ``unshare -rm``): the
    mounts vanish with it. Skips the test where neither works."""
    global _NS
    if _NS is None:
        _NS = []
        probe = tmp_path / "ns-probe"
        probe.mkdir(exist_ok=True)
        ways = (["unshare", "-m", "--propagation", "private"], ["unshare", "-r", "-m", "--propagation", "private"])
        for pre in ways if shutil.which("unshare") else ():
            r = subprocess.run([*pre, "sh", "-c", 'mount -t ramfs ramfs "$0" && mount -t tmpfs -o size=4k tmpfs "$0"',
                                str(probe)], capture_output=True, text=True)
            if r.returncode == 0:
                _NS = pre
                break
    if not _NS:
        pytest.skip("no mount namespace here (needs root, or unprivileged user namespaces, and unshare(1))")
    return _NS


# --------------------------------------------------------------------------- defect 3


RAMFS_CHILD = """
    import errno, hashlib, os, resource, signal, sys
    from pathlib import Path
    import torch
    from memory_pool import MemoryPool, PoolFullError
    from memory_pool.journal import Journal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # past RLIMIT_FSIZE: EFBIG, as on a full disk
    root, phase = Path(sys.argv[1]), sys.argv[2]
    d, ROWS, DIM = root / "pool", 1024, 64

    def vals(seed, n):
        return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))

    def durable(pool):
        # What survives: the journal's committed transactions and the image's bytes.
        j = Journal(pool.storage_dir / "journal", read_only=True)
        return ([(t.tag, t.end.seq) for t in j.txns], j.tail_damage,
                hashlib.sha256((pool.storage_dir / "tables" / "a.bin").read_bytes()).hexdigest())

    def write(pool, t, ref, ids, seed):
        v = vals(seed, ids.numel())
        t.write(ids, v)
        ref[ids] = v
        pool.persist()

    if phase == "write":
        try:   # the premise: this file system refuses O_DIRECT, as the journal's fcntl finds
            os.close(os.open(root / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT))
            sys.exit("the file system took O_DIRECT: the test shows nothing here")
        except OSError as e:
            assert e.errno == errno.EINVAL, e
        pool = MemoryPool.create(d, tier="pmem")
        t = pool.create_table("a", ROWS, DIM, init="uniform", seed=1)
        ref = t.read(torch.arange(ROWS)).clone()
        write(pool, t, ref, torch.arange(0, ROWS, 7), 1)   # the first append (a ValueError before)
        assert pool.journal.direct is False, "O_DIRECT was refused: written through the page cache"
        write(pool, t, ref, torch.arange(3, ROWS, 5), 2)
        pool.compact()
        assert torch.equal(t.view(), ref)
        write(pool, t, ref, torch.arange(1, ROWS, 11), 3)
        # An append after the fallback that fails (the file size limit: EFBIG) changes nothing
        # durable: the same commits, the same image.
        before = durable(pool)
        size = sum(p.stat().st_size for p in (pool.storage_dir / "journal").glob("seg-*.log"))
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 1000, resource.RLIM_INFINITY))
        t.write(torch.arange(ROWS), vals(4, ROWS))
        try:
            pool.persist()
            sys.exit("the persist past the file size limit did not fail")
        except PoolFullError as e:
            assert "File too large" in str(e), e
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        assert durable(pool) == before, (durable(pool), before)
        pool.close()                                   # (the failed batch is never persisted)
        torch.save(ref, root / "ref.pt")
    elif phase == "reopen":
        ref = torch.load(root / "ref.pt")
        pool = MemoryPool.open(d)
        t = pool.table("a")
        assert torch.equal(t.view(), ref), "the pool is as committed before the failed append"
        write(pool, t, ref, torch.arange(2, ROWS, 3), 5)   # a fresh journal: the fallback again
        assert pool.journal.direct is False
        write(pool, t, ref, torch.arange(5, ROWS, 13), 6)
        pool.compact()
        write(pool, t, ref, torch.arange(4, ROWS, 9), 7)
        pool.close()
        torch.save(ref, root / "ref.pt")
    else:
        ref = torch.load(root / "ref.pt")
        for replay in ("eager", "on-demand"):
            with MemoryPool.open(d, replay=replay) as pool:
                assert torch.equal(pool.table("a").view(), ref), replay
    print(phase, "ok", flush=True)
"""


def test_a_pool_on_a_file_system_that_refuses_o_direct_appends_flushes_and_replays_through_the_page_cache(tmp_path):
    """ramfs refuses O_DIRECT (EINVAL at the journal's fcntl), as tmpfs before Linux 6.6 and many
    FUSE file systems do. Before the fix the segment's tail block was kept before O_DIRECT was
    known to be off, and the first append failed with a ValueError."""
    ns = _in_mount_namespace(tmp_path)
    child = _child(tmp_path, RAMFS_CHILD)
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    script = ('mount -t ramfs ramfs "$0" && for phase in write reopen check; do '
              f'"{sys.executable}" "{child}" "$0" $phase || exit $?; done')
    r = subprocess.run([*ns, "sh", "-c", script, str(mnt)], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert r.stdout.split() == ["write", "ok", "reopen", "ok", "check", "ok"], r.stdout


EINVAL_CHILD = """
    import hashlib, resource, signal, sys
    from pathlib import Path
    import torch
    from memory_pool import MemoryPool, PoolFullError
    from memory_pool.journal import Journal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    d, ROWS, DIM = Path(sys.argv[1]), 1024, 64

    def vals(seed, n):
        return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))

    def durable(pool):
        j = Journal(pool.storage_dir / "journal", read_only=True)
        return ([(t.tag, t.end.seq) for t in j.txns], j.tail_damage,
                hashlib.sha256((pool.storage_dir / "tables" / "a.bin").read_bytes()).hexdigest())

    pool = MemoryPool.create(d, tier="pmem")
    t = pool.create_table("a", ROWS, DIM, init="uniform", seed=1)
    ref = t.read(torch.arange(ROWS)).clone()
    ids = torch.arange(0, ROWS, 3)
    t.write(ids, vals(1, ids.numel())); ref[ids] = vals(1, ids.numel())
    pool.persist()
    assert pool.journal.direct, "the journal writes with O_DIRECT here"
    before = durable(pool)
    # An unaligned file size limit: O_DIRECT refuses the write it cuts short (EINVAL), the journal
    # writes it again through the page cache, which reports the real error (EFBIG).
    size = sum(p.stat().st_size for p in (pool.storage_dir / "journal").glob("seg-*.log"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 1000, resource.RLIM_INFINITY))
    t.write(torch.arange(ROWS), vals(2, ROWS))
    try:
        pool.persist()
        sys.exit("the persist past the file size limit did not fail")
    except PoolFullError as e:
        assert "File too large" in str(e), e
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert not pool.journal.direct, "the refused direct write switched the journal to the page cache"
    assert durable(pool) == before, "the failed append changed nothing durable"
    # The appends after the fallback (before the fix: a ValueError, the stale tail block).
    for seed, step in ((3, 2), (4, 5)):
        ids = torch.arange(seed, ROWS, step)       # (every row of the failed batch is rewritten)
        v = vals(seed, ids.numel())
        t.write(ids, v); ref[ids] = v
        pool.persist()
    t.write(torch.arange(ROWS), ref)              # the failed batch's values in memory: put back
    pool.persist()
    assert torch.equal(t.view(), ref)
    pool.close()
    torch.save(ref, d / "ref.pt")
    print("ok", flush=True)
"""


def test_appends_after_o_direct_refused_a_write_go_through_the_page_cache_and_a_failed_one_changes_nothing(
        tmp_path):
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        pytest.skip("the temporary directory's file system does not take O_DIRECT")
    finally:
        os.close(fd)
        probe.unlink()
    d = tmp_path / "pool"
    r = subprocess.run([sys.executable, str(_child(tmp_path, EINVAL_CHILD)), str(d)], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr[-4000:]
    ref = torch.load(d / "ref.pt")
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(d, replay=replay) as pool:
            assert torch.equal(pool.table("a").view(), ref), replay
            assert pool.journal.tail == [] and pool.journal.tail_damage is None


# --------------------------------------------------------------------------- defect 5


ROWS, DIM, PER_PAGE = 4096, 64, 16      # 256-byte rows, 16 a page


def _new_pool(path, tier="pmem"):
    pool = MemoryPool.create(path, tier=tier)
    t = pool.create_table("a", ROWS, DIM, init="uniform", seed=1)
    return pool, t, t.read(torch.arange(ROWS)).clone()


def _write(pool, t, ref, ids, seed):
    ids = torch.as_tensor(ids, dtype=torch.int64)
    vals = torch.randn(ids.numel(), DIM, generator=torch.Generator().manual_seed(seed))
    t.write(ids, vals)
    ref[ids] = vals
    pool.persist()


def test_a_failed_background_compaction_reaches_the_next_persist_as_a_typed_error_and_loses_nothing(
        tmp_pool_dir, monkeypatch):
    """The compaction's new run cannot be written (its directory is a file: a real EEXIST from
    mkdir). Before the fix the next compaction replaced the failed job without looking at it."""
    monkeypatch.setenv("DLRM_CXL_RUNS_MB", "64")      # a row overlay: the compaction writes a run
    pool, t, ref = _new_pool(tmp_pool_dir)
    _write(pool, t, ref, [3 * PER_PAGE, 90 * PER_PAGE + 2, 200 * PER_PAGE], 1)   # sparse: into a run
    runs = pool.storage_dir / RUNS_DIR
    runs.write_text("not a directory\n")
    job = pool.compact(wait=False)
    futures_wait([job])
    assert isinstance(job.exception(), FileExistsError)   # (the premise: it failed, for real)
    t.write([7], torch.full((1, DIM), 2.0))
    ref[7] = 2.0
    with pytest.raises(CompactionError) as err:
        pool.persist()
    assert err.value.exit_code == 10
    assert isinstance(err.value.__cause__, FileExistsError) and "runs" in str(err.value.__cause__)
    assert "background compaction failed" in str(err.value) and "recover" in err.value.hint
    pool.persist()                                   # reported once; the rows are still dirty
    pool.close()
    runs.unlink()
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(tmp_pool_dir, replay=replay) as p:
            assert torch.equal(p.table("a").view(), ref), replay


def test_a_compaction_failing_under_the_trainer_stops_it_with_the_typed_error_and_it_resumes_bit_exact(tmp_path):
    """A real full file system under the runs (a 4 KiB tmpfs mounted on <pool>/runs): the
    trainer's background compaction fails with ENOSPC. Before the fix training went on to its
    last step (exit 0) while no compaction succeeded; now the next commit stops it with the
    PoolFullError (exit 6, one line, its hint), and the pool resumes to the uninterrupted run's
    digest."""
    ns = _in_mount_namespace(tmp_path)
    small = {"DLRM_CXL_SEGMENT_MB": "0.25", "DLRM_CXL_COMPACT_MB": "0.5", "DLRM_CXL_RUNS_MB": "64"}
    args = ["--preset", "tiny", "--tier", "pmem", "--threads", "1", "--no-progress"]
    ref = _cli("train", "--pool", tmp_path / "ref", *args, "--steps", 12)
    assert ref.returncode == 0, ref.stderr[-3000:]
    pool = tmp_path / "pool"
    r = _cli("train", "--pool", pool, *args, "--steps", 1)      # (default thresholds: no compaction, no runs)
    assert r.returncode == 0 and not (pool / RUNS_DIR).exists(), r.stderr[-3000:]
    (pool / RUNS_DIR).mkdir()
    script = f'mount -t tmpfs -o size=4k tmpfs "$0/{RUNS_DIR}" && exec "{sys.executable}" -m dlrm_cxl "$@"'
    r = subprocess.run([*ns, "sh", "-c", script, str(pool), "train", "--pool", str(pool), *args, "--steps", "12"],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", **small})
    assert r.returncode == 6, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "No space left on device" in r.stderr and "hint:" in r.stderr, r.stderr
    assert "run-" in r.stderr, r.stderr                    # it names the run file it could not write
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("dlrm-cxl train: error:")], r.stderr
    again = _cli("train", "--pool", pool, *args, "--steps", 12, env=small)
    assert again.returncode == 0, again.stderr[-3000:]
    digest = [ln for ln in again.stdout.splitlines() if ln.startswith("state_digest")]
    assert digest and digest == [ln for ln in ref.stdout.splitlines() if ln.startswith("state_digest")]


def test_a_compaction_failing_for_another_reason_stops_the_cli_with_exit_10_and_it_resumes_bit_exact(tmp_path):
    """Not a full disk, not EIO: the runs' directory is a file (a real EEXIST from mkdir in the
    trainer's background compaction). The CLI exits with CompactionError's own code, 10, one line
    and its hint, no traceback; once the file is gone the same command ends in the uninterrupted
    run's digest."""
    small = {"DLRM_CXL_SEGMENT_MB": "0.25", "DLRM_CXL_COMPACT_MB": "0.5", "DLRM_CXL_RUNS_MB": "64"}
    args = ["--preset", "tiny", "--tier", "pmem", "--threads", "1", "--no-progress"]
    ref = _cli("train", "--pool", tmp_path / "ref", *args, "--steps", 12)
    assert ref.returncode == 0, ref.stderr[-3000:]
    pool = tmp_path / "pool"
    r = _cli("train", "--pool", pool, *args, "--steps", 1)      # (default thresholds: no compaction, no runs)
    assert r.returncode == 0 and not (pool / RUNS_DIR).exists(), r.stderr[-3000:]
    (pool / RUNS_DIR).write_text("not a directory\n")
    r = _cli("train", "--pool", pool, *args, "--steps", 12, env=small)
    assert r.returncode == CompactionError.exit_code == 10, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "background compaction failed: FileExistsError" in r.stderr, r.stderr
    assert f"hint: {CompactionError.default_hint}" in r.stderr, r.stderr
    (pool / RUNS_DIR).unlink()
    again = _cli("train", "--pool", pool, *args, "--steps", 12, env=small)
    assert again.returncode == 0, again.stderr[-3000:]
    digest = [ln for ln in again.stdout.splitlines() if ln.startswith("state_digest")]
    assert digest and digest == [ln for ln in ref.stdout.splitlines() if ln.startswith("state_digest")]


# --------------------------------------------------------------------------- defect 6


def _manifest_runs(pool_dir: Path) -> list[str]:
    return [r["file"] for r in json.loads((pool_dir / RUNS_DIR / MANIFEST).read_text())["runs"]]


def _compact_sparse(pool, t, ref, i: int) -> None:
    """Compaction ``i``: one row alone in its page (page ``i``), so each compaction writes a run of
    its own and no run is dropped before the run slots run out (the bound is far away)."""
    _write(pool, t, ref, [i % (ROWS // PER_PAGE) * PER_PAGE + i // (ROWS // PER_PAGE)], 100 + i)
    pool.compact()


def test_more_compactions_than_run_slots_keep_every_row(tmp_pool_dir, monkeypatch):
    """Before the fix the 127th compaction failed (IndexError: no free slot, the dropped run's
    slot came back only after the manifest) and left the overlay unusable."""
    monkeypatch.setenv("DLRM_CXL_RUNS_MB", "64")
    pool, t, ref = _new_pool(tmp_pool_dir)
    for i in range(MAX_RUNS + 14):
        _compact_sparse(pool, t, ref, i)
        if i >= MAX_RUNS - 1:
            # at the slot limit: every run slot held, the pool unchanged (the rows as written)
            assert pool.describe()["overlay"]["runs"] == MAX_RUNS and pool._compaction.overlay.broken is None
            assert torch.equal(t.view(), ref)
    assert pool.stats.compactions == MAX_RUNS + 14
    pool.close()
    runs = _manifest_runs(tmp_pool_dir)
    assert len(runs) == MAX_RUNS
    assert {p.name for p in (tmp_pool_dir / RUNS_DIR).glob("run-*.bin")} == set(runs)  # dropped runs deleted
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(tmp_pool_dir, replay=replay) as p:
            assert torch.equal(p.table("a").view(), ref), replay


def test_a_pool_left_with_every_run_slot_held_reopens_and_compacts(tmp_pool_dir, monkeypatch):
    """What the old bug left on disk: a manifest naming 126 runs, the run file of the compaction
    that failed (no manifest names it), and the journal rows it did not drop. Before the fix every
    compaction after the reopen failed the same way."""
    monkeypatch.setenv("DLRM_CXL_RUNS_MB", "64")
    pool, t, ref = _new_pool(tmp_pool_dir)
    for i in range(MAX_RUNS):
        _compact_sparse(pool, t, ref, i)
    _write(pool, t, ref, [250 * PER_PAGE + 5], 7)          # journal rows no compaction dropped
    pool.close()
    runs = _manifest_runs(tmp_pool_dir)
    assert len(runs) == MAX_RUNS
    gen = json.loads((tmp_pool_dir / RUNS_DIR / MANIFEST).read_text())["next_gen"]
    orphan = tmp_pool_dir / RUNS_DIR / f"run-{gen:016x}.bin"
    shutil.copyfile(tmp_pool_dir / RUNS_DIR / runs[-1], orphan)
    pool = MemoryPool.open(tmp_pool_dir)
    t = pool.table("a")
    assert torch.equal(t.view(), ref) and not orphan.exists()
    for i in range(MAX_RUNS, MAX_RUNS + 5):
        _compact_sparse(pool, t, ref, i)
        assert pool.describe()["overlay"]["runs"] == MAX_RUNS and torch.equal(t.view(), ref)
    pool.close()
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(tmp_pool_dir, replay=replay) as p:
            assert torch.equal(p.table("a").view(), ref), replay


# --------------------------------------------------------------------------- defect 13


def test_a_journal_cut_below_a_durable_commit_is_damage_that_recover_refuses_changing_nothing(tmp_path):
    """The issue's repro: a pmem pool's 4.8 MB journal cut to 2 MB. Before the fix `recover`
    went back from step 30 to step 12 and called the rest an unfinished tail."""
    pool = tmp_path / "pool"
    args = ["--preset", "tiny", "--tier", "pmem", "--threads", "1", "--no-progress", "--window", "1"]
    r = _cli("train", "--pool", pool, *args, "--steps", 30)
    assert r.returncode == 0, r.stderr[-3000:]
    (seg,) = (pool / "journal").glob("seg-*.log")
    assert seg.stat().st_size > 4 << 20
    os.truncate(seg, 2 << 20)
    before = _files(pool)
    for argv in (["recover", "--pool", pool], ["train", "--pool", pool, *args, "--steps", 31]):
        r = _cli(*argv)
        assert r.returncode == 4, (argv[0], r.returncode, r.stdout[-2000:], r.stderr[-3000:])
        assert "Traceback" not in r.stderr and "hint:" in r.stderr, r.stderr
        assert "committed steps" in r.stderr and "are missing" in r.stderr and "(step 2" in r.stderr, r.stderr
        assert _files(pool) == before, argv[0]


def _steps(j: Journal, steps, nbytes: int = 150_000) -> None:
    for step in steps:
        j.append(RecordType.ROWS, step, [bytes([step % 251]) * nbytes])
        j.append(RecordType.DENSE, step, [bytes([step % 13]) * 3000])
        j.end(step, {"step": step, "kind": "commit"})


def test_a_deleted_last_segment_is_refused_naming_the_committed_steps_that_are_missing(tmp_path):
    j = Journal(tmp_path, segment_bytes=256 << 10)
    _steps(j, range(24))                                     # 3.7 MB: the mark moved 3 times
    j.close()
    segs = sorted(tmp_path.glob("seg-*.log"))
    last = Journal(tmp_path, read_only=True).txns[-1].end.segment
    for p in segs[segs.index(last) - 3:]:                    # the segments of the newest ~7 steps
        p.unlink()
    before = _files(tmp_path)
    for read_only in (True, False):
        with pytest.raises(JournalCorruptError, match=r"committed steps \(\d+\.\.\d+\) are missing") as err:
            Journal(tmp_path, read_only=read_only)
        assert err.value.exit_code == 4
    assert _files(tmp_path) == before


def test_a_cut_a_crash_can_leave_is_still_a_torn_tail_and_compacted_records_are_not_missing(tmp_path):
    """The mark is no false alarm: a torn unfinished transaction after the newest commit (what a
    crash leaves), and records a compaction dropped (below START), are not lost commits."""
    j = Journal(tmp_path, segment_bytes=1 << 20)
    _steps(j, range(20))
    tail = j.append(RecordType.ROWS, 20, [b"\x07" * 150_000])
    j.flush()
    j.close()
    assert (tmp_path / MARK).exists()
    os.truncate(tail.segment, tail.payload_offset + 1000)   # the unfinished step's record cut
    back = Journal(tmp_path)
    assert [t.tag for t in back.txns] == list(range(20)) and back.torn_bytes > 0 and back.tail_damage is None
    back.truncate_tail()
    _steps(back, range(20, 30))
    back.rotate()
    back.reclaim(back.next_seq)                              # every sealed segment dropped: START moves
    back.close()
    again = Journal(tmp_path, read_only=True)
    assert again.txns == [] and again.start_seq == again.next_seq
