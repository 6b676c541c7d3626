"""The checkpointer interface the trainer drives, and what every implementation reports.

Call order for step ``k`` (each once, in this order — after torch.distributed.checkpoint's
``StorageWriter`` style of stating the protocol where it is declared)::

    begin_step(k)                   # a new step; arms crash injection
    log_before_image(touched)       # old values of exactly the rows step k will change
                                    #   (may return before they are durable)
    ... forward / backward ...      # compute overlaps the log write
    persist()                       # barrier: the before-images of step k are durable
    update(fn)                      # fn() changes the rows in place
    commit(k)                       # step k is done; may snapshot dense state (async)

or, py-lmdb style, ``with ckpt.step(k) as s:`` — ``s`` is the :class:`Step` (what step ``k``
touches, its before-images, whether it updated; the same object as ``ckpt.current``), and the
calls above are still made on the checkpointer. Leaving the block commits; an exception puts the
step's rows back to their before-images where it has them (direct tiers) and re-raises. On a
journaled tier the changed rows live only in the process's volatile working copy: the pool on
media is still at the last commit, and the checkpointer refuses further steps (reopen the pool).
"""

from __future__ import annotations

import abc
import contextlib
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence

import torch

__all__ = ["Checkpointer", "CheckpointStats", "Step", "Touched"]

Touched = Sequence[tuple["object", torch.Tensor]]  # (memory_pool.Table, rows)


@dataclass
class Step:
    """One step's transaction: what it touches, its before-images, whether it updated."""

    k: int
    touched: list = field(default_factory=list)     # [(Table, rows)]
    before: list | None = None                      # before-images, in touched order
    gathered: Future | None = None                  # -> ``before``, once they are copied
    undo: Future | None = None                      # the UNDO records' durability
    updated: bool = False
    txn: object = None                              # its memory_pool.Transaction (undo log)
    complete: bool = True                           # every touched row is logged (abort can undo it)
    logged: list | None = None                      # the rows logged: [(Table, ids)]
    witness: dict | None = None                     # what a replay checks (loss bits, data position)


@dataclass
class CheckpointStats:
    steps: int = 0
    critical_seconds: float = 0.0      # main-thread time spent on checkpointing
    log_wait_seconds: float = 0.0      # part of it: waiting for the undo log to be durable (inline: writing it)
    log_bytes: int = 0                 # undo-log payload made durable
    dense_bytes: int = 0               # dense snapshots made durable
    table_bytes_persisted: int = 0     # rows persisted at checkpoints
    checkpoints: int = 0               # durable commit records written
    last_commit_step: int = 0
    max_commit_lag: int = 0            # most steps between a step and a durable commit at or after it
    commit_wait_seconds: float = 0.0   # part of critical: waiting for the previous step to be durable
    commit_waits: int = 0              # of those waits, the ones on a job not finished yet (0 inline)
    writer_cpu_seconds: float = 0.0    # CPU of the journal writer's thread: off the critical path, but
    #                                    taken from the step's cores when none is spare

    def as_dict(self) -> dict:
        d = asdict(self)
        n = max(self.steps, 1)
        d["critical_ms_per_step"] = 1e3 * self.critical_seconds / n
        d["writer_cpu_ms_per_step"] = 1e3 * self.writer_cpu_seconds / n
        d["bytes_durable_per_step"] = (self.log_bytes + self.dense_bytes + self.table_bytes_persisted) / n
        return d


class Checkpointer(abc.ABC):
    """See the module docstring for the call order."""

    name = "abstract"
    stats: CheckpointStats
    _cur: Step | None = None  # the step between begin_step and commit/abort (implementations set it)

    @property
    def current(self) -> Step | None:
        """The step in progress (``begin_step`` made it; ``commit``/``abort`` end it), else None."""
        return self._cur

    @abc.abstractmethod
    def begin_step(self, step: int) -> None: ...

    @abc.abstractmethod
    def log_before_image(self, touched: Touched) -> None: ...

    @abc.abstractmethod
    def persist(self) -> None: ...

    @abc.abstractmethod
    def update(self, fn: Callable[[], None]) -> None: ...

    @abc.abstractmethod
    def commit(self, step: int, *, final: bool = False, witness: dict | None = None) -> None:
        """Step ``step`` is done. ``witness``: what a replay must reproduce (the loss's bits,
        the data position), kept with the step's commit record where the implementation has one."""

    @property
    def window(self) -> int:
        """Steps per recovery window (1: a recovery point every step)."""
        return 1

    def observe_step(self, seconds: float) -> None:
        """The trainer measured a step's time (a window chosen from a time budget follows it)."""

    @abc.abstractmethod
    def checkpoint_now(self, step: int) -> None:
        """Make the current state recovery point ``step`` now, outside the step protocol (no
        step in progress), and return once it is one: the trainer calls it for step 0 of a new
        pool (its initial state) before any ``begin_step``, ``dlrm-cxl import`` for the imported
        model. What a recovery point is (how durable) is the implementation's."""

    @property
    def needs_touched(self) -> bool:
        """Whether ``log_before_image`` needs the exact rows a step touches (else the trainer
        may pass empty row sets and skip finding them)."""
        return True

    def mark_updated(self) -> None:
        """The current step's rows changed in place outside ``update`` (a fused backward)."""

    def before_images(self) -> dict[str, torch.Tensor] | None:
        """The current step's logged rows by table name (in the order they were given), if this
        checkpointer keeps them: an optimizer can start from them instead of gathering again.
        (May wait until a background thread has copied them.)"""
        return None

    def abort(self) -> None:
        """The step failed before ``commit``: undo whatever ``update`` changed (in memory)."""

    def hit(self, phase: str) -> None:
        """Crash-injection point inside a step (no-op unless a crash is planned here); ``phase``
        is a name of :data:`checkpointing.crash.STEP_PHASES`."""

    def drain(self) -> None:
        """Wait for background work (benchmarks: so that it never spills into another window)."""

    def close(self) -> None:
        """Wait for background work; after this every committed step is durable."""

    @contextlib.contextmanager
    def step(self, k: int, *, final: bool = False) -> Iterator[Step]:
        """``begin_step(k)``; yields step k's :class:`Step`; ``commit(k)`` at the end of the block,
        ``abort()`` if it raises."""
        self.begin_step(k)
        try:
            yield self._cur
        except BaseException:
            self.abort()
            raise
        self.commit(k, final=final, witness=self._cur.witness if self._cur is not None else None)
