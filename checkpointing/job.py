"""Pools of a job of several ranks: ``DIR/job.json`` and one pool per rank, ``DIR/rank-R``.

A step is globally committed when every rank has committed it, so recovering a job means:
read each rank's commit record, take the smallest, G, and bring every rank to G — rolling back
further a rank that had committed more (it kept the undo records and dense snapshot for that).

``job.json`` (:func:`write_job_file`, :func:`read_job_file`): a JSON object (world size, model,
seed, data) with a ``crc32`` of its canonical JSON — the object without ``crc32``, sorted keys,
compact separators: the convention of the pool's ``pool.json`` header. Written through
``atomic_write`` (tmp, fsync, rename, fsync dir); a damaged or truncated file raises
``PoolCorruptError`` naming it (exit code 4). The checksum is required.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from memory_pool import (MemoryPool, PoolCorruptError, PoolFormatError, RecoveryError, atomic_write, json_crc,
                         json_with_crc, parse_json_object)

from .digest import combine_digests
from .jobdir import JOB_FILE, is_job, numbered_rank_dirs, rank_number
from .recovery import RecoveryReport, checkpoint_status, recover

__all__ = ["JOB_FILE", "is_job", "rank_dirs", "recover_path", "recover_job", "JobRecoveryReport",
           "job_committed_steps", "write_job_file", "read_job_file"]


def write_job_file(path, job: dict) -> None:
    """Durably write ``DIR/job.json``: ``job`` (JSON-able) plus the crc32 of its canonical JSON."""
    body = {k: v for k, v in job.items() if k != "crc32"}
    atomic_write(Path(path) / JOB_FILE, json_with_crc(body, indent=1))


def read_job_file(path) -> dict:
    """Read and verify ``DIR/job.json``; returns the job without its ``crc32``.

    Raises ``PoolCorruptError`` (naming the file) when it is not a JSON object, has no checksum
    or fails it (a flipped byte, a truncated file), ``PoolFormatError`` when it cannot be read."""
    f = Path(path) / JOB_FILE
    try:
        raw = f.read_bytes()
    except FileNotFoundError:
        raise PoolFormatError(f"{path} is not a job of several ranks: {JOB_FILE} is missing") from None
    except OSError as exc:
        raise PoolFormatError(f"{f}: unreadable job file ({exc})") from None
    doc = parse_json_object(raw, f, "job file",
                            hint="the job file is damaged; restore it from a copy, or start over with --fresh")
    body = {k: v for k, v in doc.items() if k != "crc32"}
    if "crc32" not in doc:
        raise PoolCorruptError(f"{f}: job file has no checksum (crc32): damaged, or written by an older dlrm-cxl",
                               hint="start over with --fresh")
    crc = json_crc(body)
    if doc["crc32"] != crc:
        raise PoolCorruptError(f"{f}: job file checksum mismatch (stored {doc['crc32']}, computed {crc})",
                               hint="the job file is damaged; restore it from a copy, or start over with --fresh")
    return body


def rank_dirs(path) -> list[Path]:
    """The rank pools of the job at ``path``, in rank order; ``PoolFormatError`` unless they are
    exactly ``rank-0`` .. ``rank-N``."""
    dirs = numbered_rank_dirs(path)
    if [rank_number(p) for p in dirs] != list(range(len(dirs))) or not dirs:
        raise PoolFormatError(f"{path}: rank pools {[p.name for p in dirs]} are not rank-0..rank-N")
    return dirs


def job_committed_steps(path) -> list[int | None]:
    out = []
    for d in rank_dirs(path):
        with MemoryPool.open(d, read_only=True, rows=False) as pool:
            out.append(checkpoint_status(pool)["committed_step"])
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


def recover_path(path, *, dry_run: bool = False, digest: bool = True, crash_phase: str | None = None,
                 no_replay: bool = False) -> RecoveryReport | JobRecoveryReport:
    """Recover whatever ``path`` holds: the entry point for a path a user gives (``dlrm-cxl recover``).

    A job of several ranks (``DIR/job.json``): every rank is brought to the newest step all ranks
    committed (:func:`recover_job`, a JobRecoveryReport; ``crash_phase`` applies to one pool only
    and is ignored). Anything else is one pool (:func:`checkpointing.recovery.recover`), which
    refuses one rank of a job alone.
    """
    if is_job(path):
        # (the ranks stop at the common recovery point: a replay needs every rank together,
        # which `torchrun ... dlrm_cxl train` does as it resumes)
        return recover_job(path, dry_run=dry_run, digest=digest)
    return recover(path, dry_run=dry_run, digest=digest, crash_phase=crash_phase, no_replay=no_replay)


def recover_job(path, *, dry_run: bool = False, digest: bool = True) -> JobRecoveryReport:
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
