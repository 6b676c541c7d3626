"""Baseline checkpointers that users would otherwise pick. FOR BENCHMARKS ONLY.

A tool, not part of the product (it lives in ``tools/``, outside the installed packages; the CLI's
``--checkpoint`` offers only ``undo`` and ``none``): ``tools/bench_checkpoint.py`` and
``tools/bench_train.py`` import it as ``baselines`` with ``tools/`` on ``sys.path``, and so do
the tests.

They implement the :class:`~checkpointing.base.Checkpointer` interface so that the trainer can
drive them exactly like :class:`~checkpointing.undo.UndoLogCheckpointer`
(``tools/bench_checkpoint.py`` swaps them into a :class:`dlrm_cxl.trainer.Trainer`), but they
are *not* recovery mechanisms of this project: ``recover`` / ``dlrm-cxl train`` know nothing
about their files, they roll nothing back, and a crash between two of their checkpoints leaves
the pool's rows changed in place (a user of these would restore the *whole* model from the file
instead, losing every step since it was written).

* :class:`FullSaveCheckpointer` -- what people do today: every ``every`` steps, synchronously
  (on the critical path), ``torch.save`` the whole model (every pool table's rows, the
  optimizer-state tables included, plus the dense state) to ``<storage_dir>/baseline/full.pt``,
  durably: temporary name, fsync, rename, fsync of the directory.
* :class:`IncrementalCheckpointer` -- Check-N-Run style: tracks the rows changed since its last
  checkpoint (the union per table of the rows ``log_before_image`` is told about) and every
  ``every`` steps writes only those rows' current values plus the dense state, durably, to
  ``<storage_dir>/baseline/incr-<step>.pt``. Restoring needs a base (e.g. a full checkpoint,
  or the pool's initial state) plus every increment after it, applied oldest first
  (:func:`apply_increments`).

Both are synchronous: a checkpoint finishes inside ``commit`` before the next step starts, so a
crash loses at most the steps since the last multiple of ``every`` (``every - 1`` completed
steps plus the unfinished one).

* :class:`BytesFloorCheckpointer` -- not a checkpointer at all, but the physical floor of the undo
  log's recovery point *inside a training step*: it moves exactly the bytes a recovery point
  moves and nothing else (the touched rows gathered into a reusable buffer -- before the update
  on a direct tier, after it on a journaled one, as the undo log does -- the dense state's
  tensors copied into another, and a crc32c of both), on the trainer's thread, and makes
  nothing durable. With ``window=W`` it moves a recovery window's bytes instead: each row once
  per window (the rows a step touches first, found with the undo log's own bitmap) and the dense
  state at the window's last step. ``tools/bench_train.py --checkpoints none,floor,undo
  [--window W]`` runs it side by side with the real thing: what the undo log costs beyond it is its own overhead (records, Python,
  the journal), what it costs over ``none`` is the price of those bytes on this machine.

Stats (:class:`~checkpointing.base.CheckpointStats`): ``critical_seconds`` is all the time spent
in the checkpointer's calls (tracking rows, gathering, serialising, writing, fsync);
``checkpoints`` counts files made durable; bytes made durable are split as

* full: ``table_bytes_persisted`` = the tables' row bytes in the file, ``dense_bytes`` = the rest
  of the file (dense state, pickle framing);
* incremental: ``log_bytes`` = the changed rows (ids + values), ``dense_bytes`` = the rest of the
  file.

``max_commit_lag`` is measured like the undo checkpointer's: at each ``commit``, the steps since
the newest durable checkpoint (here at most ``every - 1``).
"""

from __future__ import annotations

import abc
import io

import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from checkpointing.base import Checkpointer, CheckpointStats, Step, Touched
from checkpointing.window import WindowRows
from memory_pool import MemoryPool
from memory_pool.durable import atomic_write
from memory_pool.records import crc32c_extend

__all__ = ["FullSaveCheckpointer", "IncrementalCheckpointer", "BytesFloorCheckpointer", "durable_torch_save",
           "baseline_dir", "load_full", "apply_increments"]

DenseStateFn = Callable[[int], dict]


def baseline_dir(pool: MemoryPool) -> Path:
    """Where the baseline checkpointers write: ``<pool storage_dir>/baseline``."""
    return Path(pool.storage_dir) / "baseline"


def durable_torch_save(obj, path: Path) -> int:
    """``torch.save(obj)`` to ``path`` so that a crash leaves the old or the new file (through
    memory_pool's atomic_write: temporary name, fsync, rename, fsync of the directory).
    Returns the file's size in bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write(Path(path), buf.getbuffer())
    return buf.getbuffer().nbytes


def _pool_tables(pool: MemoryPool) -> list:
    return [pool.table(n) for n in pool.tables()]


class _Synchronous(Checkpointer):
    """Shared plumbing: no undo log; ``commit`` checkpoints every ``every`` steps, in line."""

    def __init__(self, pool: MemoryPool, dense_state: DenseStateFn, *, every: int = 10, directory=None, **_):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        self.pool = pool
        self.dense_state = dense_state
        self.every = every
        self.dir = Path(directory) if directory is not None else baseline_dir(pool)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = CheckpointStats()
        self._cur: Step | None = None
        self._last_ckpt: int | None = None   # newest step made durable by this checkpointer

    def begin_step(self, step: int) -> None:
        self._cur = Step(step)

    def log_before_image(self, touched: Touched) -> None:
        pass

    def persist(self) -> None:
        pass

    def update(self, fn: Callable[[], None]) -> None:
        fn()

    def commit(self, step: int, *, final: bool = False, witness: dict | None = None) -> None:
        t0 = time.perf_counter()
        self.stats.steps += 1
        if final or step % self.every == 0:
            self.checkpoint_now(step)
        base = self._last_ckpt if self._last_ckpt is not None else 0
        self.stats.max_commit_lag = max(self.stats.max_commit_lag, step - base)
        self.stats.critical_seconds += time.perf_counter() - t0
        self._cur = None

    def checkpoint_now(self, step: int) -> None:
        self._write(step)
        self._last_ckpt = step
        self.stats.checkpoints += 1
        self.stats.last_commit_step = step

    @abc.abstractmethod
    def _write(self, step: int) -> None:
        """Write the checkpoint of ``step`` durably (the subclass's format)."""


class FullSaveCheckpointer(_Synchronous):
    """Every ``every`` steps: a durable ``torch.save`` of every table and the dense state.
    FOR BENCHMARKS ONLY (see the module docstring)."""

    name = "full"
    FILE = "full.pt"

    @property
    def path(self) -> Path:
        return self.dir / self.FILE

    def _write(self, step: int) -> None:
        tables = {t.name: t.view() for t in _pool_tables(self.pool)}  # saved straight from the pool
        table_bytes = sum(v.numel() * v.element_size() for v in tables.values())
        size = durable_torch_save({"step": step, "tables": tables, "dense": self.dense_state(step)}, self.path)
        self.stats.table_bytes_persisted += table_bytes
        self.stats.dense_bytes += size - table_bytes


class IncrementalCheckpointer(_Synchronous):
    """Every ``every`` steps: the rows changed since the last checkpoint + the dense state.
    FOR BENCHMARKS ONLY (see the module docstring).

    ``keep_files=False`` deletes each increment once the next one is durable (benchmarks that
    only measure the cost and must not fill the disk); a real user keeps them all.
    """

    name = "incremental"

    def __init__(self, pool: MemoryPool, dense_state: DenseStateFn, *, every: int = 10, directory=None,
                 keep_files: bool = True, **kw):
        super().__init__(pool, dense_state, every=every, directory=directory, **kw)
        self.keep_files = keep_files
        self._changed: dict[str, list[torch.Tensor]] = {}
        self._tables: dict[str, object] = {}
        self._prev_file: Path | None = None

    def log_before_image(self, touched: Touched) -> None:
        t0 = time.perf_counter()
        for table, rows in touched:
            self._changed.setdefault(table.name, []).append(rows)
            self._tables[table.name] = table
        self.stats.critical_seconds += time.perf_counter() - t0

    def _write(self, step: int) -> None:
        rows: dict[str, dict[str, torch.Tensor]] = {}
        row_bytes = 0
        for name, parts in self._changed.items():
            ids = torch.unique(torch.cat(parts)) if len(parts) > 1 else parts[0]
            vals = self._tables[name].view().index_select(0, ids)
            rows[name] = {"ids": ids, "values": vals}
            row_bytes += ids.numel() * ids.element_size() + vals.numel() * vals.element_size()
        path = self.dir / f"incr-{step:012d}.pt"
        size = durable_torch_save({"step": step, "rows": rows, "dense": self.dense_state(step)}, path)
        self._changed = {}
        self.stats.log_bytes += row_bytes
        self.stats.dense_bytes += size - row_bytes
        if not self.keep_files and self._prev_file is not None and self._prev_file != path:
            try:
                self._prev_file.unlink()
            except OSError:
                pass
        self._prev_file = path

    def abort(self) -> None:
        # The failed step's rows were recorded as changed; if they were not, writing their
        # current values again is harmless. Nothing to undo in memory: no before-images here.
        self._cur = None


class BytesFloorCheckpointer(Checkpointer):
    """The bytes of a recovery point, copied and checksummed on the trainer's thread, made
    durable nowhere. FOR BENCHMARKS ONLY (see the module docstring): a crash loses everything
    since the pool was opened."""

    name = "floor"

    def __init__(self, pool: MemoryPool, dense_state: DenseStateFn, *, window: int = 1, **_):
        """``window``: a recovery window of W steps, as the undo log's: each row's bytes once
        per window (the rows a step touches first, :class:`~checkpointing.window.WindowRows`),
        the dense state at the window's last step."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.pool = pool
        self.dense_state = dense_state
        self._window = window
        self._first = WindowRows() if window > 1 else None
        self.stats = CheckpointStats()
        self._cur: Step | None = None
        self._rows: dict = {}                       # reusable gather buffers, per row size
        self._dense = torch.empty(0, dtype=torch.uint8)

    def begin_step(self, step: int) -> None:
        self._cur = Step(step)

    def log_before_image(self, touched: Touched) -> None:
        t0 = time.perf_counter()
        # (kept as given when it is a list: a TouchedRows keeps its one numbering, as the undo log's)
        self._cur.touched = touched if isinstance(touched, list) else list(touched)
        if not self.pool.journaled:
            if self._first is not None:
                self._cur.touched = self._first.first_touch(touched)[0]
            self.stats.log_bytes += self._copy_rows()   # before-images: before the update
        self.stats.critical_seconds += time.perf_counter() - t0

    def persist(self) -> None:
        pass

    def update(self, fn: Callable[[], None]) -> None:
        fn()

    def commit(self, step: int, *, final: bool = False, witness: dict | None = None) -> None:
        t0 = time.perf_counter()
        self.stats.steps += 1
        ends = final or step % self._window == 0
        if self.pool.journaled and self._cur is not None:
            if self._first is not None:
                self._first.first_touch(self._cur.touched)
                self._cur.touched = self._first.touched_rows() if ends else []
            if self._cur.touched:
                self.stats.table_bytes_persisted += self._copy_rows()   # after-images: after it
        if ends:
            self.checkpoint_now(step)
        self.stats.critical_seconds += time.perf_counter() - t0
        self._cur = None

    @property
    def window(self) -> int:
        return self._window

    def checkpoint_now(self, step: int) -> None:
        """Recovery point ``step``: its dense state copied and checksummed (the rows are copied
        by the steps that change them; see ``log_before_image`` and ``commit``)."""
        tensors = [t.detach().reshape(-1).view(torch.uint8) for t in _tensors(self.dense_state(step))]
        n = sum(t.numel() for t in tensors)
        if self._dense.numel() < n:
            self._dense = torch.empty(n, dtype=torch.uint8)
        torch.cat(tensors, out=self._dense[:n])
        crc32c_extend(0, self._dense[:n].numpy())
        self.stats.dense_bytes += n
        if self._first is not None:
            self._first.reset()
        self.stats.checkpoints += 1
        self.stats.last_commit_step = step

    def _copy_rows(self) -> int:
        n = 0
        for _, rows in self.pool.gather_row_groups(self._cur.touched, self._rows):
            raw = rows.view(torch.uint8)
            crc32c_extend(0, raw.numpy())
            n += raw.numel() + 8 * rows.shape[0]   # (counted as the journal counts them: rows and ids)
        return n


def _tensors(x):
    """Every tensor (and numpy array) of a nested dense state, in order."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, np.ndarray):
        yield torch.from_numpy(np.ascontiguousarray(x))
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            if isinstance(v, (torch.Tensor, np.ndarray, dict, list, tuple)):
                yield from _tensors(v)


def load_full(path) -> dict:
    """``torch.load`` of a :class:`FullSaveCheckpointer` file: ``{"step", "tables", "dense"}``."""
    return torch.load(path, weights_only=False)


def apply_increments(pool: MemoryPool, paths: Iterable) -> dict | None:
    """Apply :class:`IncrementalCheckpointer` files to ``pool``'s tables, oldest first (the pool
    must already hold the base they were taken against). Returns the newest file's dense state."""
    dense = None
    for p in sorted(Path(x) for x in paths):
        doc = torch.load(p, weights_only=False)
        for name, r in doc["rows"].items():
            pool.table(name).scatter_rows(r["ids"], r["values"])
        dense = doc["dense"]
    return dense
