"""Every error dlrm-cxl raises, in one place: one hierarchy, one exit code per class.

Every class derives from :class:`DlrmCxlError` and carries ``hint`` (one sentence saying what to
do; ``str(err)`` includes it) and ``exit_code`` (what ``dlrm-cxl`` exits with; ``dlrm_cxl.cli.main``
returns it). The bad-argument errors are also ``ValueError`` (``TableNotFoundError``: ``KeyError``).
Errors of the pool layer are defined in :mod:`memory_pool.errors` (``memory_pool`` and
``checkpointing`` raise them and never import ``dlrm_cxl``) and re-exported here; the errors of
data, configuration and training are defined here. Import them all from this module.

========================  ====  ==============================================================
class                     exit  default hint
========================  ====  ==============================================================
DlrmCxlError              1     (the base class; raised only through a subclass)
PoolFormatError           3     check --pool; create a pool with `dlrm-cxl train --pool DIR`
PoolCorruptError          4     the pool is damaged; restore it from a copy (nothing was changed)
PoolVersionError          3     open it with the dlrm-cxl version that wrote it, or export and
                                re-import
PoolLockedError           5     stop the other writer, or open read-only (inspect/eval do)
PoolFullError             6     pool full: raise --capacity or free disk space
PoolIOError               9     the device failed a write; nothing committed is lost: check the
                                disk (dmesg), then `dlrm-cxl recover --pool DIR`
CompactionError           10    the pool's background compaction failed; every committed step is
                                still in the journal: fix the cause named above, then reopen the
                                pool (`dlrm-cxl recover --pool DIR`)
PoolReadOnlyError         2     open the pool without read_only=True to change it
PoolVolatileError         3     dram pools do not survive their process; use --tier shm, pmem or
                                power-sim
PoolExistsError           2     open the existing pool, choose another --pool, or pass --fresh to
                                start over
TableExistsError          2     pick another name, or open the existing table with
                                pool.table(name)
TableNotFoundError        2     list the pool's tables with `dlrm-cxl inspect --pool DIR`
InvalidIdsError           2     ids must be int64 in [0, num_embeddings); check the hashing of
                                the input
InvalidValuesError        2     values must be a [len(ids), embedding_dim] tensor of the table's
                                dtype
InvalidConfigError        2     check the arguments against the documentation of the call (or
                                --help)
CacheTooSmallError        2     raise --dram-cache (or lower --batch-size)
RecoveryError             4     the undo log or a snapshot is damaged; restore the pool from a
                                copy (nothing was changed)
NeedsRecoveryError        2     run `dlrm-cxl recover --pool DIR` first (or `dlrm-cxl train`,
                                which recovers)
DataFormatError           7     fix the input, or pass --skip-bad-lines to skip and count such
                                lines
ConfigMismatchError       2     drop the flag to continue the pool as created, or pass --fresh to
                                start over
TrainingDivergedError     8     lower the learning rate; the pool is still at the last committed
                                step
PoolNotWritableError      2     train, recover, destroy and import write to the pool's directory:
                                make it writable (remount it read-write, `chattr -i`, or fix its
                                permissions) or copy the pool somewhere writable; inspect, eval
                                and export read it as it is
ReplayMismatchError       11    replay with the settings the steps were trained with
                                (--threads, --kernel, --device, the same torch/fbgemm); or
                                `dlrm-cxl recover --no-replay` to drop the recorded steps and
                                continue from the pool's step
ReplaySourceError         12    put the data file back as it was and run `dlrm-cxl recover`
                                again, or `dlrm-cxl recover --no-replay` to drop the recorded
                                steps and continue from the pool's step
NoMetricsError            2     train the pool (`dlrm-cxl train --pool DIR --steps N`): every
                                step it trains is recorded in DIR/metrics.jsonl
========================  ====  ==============================================================

Outside the hierarchy, ``dlrm-cxl`` also exits 2 for any other ``ValueError`` (a bad option),
6 for a full disk (``OSError`` ENOSPC/EDQUOT), 2 for a path it cannot read or write (a pool
directory that a command which changes the pool cannot write: ``PoolNotWritableError``), 0 when
the reader of its output went away (``dlrm-cxl inspect | head``: a closed pipe ends the command
quietly), 130 when interrupted and 1 for anything unexpected.
"""

from __future__ import annotations

from memory_pool.errors import (
    CacheTooSmallError,
    CompactionError,
    DlrmCxlError,
    InvalidConfigError,
    InvalidIdsError,
    InvalidValuesError,
    NeedsRecoveryError,
    PoolCorruptError,
    PoolExistsError,
    PoolFormatError,
    PoolFullError,
    PoolIOError,
    PoolLockedError,
    PoolReadOnlyError,
    PoolVersionError,
    PoolVolatileError,
    RecoveryError,
    TableExistsError,
    TableNotFoundError,
)

__all__ = [
    "DlrmCxlError",
    # the pool (memory_pool.errors)
    "PoolFormatError",
    "PoolCorruptError",
    "PoolVersionError",
    "PoolLockedError",
    "PoolFullError",
    "PoolIOError",
    "CompactionError",
    "PoolReadOnlyError",
    "PoolVolatileError",
    "PoolExistsError",
    "TableExistsError",
    "TableNotFoundError",
    "InvalidIdsError",
    "InvalidValuesError",
    "InvalidConfigError",
    "CacheTooSmallError",
    "RecoveryError",
    "NeedsRecoveryError",
    # data, configuration, training (this module)
    "DataFormatError",
    "ConfigMismatchError",
    "TrainingDivergedError",
    "PoolNotWritableError",
    "ReplayMismatchError",
    "ReplaySourceError",
    "NoMetricsError",
]


class DataFormatError(DlrmCxlError, ValueError):
    """A malformed input line or file; the message names file and line."""

    exit_code = 7
    default_hint = "fix the input, or pass --skip-bad-lines to skip and count such lines"


class ConfigMismatchError(DlrmCxlError, ValueError):
    """Flags that change the model or data disagree with what the pool was created with."""

    exit_code = 2
    default_hint = "drop the flag to continue the pool as created, or pass --fresh to start over"


class TrainingDivergedError(DlrmCxlError):
    """The loss became NaN/inf; the step was not applied."""

    exit_code = 8
    default_hint = "lower the learning rate; the pool is still at the last committed step"


class PoolNotWritableError(DlrmCxlError):
    """A command that changes the pool (train, recover, destroy, import) cannot write to its
    directory: a read-only file system (EROFS), an immutable directory (``chattr +i``: EPERM) or
    missing permissions (EACCES). Nothing was changed."""

    exit_code = 2
    default_hint = ("train, recover, destroy and import write to the pool's directory: make it writable "
                    "(remount it read-write, `chattr -i`, or fix its permissions) or copy the pool somewhere "
                    "writable; inspect, eval and export read it as it is")


class ReplayMismatchError(DlrmCxlError):
    """A replayed step (recovery windows: checkpointing.policy) did not reproduce its commit
    record: its loss's bits or its batch's data position differ. Training was not deterministic
    (another --threads, kernel, device or library version than the run that recorded it). The
    pool stays at the last step that agreed."""

    exit_code = 11
    default_hint = ("replay with the settings the steps were trained with (--threads, --kernel, --device, the same "
                    "torch/fbgemm); or `dlrm-cxl recover --no-replay` to drop the recorded steps and continue from "
                    "the pool's step")


class ReplaySourceError(DlrmCxlError):
    """The data a replay needs is gone or changed since the steps to replay read it: recovery
    stops at the recovery window's start rather than replay different data."""

    exit_code = 12
    default_hint = ("put the data file back as it was and run `dlrm-cxl recover` again, or `dlrm-cxl recover "
                    "--no-replay` to drop the recorded steps and continue from the pool's step")


class NoMetricsError(DlrmCxlError, ValueError):
    """``dlrm-cxl plot`` of a pool that holds no training metrics (no ``metrics.jsonl``, or no
    step in it: a pool trained before metrics were recorded, made by ``import``, or never
    trained)."""

    exit_code = 2
    default_hint = ("train the pool (`dlrm-cxl train --pool DIR --steps N`): every step it trains is recorded "
                    "in DIR/metrics.jsonl")
