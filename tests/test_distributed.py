"""Training beyond one process: sharded pools per rank, coordinated commit, elastic recovery.

The torchrun tests start real processes (gloo on CPU) and kill a rank with SIGKILL; the
coordination test drives two ranks' checkpointers in one process to put one rank *ahead* of
the other deterministically, then checks that job recovery brings it back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpointing import UndoLogCheckpointer, recover, state_digest
from checkpointing.job import is_job, recover_job
from memory_pool import MemoryPool, RecoveryError

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _torchrun(pool: Path, *extra: str, restarts: int = 0, steps: int = 8) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = TORCHRUN + ["--max-restarts", str(restarts), "-m", "dlrm_cxl", "train", "--pool", str(pool),
                      "--preset", "tiny", "--steps", str(steps), "--no-progress", "--threads", "1", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _digest(out: subprocess.CompletedProcess) -> str:
    lines = [l for l in out.stdout.splitlines() if l.startswith("state_digest ")]
    assert lines, out.stdout + out.stderr
    return lines[-1].split()[1]


def _inspect(pool: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "dlrm_cxl", "inspect", "--pool", str(pool), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-process run of 8 steps."""
    pool = tmp_path_factory.mktemp("ref") / "job"
    out = _torchrun(pool)
    assert out.returncode == 0, out.stderr[-3000:]
    return pool, _digest(out)


def test_two_rank_job_shards_tables_and_inspect_reports_the_job(reference):
    pool, digest = reference
    assert is_job(pool)
    info = _inspect(pool)
    assert info["world_size"] == 2 and info["step"] == 8 and not info["needs_recovery"]
    assert info["state_digest"] == digest
    names = [sorted(t["name"] for t in r["tables"] if not t["name"].endswith(".adagrad")) for r in info["ranks"]]
    assert names[0] == sorted(f"cat_{f}" for f in range(0, 26, 2))  # table-wise: feature f on rank f % 2
    assert names[1] == sorted(f"cat_{f}" for f in range(1, 26, 2))
    assert not set(names[0]) & set(names[1])


@pytest.mark.parametrize("window", [None, "3"])
def test_killed_rank_is_restarted_by_torchrun_and_the_job_ends_bit_exact(reference, tmp_path, window):
    """(--window 3: recovery points at steps 3 and 6; the kill at step 5 sends both ranks back to
    step 3, and they replay step 4 together from its records.)"""
    _, ref_digest = reference
    pool = tmp_path / "job"
    out = _torchrun(pool, "--crash-rank", "1", "--crash-at", "5:mid-update", *(["--window", window] if window else []),
                    restarts=3)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "crash injection: SIGKILL at step 5 mid-update" in out.stderr
    assert "recovered to step" in out.stdout + out.stderr  # the restarted job recovered first
    assert _digest(out) == ref_digest
    if window:
        assert "replaying steps 4.." in out.stdout + out.stderr, out.stdout[-2000:]


def test_job_interrupted_without_restart_recovers_with_the_cli_and_resumes_bit_exact(reference, tmp_path):
    _, ref_digest = reference
    pool = tmp_path / "job"
    out = _torchrun(pool, "--crash-rank", "0", "--crash-at", "6:after-log")
    assert out.returncode != 0
    assert _inspect(pool)["needs_recovery"]
    # A rank alone cannot be recovered: it could end at another step than the other rank.
    alone = subprocess.run([sys.executable, "-m", "dlrm_cxl", "recover", "--pool", str(pool / "rank-0")],
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 4 and "recover the whole job" in alone.stderr
    rec = subprocess.run([sys.executable, "-m", "dlrm_cxl", "recover", "--pool", str(pool), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert rec.returncode == 0, rec.stderr
    rep = json.loads(rec.stdout)
    assert rep["committed_step"] < 6 and 6 in rep["rolled_back_steps"]
    assert not _inspect(pool)["needs_recovery"]
    out = _torchrun(pool)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _digest(out) == ref_digest


class _SharedMin:
    """Coordinator of two in-process 'ranks': global_min over both checkpointers' commits."""

    def __init__(self):
        self.ckpts: list[UndoLogCheckpointer] = []

    def global_min(self, value: int) -> int:
        return min(c._durable_commit for c in self.ckpts)


def _toy_step(ck: UndoLogCheckpointer, table, k: int) -> None:
    rows = torch.tensor([k % 5, 5 + k % 3])
    with ck.step(k):
        ck.log_before_image([(table, rows)])
        ck.persist()
        ck.update(lambda: table.scatter_rows(rows, table.view().index_select(0, rows) + k))


def test_rank_ahead_of_the_others_is_rolled_back_to_the_global_commit(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "job.json").write_text(json.dumps({"world_size": 2}))
    coord = _SharedMin()
    pools, tables, ckpts, digests_at = [], [], [], {}
    for r in range(2):
        pool = MemoryPool.create(job / f"rank-{r}", tier="pmem")
        tables.append(pool.create_table(f"t{r}", 16, 4, init="uniform", seed=r))
        pools.append(pool)
    dense = lambda step: {"step": step, "model": {}, "optimizer": {}, "data_position": None, "rng": {}}
    for r in range(2):
        ckpts.append(UndoLogCheckpointer(pools[r], dense, window=1, coordinator=coord))
    coord.ckpts = ckpts
    for c in ckpts:
        c.checkpoint_now(0)
    for k in range(1, 5):  # both ranks commit steps 1..4
        for r in range(2):
            _toy_step(ckpts[r], tables[r], k)
        digests_at[k] = [state_digest(p, dense(k)) for p in pools]
    for c in ckpts:
        c.drain()
    # Step 5: rank 0 commits it durably; rank 1 logs and updates, then "dies" before committing.
    _toy_step(ckpts[0], tables[0], 5)
    ckpts[0].checkpoint_now(5)
    rows = torch.tensor([0, 6])
    ckpts[1].begin_step(5)
    ckpts[1].log_before_image([(tables[1], rows)])
    ckpts[1].persist()
    ckpts[1].update(lambda: tables[1].scatter_rows(rows, tables[1].view().index_select(0, rows) + 100))
    assert state_digest(pools[0], dense(4)) != digests_at[4][0]  # rank 0 really is ahead
    for c, p in zip(ckpts, pools):
        c.close()
        p.close()
    with pytest.raises(RecoveryError):  # a rank alone is never recovered
        recover(job / "rank-0")
    rep = recover_job(job)
    assert rep.committed_step == 4
    assert rep.ranks[0].rolled_back_steps == [5] and rep.ranks[1].rolled_back_steps == [5]
    for r in range(2):
        with MemoryPool.open(job / f"rank-{r}", read_only=True) as p:
            assert state_digest(p, dense(4)) == digests_at[4][r]
    again = recover_job(job)  # idempotent: nothing left to do
    assert not again.needed and again.committed_step == 4
