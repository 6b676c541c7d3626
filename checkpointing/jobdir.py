"""What makes a directory a job of several ranks, by its names alone: ``DIR/job.json`` and one
pool per rank, ``DIR/rank-R``.

It imports nothing of ``checkpointing``, so that :mod:`checkpointing.recovery` (one pool: it
refuses one rank of a job alone) and :mod:`checkpointing.job` (several ranks, which imports
recovery) both use it without importing each other.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["JOB_FILE", "RANK_PREFIX", "is_job", "job_of_rank"]

JOB_FILE = "job.json"
RANK_PREFIX = "rank-"


def is_job(path) -> bool:
    """Whether ``path`` is the directory of a job of several ranks."""
    return (Path(path) / JOB_FILE).exists()


def job_of_rank(path) -> Path | None:
    """The job directory whose rank pool ``path`` is, or None when it is not one."""
    p = Path(path)
    return p.parent if p.name.startswith(RANK_PREFIX) and is_job(p.parent) else None
