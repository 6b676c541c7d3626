"""Pools of a job of several ranks: ``DIR/job.json`` and one pool per rank, ``DIR/rank-R``.

A step is globally committed when every rank has committed it, so recovering a job means:
read each rank's commit record, take the smallest, G, and bring every rank to G — rolling back
further a rank that had committed more (it kept the undo records and dense snapshot for that).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from memory_pool import MemoryPool, PoolFormatError
from memory_pool.errors import RecoveryError

from .digest import combine_digests
from .store import ckpt_dir, read_commit

__all__ = ["JOB_FILE", "is_job", "rank_dirs", "recover_job", "JobRecoveryReport", "job_committed_steps"]

JOB_FILE = "job.json"


def is_job(path) -> bool:
    return (Path(path) / JOB_FILE).exists()


def rank_dirs(path) -> list[Path]:
    dirs = [p for p in Path(path).glob("rank-*") if p.name[5:].isdigit()]
    dirs.sort(key=lambda p: int(p.name[5:]))
    if [int(p.name[5:]) for p in dirs] != list(range(len(dirs))) or not dirs:
        raise PoolFormatError(f"{path}: rank pools {[p.name for p in dirs]} are not rank-0..rank-N")
    return dirs


def job_committed_steps(path) -> list[int | None]:
    out = []
    for d in rank_dirs(path):
        with MemoryPool.open(d, read_only=True) as pool:
            c = read_commit(ckpt_dir(pool.storage_dir))
        out.append(c["step"] if c else None)
    return out


@dataclass
class JobRecoveryReport:
    path: str
    committed_step: int | None
    needed: bool
    dry_run: bool
    ranks: list = field(default_factory=list)
    rows_restored: int = 0
    seconds: float = 0.0
    actions: list = field(default_factory=list)
    state_digest: str | None = None

    @property
    def rolled_back_steps(self) -> list[int]:
        return sorted({s for r in self.ranks for s in r.rolled_back_steps}, reverse=True)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["rolled_back_steps"] = self.rolled_back_steps
        return d


def recover_job(path, *, dry_run: bool = False, digest: bool = True) -> JobRecoveryReport:
    from .recovery import recover

    t0 = time.perf_counter()
    steps = job_committed_steps(path)
    if any(s is None for s in steps):
        if all(s is None for s in steps):
            return JobRecoveryReport(str(path), None, False, dry_run, actions=["no rank holds training state"])
        raise RecoveryError(f"{path}: ranks {[i for i, s in enumerate(steps) if s is None]} hold no commit record")
    g = min(steps)
    rep = JobRecoveryReport(str(path), g, False, dry_run)
    for rank, (d, c) in enumerate(zip(rank_dirs(path), steps)):
        r = recover(d, dry_run=dry_run, digest=digest, target_step=g if c > g else None, rank_of_job=True)
        rep.ranks.append(r)
        rep.needed |= r.needed or c > g
        rep.rows_restored += r.rows_restored
        rep.actions += [f"rank {rank}: {a}" for a in r.actions]
        if c > g:
            rep.actions.append(f"rank {rank}: had committed step {c}, ahead of the job: brought back to {g}")
    rep.seconds = time.perf_counter() - t0
    if digest and all(r.state_digest for r in rep.ranks):
        rep.state_digest = combine_digests([r.state_digest for r in rep.ranks])
    return rep
