"""The preprocessed zarr format: :func:`convert_tsv_to_zarr` (Criteo TSV -> zarr v3 group) and
:class:`ZarrReader`, which streams batches from such a group."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from memory_pool.validation import is_int

from ..errors import DataFormatError, InvalidConfigError
from .batch import Batch, DataSpec, bad_position, make_batch, nonneg_int, validate_spec
from .criteo import CriteoTSVReader

ZARR_FORMAT = "dlrm-cxl-criteo"
ZARR_FORMAT_VERSION = 1
# Group attribute: every chunk of every array is in the store, none left out for holding only zeros
# (written since the reader checks that chunks exist; without it, a missing chunk may be one an
# older converter skipped, and the dataset must be converted again).
EVERY_CHUNK_STORED = "every_chunk_stored"


def _blosc():
    import zarr

    return [zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")]


# What `convert_tsv_to_zarr` writes, and nothing else: how an existing output is recognised as ours
# (see _not_ours).
_ARRAYS = ("dense", "sparse", "labels")


def _not_ours(path: Path) -> str | None:
    """Why the directory ``path`` is not a dataset :func:`convert_tsv_to_zarr` wrote; None if it is.

    "Ours" means both:
    - its root ``zarr.json`` is a zarr v3 group whose attributes carry ``format: "dlrm-cxl-criteo"``
      (ZARR_FORMAT). The converter writes that marker last, into its temporary directory, so only a
      completed conversion of this tool carries it; and
    - the tree holds nothing the converter does not write: ``zarr.json`` and the directories
      ``dense``, ``sparse`` and ``labels``, each holding ``zarr.json`` and ``c/``, under which every
      name is a chunk index (digits). No symbolic links, no other files. So a user's notes put
      into a converted dataset make it "not ours", and it is never deleted, not even with
      --overwrite.
    """
    try:
        with open(path / "zarr.json", "rb") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        return f"no readable zarr.json ({type(e).__name__})"
    if not isinstance(meta, dict) or meta.get("node_type") != "group":
        return "its zarr.json is not a zarr group's"
    attrs = meta.get("attributes")
    if not isinstance(attrs, dict) or attrs.get("format") != ZARR_FORMAT:
        return f"its zarr.json lacks the attribute format={ZARR_FORMAT!r} of `dlrm-cxl data convert`"

    def scan(d: Path, depth: int) -> str | None:
        try:
            entries = list(os.scandir(d))
        except OSError as e:
            return f"{d} cannot be listed ({e.strerror or e})"
        for e in entries:
            rel = os.path.relpath(e.path, path)
            if e.is_symlink():
                return f"it holds the symbolic link {rel}"
            if depth == 0:
                ok = (e.name == "zarr.json" and e.is_file()) or (e.name in _ARRAYS and e.is_dir())
            elif depth == 1:
                ok = (e.name == "zarr.json" and e.is_file()) or (e.name == "c" and e.is_dir())
            else:  # chunk keys: c/<row chunk>[/<column chunk>]
                ok = e.name.isdigit() and e.name.isascii() and (e.is_file() or e.is_dir())
            if not ok:
                return f"it holds {rel}, which `dlrm-cxl data convert` does not write"
            if e.is_dir():
                why = scan(Path(e.path), depth + 1)
                if why:
                    return why
        return None

    return scan(path, 0)


def _check_output(dest: Path, shown: str, overwrite: bool) -> bool:
    """Raise unless the conversion may be put at ``dest``; True if an existing dataset of ours is to be
    replaced (only with ``overwrite``). A missing path or an empty directory is fine: os.replace
    takes its place without deleting anything (and fails, deleting nothing, if it filled up since)."""
    keep = ("choose another output path, or move it away yourself (--overwrite replaces only a "
            "dataset written by `dlrm-cxl data convert`)")
    if not os.path.lexists(dest):
        return False
    if dest.is_symlink():
        raise InvalidConfigError(f"output {shown} is a symbolic link; not replacing it", hint=keep)
    if not dest.is_dir():
        raise InvalidConfigError(f"output {shown} exists and is a file, not a dlrm-cxl zarr dataset; "
                                 "not touching it", hint=keep)
    with os.scandir(dest) as it:
        if next(it, None) is None:
            return False
    why = _not_ours(dest)
    if why:
        raise InvalidConfigError(f"output {shown} is a non-empty directory that is not a dlrm-cxl zarr "
                                 f"dataset ({why}); not touching it", hint=keep)
    if not overwrite:
        raise InvalidConfigError(f"output {shown} already holds a dlrm-cxl zarr dataset",
                                 hint="pass --overwrite to replace it (overwrite=True from Python), or "
                                      "choose another output path")
    return True


def _new_sibling(dest: Path, what: str) -> Path:
    """A new, empty directory beside ``dest`` (created here, so nothing else's)."""
    while True:
        p = dest.with_name(f".{dest.name}.{what}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            p.mkdir()
            return p
        except FileExistsError:
            continue


def convert_tsv_to_zarr(
    tsv_path: str | os.PathLike,
    zarr_path: str | os.PathLike,
    spec: DataSpec,
    chunk_rows: int = 65536,
    skip_bad_lines: bool = False,
    overwrite: bool = False,
) -> dict:
    """Preprocess a Criteo TSV into a zarr v3 group, streaming one chunk of rows at a time.

    Arrays: ``dense`` float32 [N, num_dense], ``sparse`` int64 [N, num_sparse] (rows already hashed
    into each table), ``labels`` float32 [N]; chunks of ``chunk_rows`` rows, Blosc zstd level 3 with
    byte shuffle. The spec (num_dense, feature_names, num_embeddings) is stored in the group attrs.
    The group is written to a temporary sibling and renamed into place when complete, so a failed
    conversion leaves nothing (and an existing ``zarr_path`` untouched).

    ``zarr_path`` may be missing or an empty directory. A dataset this function wrote earlier is
    replaced only with ``overwrite=True``; anything else there (a file, a link, a directory with
    other content) is never touched, ``overwrite`` or not: :class:`InvalidConfigError`, checked
    before the conversion starts and again before the rename.

    Returns stats: rows, skipped, chunks, bytes_in, seconds.
    """
    import zarr

    validate_spec(spec)
    if not is_int(chunk_rows, numpy=True) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    t0 = time.perf_counter()
    reader = CriteoTSVReader(tsv_path, spec, skip_bad_lines=skip_bad_lines)
    shown = str(zarr_path)
    dest = Path(os.path.abspath(zarr_path))
    _check_output(dest, shown, overwrite)  # before hours of work, not only at the end
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_sibling(dest, "tmp")  # made here, so it is ours to remove
    nd, ns = spec.num_dense, spec.num_sparse
    rows = chunks = 0
    try:
        g = zarr.open_group(str(tmp), mode="w")
        # Store every chunk, also one that holds only the fill value (zarr 3 skips those by
        # default): the reader can then tell a deleted chunk, which zarr would read as zeros,
        # from a chunk of zeros (attribute EVERY_CHUNK_STORED).
        every = {"write_empty_chunks": True}
        a_dense = g.create_array(
            "dense", shape=(0, nd), chunks=(chunk_rows, max(nd, 1)), dtype="float32",
            compressors=_blosc(), config=every,
        )
        a_sparse = g.create_array(
            "sparse", shape=(0, ns), chunks=(chunk_rows, ns), dtype="int64", compressors=_blosc(),
            config=every,
        )
        a_labels = g.create_array(
            "labels", shape=(0,), chunks=(chunk_rows,), dtype="float32", compressors=_blosc(),
            config=every,
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
                EVERY_CHUNK_STORED: True,
            }
        )
        if _check_output(dest, shown, overwrite):  # again: it may have changed meanwhile
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.replace(dest, old)  # our earlier dataset, moved aside and deleted once replaced
            try:
                os.replace(tmp, dest)
            except BaseException:
                os.replace(old, dest)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)  # over nothing or an empty directory; never over content
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

        validate_spec(spec)
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
        self._damaged = ("the dataset is damaged; convert the TSV again with "
                         "`dlrm-cxl data convert --overwrite`")
        self._missing_hint = self._damaged if attrs.get(EVERY_CHUNK_STORED) is True else (
            "the dataset is damaged, or an older dlrm-cxl wrote it without its all-zero chunks; "
            "convert the TSV again with `dlrm-cxl data convert --overwrite`")

    def _read(self, name: str, arr, lo: int, hi: int, dtype) -> np.ndarray:
        """Rows lo..hi-1 of array ``name``, refusing a chunk that is missing or does not decode.

        zarr reads a chunk whose key is absent from the store as the fill value (zeros here), which
        would train on made-up rows: every chunk the rows touch must exist in the store (one
        ``exists`` per chunk, e.g. a stat on a local directory)."""
        from zarr.core.sync import sync  # zarr 3's bridge from its async store API

        r0, r1 = lo // arr.chunks[0], (hi - 1) // arr.chunks[0]
        ncol = [-(-n // c) for n, c in zip(arr.shape[1:], arr.chunks[1:])]  # column chunks per dim
        keys = [arr.metadata.encode_chunk_key((r, *cols))
                for r in range(r0, r1 + 1) for cols in np.ndindex(*ncol)]
        chunk = str(r0) if r0 == r1 else f"{r0}..{r1}"
        where = f"{self.path}: array {name!r} chunk {chunk} (rows {lo}..{hi - 1}"
        for key in keys:
            if not sync(arr.store.exists(f"{arr.path}/{key}")):
                fill = np.asarray(arr.fill_value).item()
                raise DataFormatError(f"{where}, file {arr.path}/{key}) is missing from the store "
                                      f"(deleted?); zarr would read its rows as {fill!r}",
                                      hint=self._missing_hint)
        try:
            return np.asarray(arr[lo:hi], dtype=dtype)
        except OSError:
            raise  # the disk, not the data: the CLI reports it as such
        except Exception as e:  # a garbled chunk: blosc/zstd fail (RuntimeError), or a wrong size
            files = ", ".join(f"{arr.path}/{k}" for k in keys)
            raise DataFormatError(f"{where}, file {files}) does not decode: {type(e).__name__}: {e}",
                                  hint=self._damaged) from e

    def _chunk(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._cache is None or self._cache[0] != c:
            lo, hi = c * self.chunk_rows, min((c + 1) * self.chunk_rows, self.num_rows)
            dense = self._read("dense", self._dense, lo, hi, np.float32)
            ids = self._read("sparse", self._sparse, lo, hi, np.int64)
            labels = self._read("labels", self._labels, lo, hi, np.float32)
            # Whole-chunk, vectorised checks of what the converter can write; the first bad value
            # is named (found only once something is bad).
            def where(name: str) -> str:
                return f"{self.path}: array {name!r} chunk {c} (rows {lo}..{hi - 1})"

            if ids.size and ((ids < 0).any() or (ids >= self._mods).any()):
                r, f = np.argwhere((ids < 0) | (ids >= self._mods))[0]
                raise DataFormatError(
                    where("sparse") + f": row {lo + r} holds id {ids[r, f]} for feature "
                    f"{self.spec.feature_names[f]!r}, outside its table's range 0..{self._mods[f] - 1}",
                    hint="the dataset is damaged or was written for other tables; re-convert it")
            bad = (labels != 0) & (labels != 1)
            if bad.any():
                r = int(np.argmax(bad))
                raise DataFormatError(where("labels") + f": row {lo + r} has label "
                                      f"{float(labels[r])!r}, not 0 or 1", hint=self._damaged)
            if not np.isfinite(dense).all():  # log1p of a count: never NaN or inf
                r, f = np.argwhere(~np.isfinite(dense))[0]
                raise DataFormatError(where("dense") + f": row {lo + r} column {f} holds "
                                      f"{float(dense[r, f])!r}", hint=self._damaged)
            self._cache = (c, dense, ids, labels)
        return self._cache[1:]

    def iter_batches(self, position: dict | None = None) -> Iterator[tuple[Batch, dict]]:
        """Yield ``(batch, position_after_batch)`` forever; position ``{"epoch", "row"}``."""
        if position is None:
            epoch, row = 0, 0
        else:
            if not (isinstance(position, dict) and nonneg_int(position, "epoch")
                    and nonneg_int(position, "row") and position["row"] <= self.num_rows):
                raise bad_position(str(self.path), position,
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

    def iter_pass(self) -> Iterator[tuple[Batch, dict]]:
        """One pass over the rows from the first (each sample once, the last batch short): what
        evaluation reads, where training cycles (:meth:`iter_batches`)."""
        bsz, n = self.spec.batch_size, self.num_rows
        for lo in range(0, n, bsz):
            hi = min(lo + bsz, n)
            parts = []
            row = lo
            while row < hi:
                c = row // self.chunk_rows
                dense, ids, labels = self._chunk(c)
                start, stop = row - c * self.chunk_rows, min(hi, (c + 1) * self.chunk_rows) - c * self.chunk_rows
                parts.append((dense[start:stop], ids[start:stop], labels[start:stop]))
                row += stop - start
            d, i, lab = (np.concatenate([p[j] for p in parts]) for j in range(3))
            yield make_batch(d, i, lab, self.spec.feature_names), {"epoch": 0, "row": hi}

    def __iter__(self) -> Iterator[tuple[Batch, dict]]:
        return self.iter_batches()
