"""The pool's errors, and the base of the project's one exception hierarchy.

This module holds the errors of the pool layer (``memory_pool`` and ``checkpointing`` raise them);
the errors of data, configuration and training subclass the same :class:`DlrmCxlError` in
:mod:`dlrm_cxl.errors`, which re-exports these too: that module lists every error and its exit
code. (This layer never imports ``dlrm_cxl``.)

Every error a user can cause derives from :class:`DlrmCxlError` and carries a ``hint``: one
sentence saying what to do about it. ``str(err)`` includes the hint, so a CLI can print it as is.
Errors that are also classic Python categories (bad arguments) additionally derive from the
builtin (``ValueError``), so ``except ValueError`` keeps working for callers that expect it.

Each class carries its CLI exit status as ``exit_code``; ``dlrm_cxl.cli.main`` returns it.
"""

from __future__ import annotations

__all__ = [
    "DlrmCxlError",
    "PoolFormatError",
    "PoolCorruptError",
    "PoolVersionError",
    "PoolLockedError",
    "PoolFullError",
    "PoolIOError",
    "CompactionError",
    "PoolReadOnlyError",
    "PoolVolatileError",
    "TableExistsError",
    "TableNotFoundError",
    "InvalidIdsError",
    "InvalidValuesError",
    "RecoveryError",
    "NeedsRecoveryError",
    "PoolExistsError",
    "InvalidConfigError",
    "CacheTooSmallError",
]


class DlrmCxlError(Exception):
    """Base class. ``hint`` tells the user what to do; ``exit_code`` is the CLI's status."""

    exit_code = 1
    default_hint = ""

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = self.default_hint if hint is None else hint
        super().__init__(f"{message} (hint: {self.hint})" if self.hint else message)


class PoolFormatError(DlrmCxlError):
    """The path is not a pool, or its header cannot be parsed."""

    exit_code = 3
    default_hint = "check --pool; create a pool with `dlrm-cxl train --pool DIR`"


class PoolCorruptError(PoolFormatError):
    """A header, table file, log record or snapshot fails its checksum or is truncated."""

    exit_code = 4
    default_hint = "the pool is damaged; restore it from a copy (nothing was changed)"


class PoolVersionError(PoolFormatError):
    """The pool was written by another on-disk format version."""

    exit_code = 3
    default_hint = "open it with the dlrm-cxl version that wrote it, or export and re-import"


class PoolLockedError(DlrmCxlError):
    """Another process holds the pool's writer lock."""

    exit_code = 5
    default_hint = "stop the other writer, or open read-only (inspect/eval do)"


class PoolFullError(DlrmCxlError):
    """The pool's capacity, or the disk under it, cannot hold what was asked for."""

    exit_code = 6
    default_hint = "pool full: raise --capacity or free disk space"


class PoolIOError(DlrmCxlError):
    """The device reported an I/O error (EIO) while the pool or its journal was being written."""

    exit_code = 9
    default_hint = ("the device failed a write; nothing committed is lost: check the disk (dmesg), then "
                    "`dlrm-cxl recover --pool DIR`")


class CompactionError(DlrmCxlError):
    """A background compaction (or write-back pass) failed with an error that is not one of the
    pool's typed errors (those are raised as they are: a full disk is :class:`PoolFullError`, a
    device error :class:`PoolIOError`). Its ``__cause__`` is the original error.

    Exit 10, a code of its own: not 9 (the device reported no I/O error; the cause is something
    else, e.g. a run directory that is a file, a permission, a read-only file system) and not 1
    (unexpected): like 6 and 9 it says that every committed step is still in the journal, and
    that the pool opens again once the cause named in the message is fixed."""

    exit_code = 10
    default_hint = ("the pool's background compaction failed; every committed step is still in the journal: fix "
                    "the cause named above, then reopen the pool (`dlrm-cxl recover --pool DIR`)")


class PoolReadOnlyError(DlrmCxlError):
    exit_code = 2
    default_hint = "open the pool without read_only=True to change it"


class PoolVolatileError(DlrmCxlError):
    """A ``dram`` pool's contents lived in its process and are gone."""

    exit_code = 3
    default_hint = "dram pools do not survive their process; use --tier shm, pmem or power-sim"


class TableExistsError(DlrmCxlError, ValueError):
    exit_code = 2
    default_hint = "pick another name, or open the existing table with pool.table(name)"


class TableNotFoundError(DlrmCxlError, KeyError):
    exit_code = 2
    default_hint = "list the pool's tables with `dlrm-cxl inspect --pool DIR`"

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


class InvalidIdsError(DlrmCxlError, ValueError):
    """Ids out of range, negative, or of a non-integer dtype."""

    exit_code = 2
    default_hint = "ids must be int64 in [0, num_embeddings); check the hashing of the input"


class InvalidValuesError(DlrmCxlError, ValueError):
    """Values of the wrong shape or dtype, or not finite."""

    exit_code = 2
    default_hint = "values must be a [len(ids), embedding_dim] tensor of the table's dtype"


class RecoveryError(PoolCorruptError):
    """Recovery found damage it cannot repair; it changed nothing."""

    exit_code = 4
    default_hint = "the undo log or a snapshot is damaged; restore the pool from a copy (nothing was changed)"


class NeedsRecoveryError(DlrmCxlError):
    """A crash left unfinished records or rows changed in place: reading or appending now would
    mix two states. Nothing was changed."""

    exit_code = 2
    default_hint = "run `dlrm-cxl recover --pool DIR` first (or `dlrm-cxl train`, which recovers)"


class PoolExistsError(DlrmCxlError):
    """``create`` was asked to make a pool where one (or other files) already exist."""

    exit_code = 2
    default_hint = "open the existing pool, choose another --pool, or pass --fresh to start over"


class InvalidConfigError(DlrmCxlError, ValueError):
    """A bad argument to the pool: tier, table name/shape/dtype, init, capacity, use_libpmem."""

    exit_code = 2
    default_hint = "check the arguments against the documentation of the call (or --help)"


class CacheTooSmallError(InvalidConfigError):
    """The DRAM cache (``--dram-cache``) cannot hold one batch's rows of a table
    (memory_pool/cache_arena.py)."""

    exit_code = 2
    default_hint = "raise --dram-cache (or lower --batch-size)"
