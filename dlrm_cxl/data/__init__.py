"""Training data for dlrm-cxl: Criteo TSV, preprocessed zarr, and synthetic Zipf data.

Every source yields ``(Batch, position)`` pairs from ``iter_batches(position=None)``; ``position``
is a small JSON-serializable dict describing where the stream stands AFTER that batch, so a trainer
that stores it with its checkpoint and later calls ``iter_batches(saved)`` gets exactly the batch
that would have come next. All streams are cyclic: at the end of the data they continue from the
start (next epoch), and a batch may span the epoch boundary.

Batch layout
------------
``Batch.dense``  float32 ``[B, num_dense]``; ``Batch.labels`` float32 ``[B]`` (0.0 or 1.0);
``Batch.sparse`` a TorchRec ``KeyedJaggedTensor`` with ``keys == spec.feature_names``, exactly one
id per sample per feature (``lengths`` all 1, int32), values int64 laid out key-major (all of
feature 0's ids for the batch, then feature 1's, ...), already hashed into ``[0, num_embeddings[f])``.

Preprocessing of Criteo rows (the TSV reader and the zarr converter apply the same rules)
-----------------------------------------------------------------------------------------
A line is ``label \\t I1 .. I<num_dense> \\t C1 .. C<num_sparse>`` (1 + num_dense + num_sparse
tab-separated fields; Criteo: 1 + 13 + 26 = 40). Line endings ``\\n`` and ``\\r\\n`` are accepted;
the last line may lack its newline. An empty field means "missing".

* label: must be exactly ``0`` or ``1``; becomes float32 0.0 / 1.0.
* integer feature: missing -> 0; must match ``-?[0-9]+`` and fit in int64; negative -> 0; then
  ``log1p(x)`` computed in float64 and rounded to float32.
* categorical feature ``f``: missing -> 0; else must match ``[0-9a-fA-F]+`` and the value is
  ``int(hex, 16)``; the table row is ``value % num_embeddings[f]`` (int64).

A line breaking any rule raises :class:`DataFormatError` naming ``file:line`` (1-based) and the
problem, unless ``skip_bad_lines=True``, which skips the line and counts it in ``reader.skipped``.
A file with no valid line at all raises :class:`DataFormatError` (it never loops forever).

Positions
---------
* :class:`CriteoTSVReader`: ``{"epoch": e, "offset": byte offset of the next line, "line": number
  of lines of the file already consumed in this epoch}``.
* :class:`ZarrReader`: ``{"epoch": e, "row": index of the next row}``.
* :class:`SyntheticData`: ``{"batch": k}`` (index of the next batch; batch k is a pure function of
  ``(seed, k)``).

A position whose offset/row is at the very end of the data is valid: the next batch starts the next
epoch.

Modules
-------
:mod:`.batch` (Batch, DataSpec, make_batch, Criteo constants), :mod:`.criteo` (the TSV reader),
:mod:`.zarr_store` (the converter and the zarr reader), :mod:`.synthetic` (synthetic data),
:mod:`.prefetch` (the Prefetcher); :func:`make_data_source` is defined here.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import DataFormatError

from .batch import (
    CRITEO_NUM_DENSE,
    CRITEO_NUM_SPARSE,
    Batch,
    DataSpec,
    criteo_feature_names,
    make_batch,
    validate_spec,
)
from .criteo import CriteoTSVReader
from .prefetch import Prefetcher
from .synthetic import SyntheticData
from .zarr_store import ZARR_FORMAT, ZARR_FORMAT_VERSION, ZarrReader, convert_tsv_to_zarr

__all__ = [
    "CRITEO_NUM_DENSE",
    "CRITEO_NUM_SPARSE",
    "Batch",
    "DataSpec",
    "CriteoTSVReader",
    "ZarrReader",
    "SyntheticData",
    "Prefetcher",
    "convert_tsv_to_zarr",
    "criteo_feature_names",
    "make_batch",
    "make_data_source",
    "validate_spec",
]


def make_data_source(data: str | os.PathLike, spec: DataSpec, seed: int = 0,
                     skip_bad_lines: bool = False, alpha: float = 1.05):
    """``"synthetic"`` -> :class:`SyntheticData`; an existing directory or ``*.zarr`` ->
    :class:`ZarrReader`; an existing regular file (e.g. ``*.tsv``) -> :class:`CriteoTSVReader`."""
    if str(data) == "synthetic":
        return SyntheticData(spec, seed=seed, alpha=alpha)
    p = Path(data)
    if p.is_dir() or (p.suffix == ".zarr" and p.exists()):
        return ZarrReader(p, spec)
    if p.is_file():
        return CriteoTSVReader(p, spec, skip_bad_lines=skip_bad_lines)
    what = "does not exist" if not p.exists() else "is neither a regular file nor a directory"
    raise DataFormatError(
        f"data source {str(data)!r} {what}",
        hint="pass --data synthetic, a Criteo .tsv file, or a .zarr directory made by convert",
    )
