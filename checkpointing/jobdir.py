"""What makes a directory a job of several ranks, by its names alone: ``DIR/job.json`` and one
pool per rank, ``DIR/rank-R``.

It imports nothing of ``checkpointing``, so that :mod:`checkpointing.recovery` (one pool: it
refuses one rank of a job alone) and :mod:`checkpointing.job` (several ranks, which imports
recovery) both use it without importing each other.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["JOB_FILE", "RANK_PREFIX", "is_job", "job_of_rank", "rank_dir", "rank_number", "numbered_rank_dirs"]

JOB_FILE = "job.json"
RANK_PREFIX = "rank-"


def is_job(path) -> bool:
    """Whether ``path`` is the directory of a job of several ranks."""
    return (Path(path) / JOB_FILE).exists()


def rank_dir(path, rank: int) -> Path:
    """``DIR/rank-R``: the pool directory of rank ``rank`` of the job at ``path``."""
    return Path(path) / f"{RANK_PREFIX}{rank}"


def rank_number(path) -> int | None:
    """R for a path named ``rank-R`` (R decimal digits), else None."""
    tail = Path(path).name[len(RANK_PREFIX):]
    return int(tail) if Path(path).name.startswith(RANK_PREFIX) and tail.isdigit() else None


def numbered_rank_dirs(path) -> list[Path]:
    """Every ``DIR/rank-R`` entry of ``path`` (R decimal digits), in rank order. Gaps in the
    numbers, and entries that are not directories, are left for the caller to judge."""
    dirs = [p for p in Path(path).glob(f"{RANK_PREFIX}*") if rank_number(p) is not None]
    dirs.sort(key=rank_number)
    return dirs


def job_of_rank(path) -> Path | None:
    """The job directory whose rank pool ``path`` is, or None when it is not one."""
    p = Path(path)
    return p.parent if p.name.startswith(RANK_PREFIX) and is_job(p.parent) else None
