"""Batch-aware undo logging (after TrainingCXL), and the no-checkpoint baseline.

Per step ``k``:

1. ``log_before_image``: the rows ``k`` will change are known from its sparse ids before the
   step computes. Their current values (embedding rows *and* their optimizer-state rows) are
   copied in memory (a gather: the only logging work on the critical path) and handed to the
   log-writer thread, which writes them to an undo-log slot and makes it durable.
2. forward and backward run while the log is written.
3. ``persist`` waits until the slot of ``k`` is sealed and durable (write-ahead rule: with an
   mmap the kernel may write a changed page back at any moment, so no row may change before
   its old value is durable).
4. ``update``: rows change in place.
5. ``commit``: every ``dense_every``-th step (when the previous checkpoint has finished; the
   final step always) the dense state is captured in memory and the checkpoint thread makes
   step ``k`` a recovery point: persist the rows (only dirty pages/rows are written), write
   the dense snapshot durably, then write the ``COMMIT`` record (last, atomically). Undo slots
   of steps <= ``k`` become reusable once that record is durable.

A checkpoint runs while the next steps compute. That is safe because each later step's undo
records are durable before it changes a row: if the checkpoint's row persist picks up a row
already changed by step k+1, recovery rolls that row back with step k+1's record.

Relaxation window: a crash loses the unfinished step plus the steps after the newest durable
``COMMIT`` — at most ``dense_every`` steps plus the checkpoint in flight (reported as
``max_commit_lag``). Recovery = apply the undo records of every step after ``COMMIT``,
newest first; time proportional to those rows, not to the model.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from memory_pool import MemoryPool
from memory_pool._fs import atomic_write, fsync_dir

from .base import Checkpointer, CheckpointStats, Touched
from .crash import CrashPlan
from .store import (UndoRecord, ckpt_dir, invalidate_slot, read_commit, scan_slots, write_commit,
                    write_dense, write_slot)

__all__ = ["UndoLogCheckpointer", "NoCheckpointer", "RUNNING_MARKER", "DenseStateFn"]

DenseStateFn = Callable[[int], dict]   # step -> dense state (tensors already copied)
RUNNING_MARKER = "RUNNING-WITHOUT-UNDO"
_STOP = object()


class _Background:
    """One worker thread; errors are kept and re-raised in the trainer's thread."""

    def __init__(self, name: str, fn: Callable):
        self.q: queue.Queue = queue.Queue()
        self.fn = fn
        self.error: BaseException | None = None
        self.busy = 0
        self.lock = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, job) -> None:
        with self.lock:
            self.busy += 1
        self.q.put(job)

    def _run(self) -> None:
        while True:
            job = self.q.get()
            if job is _STOP:
                return
            try:
                if self.error is None:
                    self.fn(job)
            except BaseException as exc:  # surfaced on the main thread
                self.error = exc
            finally:
                with self.lock:
                    self.busy -= 1
                    self.lock.notify_all()

    def idle(self) -> bool:
        with self.lock:
            return self.busy == 0

    def wait_idle(self) -> None:
        with self.lock:
            while self.busy:
                self.lock.wait()
        self.check()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.q.put(_STOP)
        self.thread.join()


class UndoLogCheckpointer(Checkpointer):
    """Undo logging into ``<storage_dir>/ckpt``. See the module docstring."""

    name = "undo"

    def __init__(self, pool: MemoryPool, dense_state: DenseStateFn, *, dense_every: int = 1,
                 crash: CrashPlan | None = None, max_pending_slots: int | None = None, coordinator=None):
        """``coordinator`` (several ranks): has ``global_min(int) -> int`` over all ranks. With
        one, checkpoints follow a fixed schedule (every ``dense_every`` steps, waiting for the
        previous one) so every rank has a snapshot at the same steps, and undo slots are
        reused only up to the newest step *every* rank has committed."""
        if dense_every < 1:
            raise ValueError(f"dense_every must be >= 1, got {dense_every}")
        self.pool = pool
        self.dense_state = dense_state
        self.dense_every = dense_every
        self.crash = crash
        # One process: a full log (64 steps since the last recovery point) forces a checkpoint.
        # Several ranks follow a fixed schedule instead: room for two intervals and one in flight.
        if max_pending_slots is None:
            max_pending_slots = 64 if coordinator is None else max(64, 2 * dense_every + 8)
        self.max_pending = max_pending_slots
        self.dir = ckpt_dir(pool.storage_dir)
        self.undo_dir = self.dir / "undo"
        self.undo_dir.mkdir(parents=True, exist_ok=True)
        self.stats = CheckpointStats()
        self.coordinator = coordinator
        if coordinator is not None and dense_every * 2 + 4 > max_pending_slots:
            raise ValueError(f"--dense-every {dense_every} is too large for coordinated commits "
                             f"(at most {(max_pending_slots - 4) // 2})")
        commit = read_commit(self.dir)
        self._durable_commit = commit["step"] if commit else -1
        self._last_submitted = self._durable_commit
        self._released = self._durable_commit   # undo slots of steps <= this are reusable
        self._slots_lock = threading.Lock()
        self._free = [s.path for s in scan_slots(self.undo_dir)]
        self._next_slot = len(self._free)
        self._pending: dict[int, Path] = {}   # step -> slot holding its undo records
        self._log_durable = -1
        self._log_cond = threading.Condition()
        self._step = None
        self._records: list[UndoRecord] | None = None
        self._tables: dict[str, object] = {}
        self._updated = False
        self._log = _Background("undo-log-writer", self._write_log)
        self._ckpt = _Background("checkpoint-writer", self._write_checkpoint)

    # -- crash injection
    def hit(self, phase: str) -> None:
        if self.crash is not None and self._step is not None:
            self.crash.hit(self._step, phase)

    # -- protocol
    def begin_step(self, step: int) -> None:
        self._log.check()
        self._ckpt.check()
        self._step = step
        self._records = None
        self._updated = False
        if self.crash is not None:
            self.crash.arm_random(step)

    def log_before_image(self, touched: Touched) -> None:
        t0 = time.perf_counter()
        self.hit("before-log")
        records = []
        for table, rows in touched:
            # A copy of the rows' current values: these are the step's before-images.
            records.append(UndoRecord(table.name, rows, table.view().index_select(0, rows)))
            self._tables[table.name] = table
        self._records = records
        slot = self._acquire_slot(self._step)
        self._log.submit((self._step, slot, records))
        self.stats.critical_seconds += time.perf_counter() - t0

    def before_images(self) -> dict[str, torch.Tensor] | None:
        if self._records is None:
            return None
        return {r.table: r.before for r in self._records}

    def _acquire_slot(self, step: int) -> Path:
        with self._slots_lock:
            full = len(self._pending) >= self.max_pending
        if full:
            # Too many steps since the last durable checkpoint: make the previous step one
            # (its dense state is the current one — this step has not updated anything yet).
            self.checkpoint_now(step - 1)
        with self._slots_lock:
            if self._free:
                slot = self._free.pop()
            else:
                slot = self.undo_dir / f"slot-{self._next_slot:04d}.log"
                self._next_slot += 1
            self._pending[step] = slot
            return slot

    def _write_log(self, job) -> None:
        step, slot, records = job
        mid = (lambda: self.crash.hit(step, "mid-log")) if self.crash else None
        n = write_slot(slot, step, records, mid_write=mid)
        self.stats.log_bytes += n
        with self._log_cond:
            self._log_durable = step
            self._log_cond.notify_all()

    def persist(self) -> None:
        t0 = time.perf_counter()
        step = self._step
        with self._log_cond:
            while self._log_durable < step and self._log.error is None:
                self._log_cond.wait(0.5)
        self._log.check()
        dt = time.perf_counter() - t0
        self.stats.log_wait_seconds += dt
        self.stats.critical_seconds += dt
        self.hit("after-log")

    def update(self, fn: Callable[[], None]) -> None:
        if self._log_durable < self._step:
            raise RuntimeError("update() before persist(): the write-ahead rule would be broken")
        self._updated = True
        fn()
        self.hit("after-update")

    def abort(self) -> None:
        """The step failed: restore its rows, drop its undo log, and make the previous step a
        recovery point — afterwards the pool is consistent and needs no recovery."""
        step = self._step
        if step is None:
            return
        if self._updated and self._records:
            for r in self._records:
                t = self._tables[r.table]
                t._scatter(r.ids, r.before)
            # Durable before the slot goes: a background checkpoint may already have persisted
            # this step's new values, and without the slot nothing could undo them any more.
            for r in self._records:
                self._tables[r.table].persist(r.ids)
        self._updated = False
        self._step = None
        if self._records is not None:
            self._log.wait_idle()
            with self._slots_lock:
                slot = self._pending.pop(step, None)
            if slot is not None:
                invalidate_slot(slot)  # durably: this step will not be rolled back again
                with self._slots_lock:
                    self._free.append(slot)
        if self.coordinator is None and self._durable_commit < step - 1:
            self.checkpoint_now(step - 1)

    def commit(self, step: int, *, final: bool = False) -> None:
        t0 = time.perf_counter()
        self.stats.steps += 1
        crash_here = (self.crash is not None and self.crash.step == step
                      and self.crash.phase in ("before-commit", "after-commit", "mid-dense"))
        if self.coordinator is None:
            # One process: checkpoint when due and the previous one has finished (never stall
            # the step on a slow tier); the final step, and a step a crash test aims at, always.
            due = step - self._last_submitted >= self.dense_every
            if final or crash_here:
                self._ckpt.wait_idle()
                self._submit_checkpoint(step)
                self._ckpt.wait_idle()
            elif due and self._ckpt.idle():
                self._submit_checkpoint(step)
        elif final or step % self.dense_every == 0:
            # Several ranks: the same fixed schedule on every rank, so that whatever step all
            # ranks have committed, each of them has its dense snapshot.
            self._ckpt.wait_idle()
            self._submit_checkpoint(step)
            if final or crash_here:
                self._ckpt.wait_idle()
        self._ckpt.check()
        self._release()
        self.stats.max_commit_lag = max(self.stats.max_commit_lag, step - max(self._durable_commit, 0))
        self.stats.critical_seconds += time.perf_counter() - t0
        self._step = None

    def _release(self) -> None:
        """Make undo slots reusable up to the newest step committed everywhere."""
        g = self._durable_commit
        if self.coordinator is not None:
            g = self.coordinator.global_min(g)
        if g <= self._released:
            return
        with self._slots_lock:
            for s in [s for s in self._pending if s <= g]:
                self._free.append(self._pending.pop(s))
        self._released = g

    def _submit_checkpoint(self, step: int) -> None:
        state = self.dense_state(step)  # captured now, on the trainer's thread: exactly step k
        self._last_submitted = step
        self._ckpt.submit((step, state))

    def checkpoint_now(self, step: int) -> None:
        """Make ``step`` a recovery point and wait for it (start of training, tests)."""
        self._ckpt.wait_idle()
        self._submit_checkpoint(step)
        self._ckpt.wait_idle()
        self._release()

    def _write_checkpoint(self, job) -> None:
        step, state = job
        crash = self.crash if (self.crash and self.crash.step == step) else None
        # 1. rows durable at (or, for rows a later logged step already changed, after) step k.
        t_bytes = self.pool.persist()
        # 2. the dense state of step k, durable under its final name.
        name, crc, d_bytes = write_dense(self.dir, step, state,
                                         mid_write=(lambda: crash.hit(step, "mid-dense")) if crash else None)
        if crash:
            crash.hit(step, "before-commit")
        # 3. the commit record last: from here on, recovery goes back to step k at most.
        write_commit(self.dir, step, name, crc)
        if crash:
            crash.hit(step, "after-commit")
        self._durable_commit = step
        self.stats.checkpoints += 1
        self.stats.last_commit_step = step
        self.stats.table_bytes_persisted += t_bytes
        self.stats.dense_bytes += d_bytes
        # 4. dense snapshots no recovery can need any more: older than the newest step that
        #    is committed everywhere (undo slots are released by the trainer's thread, _release).
        keep_from = min(step, self._released) if self.coordinator is not None else step
        for p in self.dir.glob("dense-*.pt"):
            try:
                if int(p.stem.split("-")[1]) < keep_from:
                    p.unlink()
            except (OSError, ValueError, IndexError):
                pass

    def close(self) -> None:
        try:
            self._log.wait_idle()
            self._ckpt.wait_idle()
        finally:
            self._log.stop()
            self._ckpt.stop()


class NoCheckpointer(Checkpointer):
    """``--checkpoint none``: no undo log. The state is a recovery point only at a clean end.

    While it trains, a marker file says so; recovery of a pool with that marker refuses
    (rows changed in place cannot be rolled back), instead of silently resuming a mix.
    """

    name = "none"

    def __init__(self, pool: MemoryPool, dense_state: DenseStateFn, *, crash: CrashPlan | None = None, **_):
        self.pool = pool
        self.dense_state = dense_state
        self.crash = crash
        self.dir = ckpt_dir(pool.storage_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = CheckpointStats()
        self._marked = False
        self._step = None

    def hit(self, phase: str) -> None:
        if self.crash is not None and self._step is not None:
            self.crash.hit(self._step, phase)

    def begin_step(self, step):
        self._step = step
        if not self._marked:
            atomic_write(self.dir / RUNNING_MARKER, f"{step}\n".encode())
            self._marked = True
        if self.crash is not None:
            self.crash.arm_random(step)

    # No log is written; the crash phases fire at the same points of the step as with undo.
    def log_before_image(self, touched):
        self.hit("before-log")
        self.hit("mid-log")

    def persist(self):
        self.hit("after-log")

    def update(self, fn):
        fn()
        self.hit("after-update")

    def commit(self, step, *, final=False):
        self.stats.steps += 1
        for phase in ("mid-dense", "before-commit"):
            self.hit(phase)
        if final:
            self.checkpoint_now(step)
        self.hit("after-commit")
        self._step = None

    def checkpoint_now(self, step: int) -> None:
        t_bytes = self.pool.persist()
        name, crc, d_bytes = write_dense(self.dir, step, self.dense_state(step))
        write_commit(self.dir, step, name, crc)
        for p in self.dir.glob("dense-*.pt"):
            if p.name != name:
                p.unlink()
        try:
            os.unlink(self.dir / RUNNING_MARKER)
            fsync_dir(self.dir)
        except FileNotFoundError:
            pass
        self._marked = False
        self.stats.checkpoints += 1
        self.stats.last_commit_step = step
        self.stats.table_bytes_persisted += t_bytes
        self.stats.dense_bytes += d_bytes
