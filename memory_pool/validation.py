"""Input validation of the pool's public API, in one place: each check raises a typed error
(a ``ValueError`` too) naming the offending value, and runs before anything is changed."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import torch

from .errors import InvalidConfigError, InvalidIdsError, InvalidValuesError
from .tiers import torch_dtype

__all__ = ["is_int", "validate_table_config", "validate_ids", "validate_values", "validate_offsets",
           "validate_init", "json_copy", "all_finite", "env_mib", "validate_journal_env", "JOURNAL_ENV", "NAME_RE"]

# The journal's size knobs (MiB): segment size (memory_pool.pool), compaction threshold and
# write-back pass size (checkpointing.undo).
JOURNAL_ENV = ("DLRM_CXL_SEGMENT_MB", "DLRM_CXL_COMPACT_MB", "DLRM_CXL_APPLY_MB", "DLRM_CXL_RUNS_MB")
ZERO_OK_ENV = ("DLRM_CXL_RUNS_MB",)   # 0 means "off" for these

NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def env_mib(name: str) -> int | None:
    """The size in bytes that environment variable ``name`` gives in MiB (a number > 0, e.g.
    ``0.25``; also 0 for the knobs of ``ZERO_OK_ENV``), or None when it is not set. The knobs of
    the journal's sizes (tests, torture)."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        mib = float(raw)
    except ValueError:
        mib = float("nan")
    zero_ok = name in ZERO_OK_ENV
    if not ((mib > 0 or zero_ok and mib == 0) and math.isfinite(mib)):
        raise InvalidConfigError(f"{name} must be a number of MiB > {'= ' if zero_ok else ''}0, got {raw!r}",
                                 hint=f"unset {name} for the default, or give e.g. {name}=0.25")
    return 0 if mib == 0 else max(1, int(mib * (1 << 20)))


def env_int(name: str, *, lo: int, hi: int | None = None, hint: str) -> int | None:
    """The whole number that environment variable ``name`` gives (``lo`` to ``hi``), or None
    when it is unset or empty; anything else is an InvalidConfigError carrying ``hint``."""
    raw = os.environ.get(name)
    if not raw:
        return None
    ok = raw.strip().isdigit() and int(raw) >= lo and (hi is None or int(raw) <= hi)
    if not ok:
        what = f">= {lo}" if hi is None else f"from {lo} to {hi}"
        raise InvalidConfigError(f"{name} must be a whole number {what}, got {raw!r}", hint=hint)
    return int(raw)


def validate_journal_env() -> None:
    """Every journal size knob that is set is valid (InvalidConfigError otherwise): checked before
    a pool is created or trained, so that a bad value costs nothing."""
    for name in JOURNAL_ENV:
        env_mib(name)


def is_int(x, *, numpy: bool = False) -> bool:
    """An int, not a bool (the one integer check of the project); ``numpy``: a numpy integer
    too (values read from arrays)."""
    return (isinstance(x, int) and not isinstance(x, bool)) or (numpy and isinstance(x, np.integer))


def validate_table_config(cfg) -> None:
    if not isinstance(cfg.name, str) or not NAME_RE.match(cfg.name):
        raise InvalidConfigError(
            f"table name {cfg.name!r} must match {NAME_RE.pattern}",
            hint="use letters, digits, '_', '.' and '-' (1-128 characters, not starting with '.' or '-')")
    if not is_int(cfg.num_embeddings) or cfg.num_embeddings < 1:
        raise InvalidConfigError(f"num_embeddings must be a positive int, got {cfg.num_embeddings!r}")
    if not is_int(cfg.embedding_dim) or cfg.embedding_dim < 1:
        raise InvalidConfigError(f"embedding_dim must be a positive int, got {cfg.embedding_dim!r}")
    try:
        torch_dtype(cfg.dtype)
    except (KeyError, TypeError):
        raise InvalidConfigError(f"dtype must be one of float32, float16, bfloat16; got {cfg.dtype!r}") from None


def validate_ids(ids, cfg) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidIdsError(f"table {cfg.name!r}: ids are not a tensor: {exc}") from None
        if ids.numel() == 0:
            ids = ids.to(torch.int64)  # [] becomes a float tensor; an empty list is fine
    if ids.dtype not in (torch.int64, torch.int32):
        raise InvalidIdsError(f"table {cfg.name!r}: ids must be int64 or int32, got {ids.dtype}")
    if ids.dim() != 1:
        raise InvalidIdsError(f"table {cfg.name!r}: ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.numel():
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo < 0:
            raise InvalidIdsError(f"table {cfg.name!r}: negative id {lo}")
        if hi >= cfg.num_embeddings:
            raise InvalidIdsError(f"table {cfg.name!r}: id {hi} out of range [0, {cfg.num_embeddings})")
    return ids.to(torch.int64)


def all_finite(values: torch.Tensor) -> bool:
    # One pass with no temporary (8x faster than isfinite().all()); aminmax propagates NaN.
    lo, hi = torch.aminmax(values)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def validate_values(values, n: int, cfg) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        raise InvalidValuesError(f"table {cfg.name!r}: values must be a torch.Tensor, got {type(values).__name__}")
    want = torch_dtype(cfg.dtype)
    if values.dtype != want:
        raise InvalidValuesError(f"table {cfg.name!r}: values dtype {values.dtype}, table dtype {want}")
    if tuple(values.shape) != (n, cfg.embedding_dim):
        raise InvalidValuesError(
            f"table {cfg.name!r}: values shape {tuple(values.shape)}, expected ({n}, {cfg.embedding_dim})")
    if n and not all_finite(values):
        raise InvalidValuesError(f"table {cfg.name!r}: values contain NaN or inf")
    return values


def validate_offsets(offsets, n: int, cfg) -> torch.Tensor:
    """Bag starts for ``n`` ids: 1-D ints, first 0, non-decreasing, none past ``n``."""
    try:
        offsets = torch.as_tensor(offsets)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidIdsError(f"table {cfg.name!r}: offsets are not a tensor: {exc}") from None
    if offsets.dtype not in (torch.int64, torch.int32) or offsets.dim() != 1:
        raise InvalidIdsError(
            f"table {cfg.name!r}: offsets must be a 1-D int tensor, got {offsets.dtype} of shape {tuple(offsets.shape)}",
            hint="offsets[b] is the index in ids where bag b starts: 1-D, int64, starting at 0")
    if offsets.numel():
        o = offsets.to(torch.int64)
        if int(o[0]) != 0 or int(o[-1]) > n or bool((o[1:] < o[:-1]).any()):
            raise InvalidIdsError(
                f"table {cfg.name!r}: offsets must start at 0, never decrease and not exceed len(ids)={n}",
                hint="offsets[b] is the index in ids where bag b starts: 1-D, int64, starting at 0")
    return offsets.to(torch.int64)


def validate_init(init) -> None:
    if init not in ("zeros", "uniform"):
        raise InvalidConfigError(f"init must be 'zeros' or 'uniform', got {init!r}")




def json_copy(obj, what: str):
    try:
        return json.loads(json.dumps(obj, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidConfigError(f"{what}: not JSON-serialisable ({exc})",
                                 hint="meta values must be str, int, finite float, bool, None, lists or dicts") from None
