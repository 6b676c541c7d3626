"""checkpointing: batch-aware undo logging, dense snapshots, recovery.

See :mod:`checkpointing.base` for the call order, :mod:`checkpointing.undo` for the design and
its relaxation window, :mod:`checkpointing.store` for the on-media formats and
:mod:`checkpointing.recovery` for recovery.
"""

from .base import Checkpointer, CheckpointStats
from .crash import PHASES, CrashPlan, parse_crash_at
from .digest import state_digest
from .recovery import RecoveryReport, checkpoint_status, committed_state, recover
from .undo import NoCheckpointer, UndoLogCheckpointer

__all__ = ["Checkpointer", "CheckpointStats", "UndoLogCheckpointer", "NoCheckpointer", "CrashPlan",
           "PHASES", "parse_crash_at", "recover", "RecoveryReport", "checkpoint_status", "state_digest",
           "committed_state"]
