"""The Criteo TSV reader, :class:`CriteoTSVReader`, and its line parsing (a fast batch parser and
a strict per-line checker that names the bad line)."""

from __future__ import annotations

import os
import re
from collections import deque
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import DataFormatError

from .batch import Batch, DataSpec, bad_position, make_batch, nonneg_int, validate_spec

_LABELS = frozenset((b"0", b"1"))
_INT_RE = re.compile(rb"-?[0-9]+")
_HEX_RE = re.compile(rb"[0-9a-fA-F]*")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class _BatchParseError(Exception):
    """Internal: the fast batch parser hit something; the slow path finds the line."""


def _show(field: bytes) -> str:
    s = field.decode("utf-8", "replace")
    return repr(s if len(s) <= 40 else s[:37] + "...")


class CriteoTSVReader:
    """Stream a Criteo-layout TSV file (possibly hundreds of GB) cyclically in batches.

    The file is read in binary through a buffered handle, line by line, and each batch of lines is
    parsed at once; memory use is O(batch). See the :mod:`dlrm_cxl.data` docstring for the
    preprocessing rules and the position format.
    """

    def __init__(self, path: str | os.PathLike, spec: DataSpec, skip_bad_lines: bool = False):
        validate_spec(spec)
        self.path = Path(path)
        self.spec = spec
        self.skip_bad_lines = bool(skip_bad_lines)
        # --skip-bad-lines counts: ``skipped`` every time a bad line was read (once per pass over
        # it), ``bad_lines`` the distinct bad lines, ``bad_passes`` the passes over the file
        # (epochs) in which at least one was skipped: one bad line in a file read 15 times is
        # skipped=15, bad_lines=1, bad_passes=15 (:meth:`skip_report`).
        self.skipped = 0
        self.bad_lines = 0
        self.bad_passes = 0
        self._last_bad_epoch: int | None = None
        self._first_cycle_end = (1, 0)  # (epoch, line): past it, this iteration reads lines again
        # the latest skips (epoch, line, first time, first of its pass): what a report up to a
        # position takes back of the read-ahead past it
        self._recent: deque[tuple[int, int, bool, bool]] = deque(maxlen=4096)
        self._nd = spec.num_dense
        self._nf = 1 + spec.num_dense + spec.num_sparse
        self._mods = np.asarray(spec.num_embeddings, dtype=np.int64)
        if not self.path.is_file():
            raise DataFormatError(f"{self.path}: no such file", hint="check the --data path")

    # -- parsing ------------------------------------------------------------------------------

    def _parse_fast(self, lines: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Parse a batch of raw lines at once; raise _BatchParseError if any line is bad.

        Column-wise list comprehensions with ``int()`` plus a ``bytes.translate`` character check
        per batch, then numpy for the clamp/log1p/modulo. (A fully numpy byte-level parser was
        measured and was not faster: ~115k rows/s either way on a 2-core machine.)"""
        nf, nd = self._nf, self._nd
        rows = [ln.rstrip(b"\r\n").split(b"\t") for ln in lines]
        for r in rows:
            if len(r) != nf:
                raise _BatchParseError
        labels = [r[0] for r in rows]
        if not _LABELS.issuperset(labels):
            raise _BatchParseError
        b = len(rows)
        try:
            if nd:
                dense_f = [x for r in rows for x in r[1 : 1 + nd]]
                if b"".join(dense_f).translate(None, b"0123456789-"):
                    raise _BatchParseError
                ints = np.array([int(x) if x else 0 for x in dense_f], dtype=np.int64)
                dense = np.log1p(np.maximum(ints, 0).astype(np.float64)).astype(np.float32)
                dense = dense.reshape(b, nd)
            else:
                dense = np.zeros((b, 0), dtype=np.float32)
            cat_f = [x for r in rows for x in r[1 + nd :]]
            if b"".join(cat_f).translate(None, b"0123456789abcdefABCDEF"):
                raise _BatchParseError
            vals = [int(x, 16) if x else 0 for x in cat_f]
        except (ValueError, OverflowError):
            raise _BatchParseError from None
        try:
            ids = np.array(vals, dtype=np.int64).reshape(b, -1) % self._mods
        except OverflowError:  # hex values >= 2**63: reduce in Python
            mods = [int(m) for m in self._mods] * b
            ids = np.array([v % m for v, m in zip(vals, mods)], dtype=np.int64).reshape(b, -1)
        lab = np.fromiter((x == b"1" for x in labels), dtype=np.float32, count=b)
        return dense, ids, lab

    def _line_error(self, line: bytes) -> str | None:
        """Describe what is wrong with one line, or None if it is fine (the strict slow path)."""
        fields = line.rstrip(b"\r\n").split(b"\t")
        if len(fields) != self._nf:
            return f"expected {self._nf} tab-separated fields, got {len(fields)}"
        if fields[0] not in _LABELS:
            return f"label (field 1) must be 0 or 1, got {_show(fields[0])}"
        for j in range(self._nd):
            x = fields[1 + j]
            if x and not _INT_RE.fullmatch(x):
                return f"integer feature I{j + 1} (field {j + 2}) is not an integer: {_show(x)}"
            if x and not (_INT64_MIN <= int(x) <= _INT64_MAX):
                return f"integer feature I{j + 1} (field {j + 2}) does not fit in int64: {_show(x)}"
        for j, name in enumerate(self.spec.feature_names):
            x = fields[1 + self._nd + j]
            if not _HEX_RE.fullmatch(x):
                return (
                    f"categorical feature C{j + 1} ({name}, field {j + 2 + self._nd}) is not "
                    f"hexadecimal: {_show(x)}"
                )
        return None

    def _error(self, line_no: int, what: str) -> DataFormatError:
        return DataFormatError(f"{self.path}:{line_no}: {what}")

    # -- streaming ----------------------------------------------------------------------------

    def _start(self, position: dict | None, size: int) -> tuple[int, int, int]:
        if position is None:
            return 0, 0, 0
        exp = '{"epoch": int >= 0, "offset": int >= 0, "line": int >= 0}'
        if not isinstance(position, dict) or not all(
            nonneg_int(position, k) for k in ("epoch", "offset", "line")
        ):
            raise bad_position(str(self.path), position, exp)
        off = int(position["offset"])
        if off > size:
            raise bad_position(str(self.path), position, f"an offset <= the file size {size}")
        if off > 0:
            with open(self.path, "rb") as f:
                f.seek(off - 1)
                if f.read(1) != b"\n":
                    raise bad_position(str(self.path), position, "an offset at the start of a line")
        return int(position["epoch"]), off, int(position["line"])

    def iter_arrays(self, rows: int, position: dict | None, cyclic: bool):
        """Yield ``(dense, ids, labels, position_after)`` numpy batches of ``rows`` rows.

        Cyclic: forever. Not cyclic: one pass from ``position`` to the end of the file; the last
        batch may be short (and none is yielded for an empty remainder). Public: the zarr converter
        streams through it; :meth:`iter_batches` wraps it into :class:`Batch` objects."""
        size = self.path.stat().st_size
        epoch, offset, line = self._start(position, size)
        # A line read at (epoch, line) <= this is read for the first time by this iteration.
        self._first_cycle_end = (epoch + 1, line)
        lines_in_file: int | None = None  # known once a whole pass from offset 0 has been read
        from_start, pass_lines = offset == 0, 0
        seen_good = False
        bad_total = 0
        buf: list[bytes] = []
        nums: list[int] = []
        eps: list[int] = []  # the epoch of each line of buf (a batch may span the end of the file)
        with open(self.path, "rb", buffering=1 << 20) as f:
            f.seek(offset)
            while True:
                raw = f.readline()
                if raw:
                    offset += len(raw)
                    line += 1
                    pass_lines += 1
                    buf.append(raw)
                    nums.append(line)
                    eps.append(epoch)
                    if len(buf) < rows:
                        continue
                else:  # end of file
                    if from_start:
                        if pass_lines == 0:
                            raise DataFormatError(
                                f"{self.path}: the file is empty (no data lines)",
                                hint="point --data at a non-empty Criteo TSV file",
                            )
                        lines_in_file = pass_lines
                    if cyclic:
                        if (not seen_good and not buf and lines_in_file is not None
                                and bad_total >= lines_in_file):
                            raise self.no_valid_line_error(bad_total)
                        epoch, offset, line = epoch + 1, 0, 0
                        from_start, pass_lines = True, 0
                        f.seek(0)
                        continue
                    if not buf:
                        return
                at_eof = not raw
                try:
                    dense, ids, labels = self._parse_fast(buf)
                except _BatchParseError:
                    buf, nums, eps, n_bad = self._drop_bad_lines(buf, nums, eps)
                    bad_total += n_bad
                    if buf:
                        seen_good = True
                    elif not seen_good and lines_in_file is not None and bad_total >= lines_in_file:
                        raise self.no_valid_line_error(bad_total) from None
                    if not at_eof:
                        continue  # read on to refill the batch
                    if not buf:
                        return
                    dense, ids, labels = self._parse_fast(buf)
                seen_good = True
                yield dense, ids, labels, {"epoch": epoch, "offset": offset, "line": line}
                buf, nums, eps = [], [], []
                if at_eof:
                    return

    def _drop_bad_lines(self, buf: list[bytes], nums: list[int], eps: list[int]):
        """Slow path: find the malformed lines of a batch; raise for the first one, or (with
        skip_bad_lines) drop and count them. ``eps``: the epoch of each line. Returns
        (good_lines, their_numbers, their_epochs, n_dropped)."""
        good, good_nums, good_eps = [], [], []
        for ln, no, ep in zip(buf, nums, eps):
            err = self._line_error(ln)
            if err is None:
                good.append(ln)
                good_nums.append(no)
                good_eps.append(ep)
            elif not self.skip_bad_lines:
                raise self._error(no, err) from None
            else:
                self._count_skip(ep, no)
        if len(good) == len(buf):  # the fast and the strict path disagree: should not happen
            raise DataFormatError(f"{self.path}:{nums[0]}-{nums[-1]}: malformed data in these lines")
        return good, good_nums, good_eps, len(buf) - len(good)

    def _count_skip(self, epoch: int, line_no: int) -> None:
        self.skipped += 1
        new = (epoch, line_no) <= self._first_cycle_end  # not read before by this iteration
        self.bad_lines += new
        new_pass = epoch != self._last_bad_epoch
        if new_pass:
            self.bad_passes += 1
            self._last_bad_epoch = epoch
        self._recent.append((epoch, line_no, new, new_pass))

    def skip_report(self, upto: dict | None = None) -> dict:
        """What --skip-bad-lines skipped: ``{"lines": distinct bad lines, "skips": times a bad
        line was read and skipped, "passes": passes over the file that skipped one}``.

        ``upto``: a position this reader gave (a batch's), to count only the lines up to it and
        not those read ahead of it (a trainer's prefetch): the report of the data it trained on."""
        lines, skips, passes = self.bad_lines, self.skipped, self.bad_passes
        if isinstance(upto, dict) and nonneg_int(upto, "epoch") and nonneg_int(upto, "line"):
            end = (int(upto["epoch"]), int(upto["line"]))
            for epoch, no, new, new_pass in self._recent:
                if (epoch, no) > end:
                    skips -= 1
                    lines -= new
                    passes -= new_pass
        return {"lines": lines, "skips": skips, "passes": passes}

    def no_valid_line_error(self, bad: int) -> DataFormatError:
        """The error for a file in which no line is valid (``bad`` malformed lines skipped)."""
        return DataFormatError(
            f"{self.path}: no valid line in the file ({bad} malformed lines skipped)",
            hint="the file is not in Criteo layout; check --data and the number of features",
        )

    def iter_batches(self, position: dict | None = None) -> Iterator[tuple[Batch, dict]]:
        """Yield ``(batch, position_after_batch)`` forever, starting at ``position`` (None: start)."""
        names = self.spec.feature_names
        for dense, ids, labels, pos in self.iter_arrays(self.spec.batch_size, position, cyclic=True):
            yield make_batch(dense, ids, labels, names), pos

    def iter_pass(self) -> Iterator[tuple[Batch, dict]]:
        """One pass over the file from its start (each sample once, the last batch short): what
        evaluation reads, where training cycles (:meth:`iter_batches`)."""
        names = self.spec.feature_names
        for dense, ids, labels, pos in self.iter_arrays(self.spec.batch_size, None, cyclic=False):
            yield make_batch(dense, ids, labels, names), pos

    def __iter__(self) -> Iterator[tuple[Batch, dict]]:
        return self.iter_batches()
