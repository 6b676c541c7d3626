"""The preprocessed zarr format: :func:`convert_tsv_to_zarr` (Criteo TSV -> zarr v3 group) and
:class:`ZarrReader`, which streams batches from such a group."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import DataFormatError

from .batch import Batch, DataSpec, _bad_position, _is_int, _nonneg_int, _validate_spec, make_batch
from .criteo import CriteoTSVReader

ZARR_FORMAT = "dlrm-cxl-criteo"
ZARR_FORMAT_VERSION = 1


def _blosc():
    import zarr

    return [zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")]


def convert_tsv_to_zarr(
    tsv_path: str | os.PathLike,
    zarr_path: str | os.PathLike,
    spec: DataSpec,
    chunk_rows: int = 65536,
    skip_bad_lines: bool = False,
) -> dict:
    """Preprocess a Criteo TSV into a zarr v3 group, streaming one chunk of rows at a time.

    Arrays: ``dense`` float32 [N, num_dense], ``sparse`` int64 [N, num_sparse] (rows already hashed
    into each table), ``labels`` float32 [N]; chunks of ``chunk_rows`` rows, Blosc zstd level 3 with
    byte shuffle. The spec (num_dense, feature_names, num_embeddings) is stored in the group attrs.
    The group is written to a temporary sibling and renamed into place when complete, so a failed
    conversion leaves nothing (and an existing ``zarr_path`` untouched).

    Returns stats: rows, skipped, chunks, bytes_in, seconds.
    """
    import zarr

    _validate_spec(spec)
    if not _is_int(chunk_rows) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    t0 = time.perf_counter()
    reader = CriteoTSVReader(tsv_path, spec, skip_bad_lines=skip_bad_lines)
    dest = Path(zarr_path)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    nd, ns = spec.num_dense, spec.num_sparse
    rows = chunks = 0
    try:
        g = zarr.open_group(str(tmp), mode="w")
        a_dense = g.create_array(
            "dense", shape=(0, nd), chunks=(chunk_rows, max(nd, 1)), dtype="float32",
            compressors=_blosc(),
        )
        a_sparse = g.create_array(
            "sparse", shape=(0, ns), chunks=(chunk_rows, ns), dtype="int64", compressors=_blosc()
        )
        a_labels = g.create_array(
            "labels", shape=(0,), chunks=(chunk_rows,), dtype="float32", compressors=_blosc()
        )
        # parse in small batches (big Python lists are slower), append whole chunks to zarr
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        n_pending = 0

        def flush(final: bool) -> None:
            nonlocal pending, n_pending, rows, chunks
            while pending and (n_pending >= chunk_rows or final):
                d, i, lab = (np.concatenate([p[j] for p in pending]) for j in range(3))
                k = min(chunk_rows, len(lab))
                a_dense.append(d[:k], axis=0)
                a_sparse.append(i[:k], axis=0)
                a_labels.append(lab[:k], axis=0)
                rows += k
                chunks += 1
                pending = [(d[k:], i[k:], lab[k:])] if k < len(lab) else []
                n_pending = len(lab) - k

        step = min(chunk_rows, 4096)
        for dense, ids, labels, _pos in reader.iter_arrays(step, None, cyclic=False):
            pending.append((dense, ids, labels))
            n_pending += len(labels)
            flush(final=False)
        flush(final=True)
        if rows == 0:
            raise reader.no_valid_line_error(reader.skipped)
        g.attrs.update(
            {
                "format": ZARR_FORMAT,
                "format_version": ZARR_FORMAT_VERSION,
                "num_dense": nd,
                "feature_names": list(spec.feature_names),
                "num_embeddings": [int(n) for n in spec.num_embeddings],
                "rows": rows,
                "skipped": reader.skipped,
                "source": str(tsv_path),
            }
        )
        if dest.exists():
            shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "rows": rows,
        "skipped": reader.skipped,
        "chunks": chunks,
        "bytes_in": reader.path.stat().st_size,
        "seconds": time.perf_counter() - t0,
    }


class ZarrReader:
    """Stream batches cyclically from a group written by :func:`convert_tsv_to_zarr`.

    Reads one zarr chunk of each array at a time and serves rows from that cache."""

    def __init__(self, path: str | os.PathLike, spec: DataSpec):
        import zarr

        _validate_spec(spec)
        self.path = Path(path)
        self.spec = spec
        reconvert = "re-convert the TSV with convert_tsv_to_zarr(tsv, zarr, spec) for this spec"
        try:
            g = zarr.open_group(str(self.path), mode="r")
            attrs = dict(g.attrs)
            self._dense, self._sparse, self._labels = g["dense"], g["sparse"], g["labels"]
        except Exception as e:  # missing/not a zarr group/missing arrays
            raise DataFormatError(
                f"{self.path}: not a dlrm-cxl zarr dataset ({type(e).__name__}: {e})",
                hint="create it with convert_tsv_to_zarr, or point --data at a .tsv file",
            ) from None
        if attrs.get("format") != ZARR_FORMAT:
            raise DataFormatError(f"{self.path}: not a dlrm-cxl zarr dataset (no format attr)",
                                  hint=reconvert)
        if attrs.get("format_version") != ZARR_FORMAT_VERSION:
            raise DataFormatError(
                f"{self.path}: zarr dataset format_version {attrs.get('format_version')!r}, "
                f"this reader reads {ZARR_FORMAT_VERSION}", hint=reconvert)
        want = {
            "num_dense": spec.num_dense,
            "feature_names": list(spec.feature_names),
            "num_embeddings": [int(n) for n in spec.num_embeddings],
        }
        for key, val in want.items():
            if attrs.get(key) != val:
                raise DataFormatError(
                    f"{self.path}: stored {key} {attrs.get(key)!r} does not match the requested "
                    f"spec's {val!r}", hint=reconvert)
        n = int(self._labels.shape[0])
        if (
            n == 0
            or tuple(self._dense.shape) != (n, spec.num_dense)
            or tuple(self._sparse.shape) != (n, spec.num_sparse)
        ):
            raise DataFormatError(
                f"{self.path}: arrays have inconsistent shapes dense={self._dense.shape} "
                f"sparse={self._sparse.shape} labels={self._labels.shape}", hint=reconvert)
        self.num_rows = n
        self.chunk_rows = int(self._labels.chunks[0])
        self._cache: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._mods = np.asarray(spec.num_embeddings, dtype=np.int64)

    def _chunk(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._cache is None or self._cache[0] != c:
            lo, hi = c * self.chunk_rows, min((c + 1) * self.chunk_rows, self.num_rows)
            dense = np.asarray(self._dense[lo:hi], dtype=np.float32)
            ids = np.asarray(self._sparse[lo:hi], dtype=np.int64)
            labels = np.asarray(self._labels[lo:hi], dtype=np.float32)
            if ids.size and ((ids < 0).any() or (ids >= self._mods).any()):
                raise DataFormatError(
                    f"{self.path}: rows {lo}..{hi - 1} hold ids outside their tables' ranges",
                    hint="the dataset is damaged or was written for other tables; re-convert it")
            self._cache = (c, dense, ids, labels)
        return self._cache[1:]

    def iter_batches(self, position: dict | None = None) -> Iterator[tuple[Batch, dict]]:
        """Yield ``(batch, position_after_batch)`` forever; position ``{"epoch", "row"}``."""
        if position is None:
            epoch, row = 0, 0
        else:
            if not (isinstance(position, dict) and _nonneg_int(position, "epoch")
                    and _nonneg_int(position, "row") and position["row"] <= self.num_rows):
                raise _bad_position(str(self.path), position,
                                    f'{{"epoch": int >= 0, "row": 0..{self.num_rows}}}')
            epoch, row = int(position["epoch"]), int(position["row"])
        bsz, n, cr = self.spec.batch_size, self.num_rows, self.chunk_rows
        while True:
            parts = []
            need = bsz
            while need:
                if row >= n:
                    epoch, row = epoch + 1, 0
                c = row // cr
                dense, ids, labels = self._chunk(c)
                start = row - c * cr
                take = min(need, len(labels) - start)
                parts.append((dense[start : start + take], ids[start : start + take],
                              labels[start : start + take]))
                row += take
                need -= take
            if len(parts) == 1:
                d, i, lab = parts[0]
            else:
                d, i, lab = (np.concatenate([p[j] for p in parts]) for j in range(3))
            yield make_batch(d, i, lab, self.spec.feature_names), {"epoch": epoch, "row": row}

    def __iter__(self) -> Iterator[tuple[Batch, dict]]:
        return self.iter_batches()
