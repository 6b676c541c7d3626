"""When a pool needs recovery, one rule for every command and every tier.

``checkpointing.checkpoint_status`` reports what the journal holds. Whether the pool *needs
recovery* is decided here, once, from it: :func:`needs_recovery` is true when ``dlrm-cxl recover``
would change the pool -- a crashed step left records in the journal's unfinished tail (on a direct
tier, shm or real pmem, the step also changed rows in place; on a journaled tier, emulated pmem or
power-sim, its rows never reached durable media, but its records are there all the same), torn
bytes of an unfinished write, damage, or a ``--checkpoint none`` run that was interrupted.

``train`` recovers such a pool first; ``eval`` and ``export`` refuse it (``NeedsRecoveryError``,
exit 2) on every tier alike, and ``inspect`` says it. (Light: imports neither torch nor TorchRec,
so ``inspect`` stays fast.)
"""

from __future__ import annotations

__all__ = ["needs_recovery"]


def needs_recovery(status: dict) -> bool:
    """Whether ``dlrm-cxl recover`` would change the pool whose ``checkpoint_status`` is ``status``."""
    return bool(status["needs_recovery"] or status["steps_to_roll_back"] or status["torn_bytes"])
