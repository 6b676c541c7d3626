"""Batch layout and data spec: :class:`Batch`, :class:`DataSpec` and its validation,
:func:`make_batch`, the Criteo constants and feature names, and the small helpers every data source
shares (int checks, position validation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from memory_pool.validation import is_int

from ..errors import DataFormatError

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26


def criteo_feature_names() -> tuple[str, ...]:
    """The 26 Criteo categorical feature names: ``("cat_0", ..., "cat_25")``."""
    return tuple(f"cat_{i}" for i in range(CRITEO_NUM_SPARSE))


@dataclass(frozen=True)
class Batch:
    """One training batch; see the :mod:`dlrm_cxl.data` docstring for the layout."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class DataSpec:
    """Shape of the data: dense width, sparse feature names, each feature's table rows, batch size."""

    num_dense: int
    feature_names: tuple[str, ...]
    num_embeddings: tuple[int, ...]
    batch_size: int

    def __post_init__(self) -> None:
        # accept lists from callers/JSON; store tuples so the spec stays hashable and immutable
        object.__setattr__(self, "feature_names", tuple(self.feature_names))
        object.__setattr__(self, "num_embeddings", tuple(self.num_embeddings))
        validate_spec(self)

    @property
    def num_sparse(self) -> int:
        return len(self.feature_names)


def validate_spec(spec: DataSpec) -> None:
    """Raise ValueError naming the offending value if ``spec`` is unusable."""
    if not is_int(spec.num_dense, numpy=True) or spec.num_dense < 0:
        raise ValueError(f"DataSpec.num_dense must be an int >= 0, got {spec.num_dense!r}")
    if not is_int(spec.batch_size, numpy=True) or spec.batch_size < 1:
        raise ValueError(f"DataSpec.batch_size must be an int >= 1, got {spec.batch_size!r}")
    if len(spec.feature_names) == 0:
        raise ValueError("DataSpec.feature_names must name at least one sparse feature, got ()")
    for name in spec.feature_names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"DataSpec.feature_names entries must be non-empty str, got {name!r}")
    if len(set(spec.feature_names)) != len(spec.feature_names):
        dup = sorted({n for n in spec.feature_names if spec.feature_names.count(n) > 1})
        raise ValueError(f"DataSpec.feature_names must be unique, duplicated: {dup}")
    if len(spec.num_embeddings) != len(spec.feature_names):
        raise ValueError(
            f"DataSpec.num_embeddings has {len(spec.num_embeddings)} entries but feature_names has "
            f"{len(spec.feature_names)}; give one table size per feature"
        )
    for name, n in zip(spec.feature_names, spec.num_embeddings):
        if not is_int(n, numpy=True) or n < 1:
            raise ValueError(f"DataSpec.num_embeddings[{name!r}] must be an int >= 1, got {n!r}")


def make_batch(dense: np.ndarray, ids: np.ndarray, labels: np.ndarray, feature_names) -> Batch:
    """Build a :class:`Batch` from numpy arrays: dense [B, D] float32, ids [B, F] int64 (already
    hashed), labels [B] float32. The KJT values are laid out key-major."""
    b, f = ids.shape
    values = torch.from_numpy(np.ascontiguousarray(ids.T, dtype=np.int64).reshape(-1))
    lengths = torch.ones(b * f, dtype=torch.int32)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(feature_names), values=values, lengths=lengths)
    return Batch(
        dense=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        sparse=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32)),
    )


def bad_position(source: str, position: Any, expected: str) -> DataFormatError:
    """The error a data source raises for a resume position it did not yield."""
    return DataFormatError(
        f"{source}: invalid position {position!r}; expected {expected}",
        hint="pass a position yielded by this data source's iter_batches (or None to start)",
    )


def nonneg_int(d: dict, key: str) -> bool:
    """``d[key]`` exists and is an integer >= 0 (a field of a resume position)."""
    return key in d and is_int(d[key], numpy=True) and d[key] >= 0
