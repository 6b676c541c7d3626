"""Crash injection: the trainer (or recovery) kills itself with SIGKILL at a named moment of a
step (or of recovery). Every such moment is named here, with where it fires.

SIGKILL runs no Python cleanup, no atexit, no buffered-file flush: exactly what a machine
failure looks like to the process. On the ``power-sim`` tier the kill also loses every store
that was not persisted (the private mapping dies with the process).
"""

from __future__ import annotations

import os
import random
import signal
import threading
from dataclasses import dataclass, field

__all__ = ["PHASES", "STEP_PHASES", "COMMIT_PHASES", "RANDOM", "RECOVERY_PHASES", "CrashPlan", "parse_crash_at",
           "die"]

# Every named moment at which crash injection can kill, and where in the protocol it fires. These
# tuples are the only list of the names: CrashPlan refuses any other.
#
# Moments of training step k (``dlrm-cxl train --crash-at k:PHASE``). The checkpointer fires them
# through ``Checkpointer.hit(phase)`` (NoCheckpointer fires the same names at the same points of
# its step, writing no log); ``mid-update`` is fired by the trainer.
STEP_PHASES = (
    "before-log",     # log_before_image(): nothing of step k gathered or written yet
    "mid-log",        # direct tiers: half of step k's UNDO records appended and flushed (writer
                      #   thread); journaled tiers (no UNDO): the rows are noted, nothing written
    "after-log",      # persist(): step k's before-images are durable, no row changed yet
    "mid-update",     # the trainer: rows of half the tables (fused: all rows) changed in place,
                      #   the dense optimizer step not yet taken
    "after-update",   # update(): every change of step k made in place, commit not started
    "before-commit",  # commit(): the transaction (ROWS, DENSE) flushed, its END record not written
    "after-commit",   # commit(): the END record durable: step k is a recovery point
    "mid-dense",      # commit(): the DENSE record appended, not yet flushed
)
# The phases inside commit(k), on the writer thread: a plan for one of them makes step k a recovery
# point and commit(k) wait for it, so the kill comes before commit(k) returns.
COMMIT_PHASES = ("before-commit", "after-commit", "mid-dense")
RANDOM = "random"  # a seeded watchdog kills at a random moment of step k (CrashPlan.arm_random)
PHASES = STEP_PHASES + (RANDOM,)  # what `train --crash-at STEP:PHASE` accepts

# Moments of `dlrm-cxl recover --crash-at PHASE` (checkpointing.recovery), for testing that
# recovery itself is crash-safe.
RECOVERY_PHASES = (
    "mid-rollback",       # the first UNDO record applied, the others not
    "before-invalidate",  # every row at the target (persisted), the unfinished journal tail not yet dropped
)


def die(reason: str = "") -> None:
    """SIGKILL this process now."""
    if reason:
        try:
            os.write(2, f"crash injection: SIGKILL at {reason}\n".encode())
        except OSError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def parse_crash_at(text: str, phases=PHASES) -> tuple[int, str]:
    """``"STEP:PHASE"`` -> (step, phase); ValueError naming the bad part."""
    step, sep, phase = text.partition(":")
    if not sep:
        raise ValueError(f"--crash-at must be STEP:PHASE, got {text!r}")
    try:
        k = int(step)
    except ValueError:
        raise ValueError(f"--crash-at step must be an integer, got {step!r}") from None
    if k < 1:
        raise ValueError(f"--crash-at step must be >= 1, got {k}")
    if phase not in phases:
        raise ValueError(f"--crash-at phase must be one of {', '.join(phases)}; got {phase!r}")
    return k, phase


@dataclass
class CrashPlan:
    """Where to crash: ``phase`` of training step ``step`` (a name of :data:`PHASES`), or, made
    by :meth:`recovery`, a moment of recovery (a name of :data:`RECOVERY_PHASES`).

    Callers ask the plan, never compare its fields: :meth:`at` (is this the moment?), :meth:`hit`
    (kill if it is), :meth:`hit_recovery`, :meth:`arm_random`, and at the end of a run
    :meth:`await_armed`."""

    step: int
    phase: str
    seed: int = 0
    expected_step_seconds: float = 0.05
    _timer: threading.Timer | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.phase not in PHASES + RECOVERY_PHASES:
            raise ValueError(f"unknown crash phase {self.phase!r}; expected one of "
                             f"{', '.join(PHASES + RECOVERY_PHASES)}")

    @classmethod
    def recovery(cls, phase: str) -> "CrashPlan":
        """A plan that kills recovery at ``phase`` (one of :data:`RECOVERY_PHASES`)."""
        if phase not in RECOVERY_PHASES:
            raise ValueError(f"recovery crash phase must be one of {', '.join(RECOVERY_PHASES)}; got {phase!r}")
        return cls(0, phase)

    def at(self, step: int, *phases: str) -> bool:
        """Whether this plan kills in step ``step`` at one of ``phases`` (names of PHASES)."""
        for p in phases:
            if p not in PHASES:
                raise ValueError(f"unknown crash phase {p!r}")
        return step == self.step and self.phase in phases

    def hit(self, step: int, phase: str) -> None:
        """A crash point of training: SIGKILL when the plan is step ``step``'s ``phase``."""
        if self.at(step, phase):
            die(f"step {step} {phase}")

    def hit_recovery(self, phase: str) -> None:
        """A crash point of recovery: SIGKILL when the plan is ``phase`` of RECOVERY_PHASES."""
        if phase not in RECOVERY_PHASES:
            raise ValueError(f"unknown recovery crash phase {phase!r}")
        if self.phase == phase:
            die(f"recovery {phase}")

    def arm_random(self, step: int) -> None:
        """For ``random``: a seeded watchdog that kills at a random moment of this step. Called
        as every step begins: a watchdog armed for an earlier step that has not fired yet (the
        delay drawn from the previous step's time outlasted a faster step, or its thread was
        starved on a busy machine) kills now, at that step's end, before anything of this one:
        the kill stays inside the step asked for."""
        if self._timer is not None and self._timer.is_alive():
            die(f"step {self.step} random (at its end: the moment drawn was past it)")
        if not self.at(step, RANDOM):
            return
        delay = random.Random(self.seed * 1_000_003 + step).uniform(0.0, self.expected_step_seconds)
        t = threading.Timer(delay, die, args=(f"step {step} random (+{delay * 1e3:.1f} ms)",))
        t.daemon = True
        t.start()
        self._timer = t

    def await_armed(self) -> None:
        """Called when a run has done all its steps: a ``random`` kill that is armed but has not
        fired yet is waited for, so that ``--crash-at K:random`` always kills. Without it, a run
        whose last steps are shorter than the delay drawn (or whose timer thread is starved on a
        busy machine) would end normally and the crash would silently not happen."""
        if self._timer is not None:
            self._timer.join()
