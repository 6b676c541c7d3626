"""shm regions outlive a pool directory deleted by hand: OWNER records, find_regions, gc, and the
CLI's `destroy` and `gc`. Real files and real tmpfs: each test gets its own shm root, a fresh
directory in /dev/shm (DLRM_CXL_SHM_DIR), so that it sees only its own regions; one test uses the
default root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zlib
from pathlib import Path

import pytest
import torch

from dlrm_cxl.cli import main
from memory_pool import MemoryPool, find_regions, gc
from memory_pool.lifecycle import OWNER_FILE, region_bytes
from memory_pool.tiers import shm_root

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def shm_dir(monkeypatch) -> Path:
    """A private shm root on tmpfs (its name does not start with dlrm-cxl-, so that it is never
    taken for a region of the default root); removed with every region in it afterwards."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="dlrmcxl-test-lifecycle-", dir=base))
    monkeypatch.setenv("DLRM_CXL_SHM_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def make_pool(path: Path, tier: str = "shm") -> tuple[Path, Path]:
    """A closed pool with one small table; returns (pool dir, its storage dir)."""
    with MemoryPool.create(path, tier=tier) as pool:
        pool.create_table("t", 100, 8, init="uniform", seed=1)
        return path, pool.storage_dir


def status_of(region: Path) -> str | None:
    return next((r.status for r in find_regions() if r.path == region), None)


def test_create_records_the_owner(shm_dir, tmp_path):
    pool, region = make_pool(tmp_path / "p")
    assert region.parent == shm_dir and region.name.startswith("dlrm-cxl-")
    doc = json.loads((region / OWNER_FILE).read_text())
    body = {"pool_dir": str(pool.resolve()), "pool_id": region.name[len("dlrm-cxl-"):]}
    assert doc == {**body, "crc32": zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())}
    [info] = find_regions()
    assert (info.path, info.owner, info.pool_id, info.status) == (region, pool.resolve(), body["pool_id"], "in-use")
    assert info.size_bytes >= 100 * 8 * 4 and info.size_bytes == region_bytes(region)
    # other tiers have no region
    make_pool(tmp_path / "q", tier="pmem")
    assert [r.path for r in find_regions()] == [region]


def test_rm_rf_pool_is_orphan_and_gc_removes_it(shm_dir, tmp_path):
    pool, region = make_pool(tmp_path / "p")
    shutil.rmtree(pool)  # what a user does
    [info] = find_regions()
    assert info.status == "orphan" and "is gone" in info.reason
    assert [r.path for r in gc(dry_run=True)] == [region]
    assert region.is_dir()  # a dry run removes nothing
    removed = gc()
    assert [r.path for r in removed] == [region] and removed[0].size_bytes > 0
    assert not region.exists() and find_regions() == []
    assert gc() == []


def test_live_pool_is_in_use_and_kept(shm_dir, tmp_path):
    pool, region = make_pool(tmp_path / "p")
    with MemoryPool.open(pool, read_only=True) as ro:
        before = ro.table("t").read(torch.arange(100))
    assert status_of(region) == "in-use"
    assert gc() == [] and gc(dry_run=True) == []
    with MemoryPool.open(pool, read_only=True) as ro:
        assert torch.equal(ro.table("t").read(torch.arange(100)), before)


def test_pool_open_by_a_writer_is_locked_and_kept(shm_dir, tmp_path):
    pool, region = make_pool(tmp_path / "p")
    with MemoryPool.open(pool):
        [info] = find_regions()
        assert info.status == "locked" and "LOCK" in info.reason
        assert gc() == []
        # A writer between creating its region and writing pool.json (MemoryPool.create holds
        # the lock all along) must not lose the region either.
        (pool / "pool.json").rename(pool / "pool.json.aside")
        assert status_of(region) == "locked"
        assert gc() == [] and region.is_dir()
    assert status_of(region) == "orphan"  # unlocked and no pool.json: the create was abandoned
    (pool / "pool.json.aside").rename(pool / "pool.json")
    assert status_of(region) == "in-use"


def test_pool_locked_by_another_process_is_kept(shm_dir, tmp_path):
    pool, region = make_pool(tmp_path / "p")
    code = textwrap.dedent("""
        import sys
        from memory_pool import MemoryPool
        p = MemoryPool.open(sys.argv[1])
        print("ready", flush=True)
        sys.stdin.read()
        p.close()
    """)
    child = subprocess.Popen([sys.executable, "-c", code, str(pool)], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert child.stdout.readline().strip() == "ready"
        assert status_of(region) == "locked"
        assert gc() == [] and region.is_dir()
        assert main(["destroy", "--pool", str(pool)]) == 5
        assert (pool / "pool.json").exists() and region.is_dir()
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert status_of(region) == "in-use"


def test_pool_replaced_at_the_same_path(shm_dir, tmp_path):
    pool, old = make_pool(tmp_path / "p")
    shutil.rmtree(pool)
    _, new = make_pool(tmp_path / "p")
    assert {r.path: r.status for r in find_regions()} == {old: "orphan", new: "in-use"}
    assert "another pool" in next(r.reason for r in find_regions() if r.path == old)
    assert [r.path for r in gc()] == [old]
    assert not old.exists() and new.is_dir()


def test_region_without_owner_is_unknown_and_kept(shm_dir, tmp_path):
    legacy = shm_dir / "dlrm-cxl-0123456789abcdef0123456789abcdef"  # made before OWNER records
    (legacy / "tables").mkdir(parents=True)
    (legacy / "tables" / "t.bin").write_bytes(b"\0" * 8192)
    pool, damaged = make_pool(tmp_path / "p")
    doc = json.loads((damaged / OWNER_FILE).read_text())
    (damaged / OWNER_FILE).write_text(json.dumps({**doc, "crc32": doc["crc32"] ^ 1}))
    shutil.rmtree(pool)
    (shm_dir / "dlrm-cxl-not-a-dir").write_text("x")  # only directories are regions
    infos = {r.path: r for r in find_regions()}
    assert set(infos) == {legacy, damaged}
    assert infos[legacy].status == infos[damaged].status == "unknown"
    assert infos[legacy].owner is None and infos[legacy].size_bytes >= 8192
    assert gc() == [] and legacy.is_dir() and damaged.is_dir()


def test_gc_under_only_touches_that_directory(shm_dir, tmp_path):
    a, ra = make_pool(tmp_path / "a" / "p")
    b, rb = make_pool(tmp_path / "b" / "p")
    shutil.rmtree(tmp_path / "a")
    shutil.rmtree(tmp_path / "b")
    assert [r.path for r in gc(under=tmp_path / "a")] == [ra]
    assert not ra.exists() and rb.is_dir()


# --------------------------------------------------------------------------- CLI


def test_cli_gc(shm_dir, tmp_path, capsys):
    keep, r_keep = make_pool(tmp_path / "keep")
    gone, r_gone = make_pool(tmp_path / "gone")
    shutil.rmtree(gone)
    capsys.readouterr()
    assert main(["gc", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dry_run"] and doc["root"] == str(shm_dir) and doc["removed_count"] == 1
    assert {r["path"]: r["status"] for r in doc["regions"]} == {str(r_keep): "in-use", str(r_gone): "orphan"}
    assert r_gone.is_dir()
    assert main(["gc"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("removed 1 orphaned region, ") and out[-1].endswith(" MB")
    assert any(str(r_keep) in line and line.startswith("in-use") for line in out)
    assert not r_gone.exists() and r_keep.is_dir()
    assert main(["gc"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "removed 0 orphaned regions, 0.0 MB"


def test_cli_gc_subprocess_dry_run(shm_dir, tmp_path):
    pool, region = make_pool(tmp_path / "p")
    shutil.rmtree(pool)
    exe = Path(sys.executable).with_name("dlrm-cxl")
    proc = subprocess.run([str(exe), "gc", "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DLRM_CXL_SHM_DIR": str(shm_dir)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("would remove 1 orphaned region, ")
    assert "orphan" in proc.stdout and str(region) in proc.stdout
    assert region.is_dir()


def test_cli_destroy_removes_pool_and_region(shm_dir, tmp_path, capsys):
    pool, region = make_pool(tmp_path / "p")
    capsys.readouterr()
    assert main(["destroy", "--pool", str(pool), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "pool" and doc["regions_removed"][0]["path"] == str(region)
    assert doc["bytes_freed"] >= 100 * 8 * 4
    assert not pool.exists() and not region.exists()
    # pmem: no region
    pool, _ = make_pool(tmp_path / "q", tier="pmem")
    assert main(["destroy", "--pool", str(pool)]) == 0
    assert capsys.readouterr().out.strip() == f"destroyed pool {pool}"
    assert not pool.exists()


def test_cli_destroy_with_damaged_header_still_frees_the_region(shm_dir, tmp_path):
    pool, region = make_pool(tmp_path / "p")
    (pool / "pool.json").write_text("{ damaged")
    assert main(["destroy", "--pool", str(pool)]) == 0
    assert not pool.exists() and not region.exists()


def test_cli_destroy_refuses_what_is_not_a_pool(shm_dir, tmp_path, capsys):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    empty = tmp_path / "empty"
    empty.mkdir()
    for d in (other, empty, tmp_path / "missing"):
        assert main(["destroy", "--pool", str(d)]) == 3
        err = capsys.readouterr().err
        assert err.startswith("dlrm-cxl destroy: error: ") and "\nhint: " in err and "Traceback" not in err
    assert (other / "todo.txt").read_text() == "keep me" and empty.is_dir()
    # a directory holding pools is not a pool either
    _, region = make_pool(other / "p")
    assert main(["destroy", "--pool", str(other)]) == 3
    assert (other / "p" / "pool.json").exists() and region.is_dir()


def test_cli_destroy_locked_pool_exits_5(shm_dir, tmp_path, capsys):
    pool, region = make_pool(tmp_path / "p")
    with MemoryPool.open(pool):
        assert main(["destroy", "--pool", str(pool)]) == 5
        assert "locked" in capsys.readouterr().err
        assert (pool / "pool.json").exists() and region.is_dir()
    assert main(["destroy", "--pool", str(pool)]) == 0
    assert not pool.exists() and not region.exists()


def test_cli_destroy_job_directory(shm_dir, tmp_path, capsys):
    job = tmp_path / "job"
    job.mkdir()
    (job / "job.json").write_text(json.dumps({"world_size": 2}))
    regions = [make_pool(job / f"rank-{r}")[1] for r in range(2)]
    with MemoryPool.open(job / "rank-1"):  # one locked rank: nothing is deleted
        assert main(["destroy", "--pool", str(job)]) == 5
    assert all((job / f"rank-{r}" / "pool.json").exists() for r in range(2)) and all(r.is_dir() for r in regions)
    capsys.readouterr()
    assert main(["destroy", "--pool", str(job), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "job" and doc["pools"] == [str(job / "rank-0"), str(job / "rank-1")]
    assert sorted(r["path"] for r in doc["regions_removed"]) == sorted(map(str, regions))
    assert not job.exists() and not any(r.exists() for r in regions)


# --------------------------------------------------------------------------- the default root


def test_orphan_in_the_default_shm_root(tmp_path, monkeypatch):
    monkeypatch.delenv("DLRM_CXL_SHM_DIR", raising=False)
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    pool, region = make_pool(tmp_path / "p")
    try:
        assert region.parent == shm_root() == Path("/dev/shm")
        shutil.rmtree(pool)
        assert status_of(region) == "orphan"
        assert [r.path for r in gc(dry_run=True, under=tmp_path)] == [region] and region.is_dir()
        assert [r.path for r in gc(under=tmp_path)] == [region]
        assert not region.exists()
    finally:
        shutil.rmtree(region, ignore_errors=True)
