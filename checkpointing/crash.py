"""Crash injection: the trainer kills itself with SIGKILL at a named moment of a step.

SIGKILL runs no Python cleanup, no atexit, no buffered-file flush: exactly what a machine
failure looks like to the process. On the ``power-sim`` tier the kill also loses every store
that was not persisted (the private mapping dies with the process).
"""

from __future__ import annotations

import os
import random
import signal
import threading
from dataclasses import dataclass

__all__ = ["PHASES", "CrashPlan", "parse_crash_at", "die"]

PHASES = ("before-log", "mid-log", "after-log", "mid-update", "after-update",
          "before-commit", "after-commit", "mid-dense", "random")
# Phases of `dlrm-cxl recover`, for testing that recovery itself is crash-safe.
RECOVERY_PHASES = ("mid-rollback", "before-invalidate")


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
    """Where to crash. ``hit(step, phase)`` kills the process when both match."""

    step: int
    phase: str
    seed: int = 0
    expected_step_seconds: float = 0.05

    def hit(self, step: int, phase: str) -> None:
        if step == self.step and phase == self.phase:
            die(f"step {step} {phase}")

    def arm_random(self, step: int) -> None:
        """For ``random``: a seeded watchdog that kills at a random moment of this step."""
        if step != self.step or self.phase != "random":
            return
        delay = random.Random(self.seed * 1_000_003 + step).uniform(0.0, self.expected_step_seconds)
        t = threading.Timer(delay, die, args=(f"step {step} random (+{delay * 1e3:.1f} ms)",))
        t.daemon = True
        t.start()
