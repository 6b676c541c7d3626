"""checkpointing: batch-aware undo logging, dense snapshots, recovery.

See :mod:`checkpointing.base` for the call order, :mod:`checkpointing.undo` for the design and
its relaxation window, :mod:`checkpointing.store` for the on-media formats and
:mod:`checkpointing.recovery` for recovery of one pool, :mod:`checkpointing.job` for a job of
several ranks (and :func:`recover_path`, which recovers whatever a path holds) and
:mod:`checkpointing.crash` for every crash-injection point.
"""

from .base import Checkpointer, CheckpointStats, Step
from .crash import PHASES, RECOVERY_PHASES, CrashPlan, parse_crash_at
from .digest import state_digest
from .job import JobRecoveryReport, recover_job, recover_path
from .recovery import RecoveryReport, checkpoint_status, committed_state, recover
from .nocheckpoint import NoCheckpointer
from .undo import UndoLogCheckpointer

__all__ = ["Checkpointer", "CheckpointStats", "Step", "UndoLogCheckpointer", "NoCheckpointer", "CrashPlan",
           "PHASES", "RECOVERY_PHASES", "parse_crash_at", "recover", "recover_path", "recover_job", "RecoveryReport",
           "JobRecoveryReport", "checkpoint_status", "state_digest", "committed_state"]
