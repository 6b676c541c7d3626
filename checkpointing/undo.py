"""Batch-aware undo logging on the pool's journal (after TrainingCXL), and the no-checkpoint mode.

Per step ``k`` (the call order of :mod:`checkpointing.base`)::

    begin_step(k)
    log_before_image(touched)   # the rows k will change, known from its ids before it computes
    ... forward ...
    persist()                   # the write-ahead barrier: right before the in-place update
    ... fused backward: the rows change in place ...   (or update(fn) for a non-fused optimizer)
    commit(k)                   # step k becomes a recovery point

What is written depends on where a store lands (``MemoryPool.journaled``):

* **Direct tiers** (shm, real pmem): an in-place store reaches the surviving medium at once, so the
  rows' old values must be durable *before* the update: ``log_before_image`` hands the rows to
  the writer thread, which gathers the before-images (a memory copy, while the forward only
  reads them), appends them as ``UNDO`` records and syncs; ``persist`` waits for that. An inline
  writer (no spare core: ``dlrm_cxl.options.resolve_writer``) does the same in ``persist``
  itself, after the forward has read the rows. Recovery rolls back the ``UNDO`` records after
  the last commit.
* **Journaled tiers** (emulated pmem, power-sim): the working copy is volatile and a row reaches
  durable media only inside a committed journal transaction. The rows of an unfinished step never
  need undoing, so no before-images are written; ``commit`` appends the step's after-images
  (``ROWS``) instead. (With several ranks, every tier also writes ``UNDO``: a rank may have to roll
  back past its own newest commit, to the step every rank committed.)

**The logged mark** (direct tiers; TrainingCXL's persistent flag). Once a step's ``UNDO``
records are durable, a ``LOGGED`` record is made durable after them, and only then may a row
change (``persist`` waits for both). It tells recovery which side of the write-ahead barrier a
crash came: a bad record of a step *before* its valid mark was durable when the step's rows
began to change, so it is damage (exit 4, nothing changed); a step without a durable mark never
changed a row, so whatever of its records is bad is a torn tail, dropped. (Without the mark a
bad last ``UNDO`` record looked like a torn tail while the rows it covered had changed:
recovery restored the others and said the pool was consistent.) Each of the step's ``UNDO``
records carries its *undo group* (the sequence number of its first one) and the mark names the
group and its size (``memory_pool.records``): the rules are in ``checkpointing.recovery``.
What it costs a step:

* shm (and dram): the journal is a shared mapping, never synced: a store into it is as durable
  as it gets (outside the process: it survives the process's crash, which is all this tier
  survives) and a crash keeps the stores made before it, in program order. The mark is the last
  record of the records' own write, its header the last store: a valid mark implies every byte
  before it. It costs 56 bytes (a 40-byte header and a 16-byte payload) and each ``UNDO``
  record 16 more (its undo group), no system call: 3-4 us a step here (appending `tiny`'s two
  records took 21 us without it, 25 with it; `small`'s, ~860 us either way).
* real pmem (a journal written with ``O_DIRECT`` and ``fdatasync``): a write may reach the
  device in any order of its blocks before the sync returns, so a mark written with the records
  could survive a power loss that tore them, and a step that never changed a row would be
  refused as damaged. The mark is written after the records' ``fdatasync`` has returned and is
  synced itself: one more block write and ``fdatasync`` per step (SQLite's rule for its END).
* journaled tiers write no mark: an unfinished step's rows never reached durable media there,
  so a torn or bad record of it never matters (with several ranks they still log ``UNDO``).

**Recovery windows** (:mod:`checkpointing.policy`). Every step ends with a durable ``END``; most
are *step records* (``{"kind": "step", "step": k, "loss": bits, "position": ...}``: the replay's
witness, a few hundred bytes), and the last step of each window of W steps is a *recovery point*
(``{"kind": "commit", ...}``) that also holds the dense state. On direct tiers a row's
before-image is logged only the first time the window touches it (:class:`~checkpointing.window.
WindowRows`; the write-ahead rule holds for that first touch, and rolling back every ``UNDO``
record since the window's start restores it). On journaled tiers the window's end writes the
after-images of every row the window changed, each once. Recovery restores the newest recovery
point and the trainer replays the steps recorded after it (:mod:`checkpointing.recovery`,
:mod:`dlrm_cxl.replay`). W = 1 is a recovery point every step: the records of each step are
exactly those of a recovery point, as before windows existed.

``commit(k)`` hands the step's transaction to the writer thread: at a window's end with the rows
the window changed and the dense state's live tensors; the writer gathers the rows'
after-images, packs the tensors (raw bytes, no pickle), appends them and makes the transaction
durable with one group commit (records synced, then the ``END``: :class:`memory_pool.Transaction`). The next step's ``persist`` (before the fused
backward changes rows) and ``update`` (the dense optimizer step) wait until they are copied, so
the trainer's thread copies neither rows nor dense state. Pipelining, not skipping: step ``k+1``
computes while ``k`` becomes durable; ``commit(k+1)`` waits only if ``k`` is still not durable
then (``commit_wait_seconds``). So a crash loses at most the step in flight and the one before
it.

The journal is kept short (thresholds: :mod:`checkpointing.policy`): once a commit is durable,
segments before the newest recovery point
(before the newest step every rank committed, with several ranks) are compacted into the table
images in the background and dropped.
"""

from __future__ import annotations

import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from memory_pool import MemoryPool, Transaction, intra_op_threads, one_intra_op_thread

from .base import Checkpointer, CheckpointStats, Step, Touched
from .crash import COMMIT_PHASES, CrashPlan
from .policy import WindowConfig, WindowPolicy, default_apply_bytes, default_compact_bytes
from .store import RUNNING_MARKER, DensePacker, ckpt_dir, commit_doc, is_commit
from .window import WindowRows

# Recovery points whose END is remembered for compacted_through (a dict entry each; a compaction
# covers a few hundred at most on `kaggle`, and an older answer is only a smaller one)
MAX_POINTS_KEPT = 4096

__all__ = ["UndoLogCheckpointer", "RUNNING_MARKER", "DenseStateFn", "Step", "loss_bits"]

# step -> dense state. Its tensors may be live: the writer thread packs them while the next step
# computes, so they may change only inside ``update(fn)`` (which first waits for that).
DenseStateFn = Callable[[int], dict]


def loss_bits(loss) -> str:
    """The exact bits of a loss (a float32 tensor or a Python float), as 8 hex digits: what a
    step record holds and a replayed step must reproduce."""
    if isinstance(loss, torch.Tensor):
        return "%08x" % (int(loss.detach().reshape(()).to(torch.float32).view(torch.int32)) & 0xFFFFFFFF)
    return struct.pack(">f", float(loss)).hex()


class UndoLogCheckpointer(Checkpointer):
    """See the module docstring."""

    name = "undo"

    def __init__(self, pool: MemoryPool, dense_state: DenseStateFn, *, window: WindowConfig | int | None = None,
                 crash: CrashPlan | None = None, coordinator=None, inline: bool = False):
        """``window``: a :class:`~checkpointing.policy.WindowConfig`, or a fixed window length
        (default 1: a recovery point every step). ``coordinator`` (several ranks): has
        ``global_min(int) -> int``; recovery points then fall on the same steps on every rank,
        and journal records are kept back to the newest step that *every* rank committed.
        ``inline``: the writer's work runs on the caller's thread when it is handed over (no
        pipelining; the inline writer of ``dlrm_cxl.options.resolve_writer``)."""
        if window is None or isinstance(window, int):
            window = WindowConfig(window=window or 1)
        self.pool = pool
        self.journal = pool.journal
        self.dense_state = dense_state
        self.policy = WindowPolicy(window, coordinator=coordinator)
        self.crash = crash
        self.coordinator = coordinator
        self.log_undo = not pool.journaled or coordinator is not None
        self.log_rows = pool.journaled
        # The logged mark (see the module docstring): where a step's rows change in place on the
        # surviving medium, i.e. where UNDO records are what recovery restores them from.
        self.log_mark = self.log_undo and not pool.journaled
        self.stats = CheckpointStats()
        self.compact_bytes = default_compact_bytes(pool.journaled)
        self.apply_bytes = default_apply_bytes(self.compact_bytes, pool.used_bytes())
        self._packer = DensePacker()
        self._read = threading.Event()   # the writer has copied what the newest commit reads in place
        self._read.set()
        self._inline = inline
        self._writer = _Inline() if inline else ThreadPoolExecutor(1, thread_name_prefix="journal-writer",
                                                                   initializer=one_intra_op_thread)
        self._inflight: Future | None = None    # the newest recovery point handed over
        self._last_job: Future | None = None    # the newest transaction part handed over
        self._cur: Step | None = None
        commits = [t for t in self.journal.txns if is_commit(t)]
        self._durable_commit = commits[-1].tag if commits else -1
        self._released = self._durable_commit
        self.window_start = self._durable_commit   # the newest recovery point handed over
        self._txn_start: dict[int, int] = {t.tag: t.first_seq for t in commits[-4:]}
        self._txn_end: dict[int, int] = {}   # this process's recovery points: their END's seq (compacted_through)
        self._compact_soon = False   # compact at the next recovery point, whatever the journal holds
        self._lock = threading.Lock()
        self._broken: str | None = None
        # The rows the window has touched (writer thread): on direct tiers, to log each one's
        # before-image once; on journaled tiers, to write each one's after-image once, at the end.
        self._first = WindowRows()
        # Witnesses of steps being replayed (dlrm_cxl.replay): each recovery point carries those
        # after it, so a crash during the replay loses none.
        self.carry: dict[int, dict] = {}
        # Reusable gather buffers for the before-images of a journal written directly (not
        # mapped): step k's (kept until its commit, for abort) and step k+1's.
        self._bufs = {i: {} for i in (0, 1)}
        self._closed = False
        ckpt_dir(pool.storage_dir).mkdir(parents=True, exist_ok=True)

    @property
    def window(self) -> int:
        """The current recovery window's length in steps."""
        return self.policy.length

    def observe_step(self, seconds: float) -> None:
        """The trainer measured a step (the window's length follows the step time)."""
        self.policy.observe(seconds)

    # -- crash injection
    def hit(self, phase: str) -> None:
        if self.crash is not None and self._cur is not None:
            self.crash.hit(self._cur.k, phase)

    def _check(self) -> None:
        for f in (self._inflight, self._cur.undo if self._cur else None):
            if f is not None and f.done() and f.exception() is not None:
                raise f.exception()

    # -- protocol
    def begin_step(self, step: int) -> None:
        if self._broken:
            raise RuntimeError(f"{self._broken}: reopen the pool to continue from its last commit")
        self._check()
        self._cur = Step(step)
        self._cur.txn = self.pool.begin(step)
        # Every row of the step is logged (abort can put them all back) only in a window's
        # first step.
        self._cur.complete = self.window_start == step - 1
        if self.crash is not None:
            self.crash.arm_random(step)

    def log_before_image(self, touched: Touched) -> None:
        t0 = time.perf_counter()
        cur = self._cur
        self.hit("before-log")
        cur.touched = touched if isinstance(touched, list) else list(touched)
        if self.log_undo:
            # Nothing on the trainer's thread here: the writer thread copies the rows' current
            # values (the step's before-images), appends and syncs them while the forward runs.
            # No row changes before persist() has waited for that.
            cur.gathered = Future()
            job = (self._write_undo, cur, self._bufs[cur.k % 2])
            # An inline writer runs it at the write-ahead barrier instead (persist(), after the
            # forward, right before the rows change): the forward has just read the step's
            # rows, so the gather finds them in cache rather than missing on each (measured on
            # shm, `small`, in-process, 5 rounds: 73.9 against 77.3 ms a step, none 71.6).
            cur.undo = _Later(self._writer, *job) if self._inline else self._writer.submit(*job)
        else:
            self.hit("mid-log")
        self.stats.critical_seconds += time.perf_counter() - t0

    def before_images(self) -> dict[str, torch.Tensor] | None:
        cur = self._cur
        if cur is None or cur.gathered is None or not cur.complete:
            return None  # (inside a window only the rows it touches first are logged)
        if isinstance(cur.undo, _Later):
            cur.undo.start()  # (asked for before the barrier: the reference path's update)
        before = cur.gathered.result()  # (copied by now, or the writer's error)
        return {t.name: b for (t, _), b in zip(cur.touched, before)}

    def _write_undo(self, cur: Step, bufs: dict) -> int:
        cpu0 = time.thread_time()
        try:
            return self._log_undo(cur, bufs)
        finally:
            self.stats.writer_cpu_seconds += time.thread_time() - cpu0

    def _log_undo(self, cur: Step, bufs: dict) -> int:
        k = cur.k
        try:
            # The rows the window touches for the first time: their before-images are the
            # values at the window's start, all a rollback to it needs.
            first, _ = self._first.first_touch(cur.touched)
            cur.logged = first
            mid = self.crash is not None and self.crash.at(k, "mid-log")
            # The before-images one per pair only where they can be used (a window's first step
            # logs all its rows: abort() can put them back, before_images() hands them out);
            # splitting the records into ~50 views cost ~0.3 ms a step on `small` under cProfile
            # (the undo job's wall time on shm, 3 runs side by side: 2.73 -> 2.52 ms a step).
            n = cur.txn.undo(first, mark=self.log_mark, buffers=bufs,
                             gathered=cur.gathered.set_result if cur.complete else None,
                             halfway=(lambda: self.crash.hit(k, "mid-log")) if mid else None)
        except BaseException as exc:
            # (the trainer's thread may be waiting for the before-images: it gets the cause)
            if not cur.gathered.done():
                cur.gathered.set_exception(exc)
            raise
        if not cur.gathered.done():
            cur.gathered.set_result(None)
        cur.before = cur.gathered.result()
        self.stats.log_bytes += n
        return n

    def persist(self) -> None:
        t0 = time.perf_counter()
        if self._cur.undo is not None:
            self._cur.undo.result()
        dt = time.perf_counter() - t0
        self.stats.log_wait_seconds += dt
        self.stats.critical_seconds += dt
        # The update may follow at once (the fused backward's): what the writer thread reads of
        # the previous commit (its after-images, its dense state) must have been read first.
        self._wait_read()
        self.hit("after-log")

    def update(self, fn: Callable[[], None]) -> None:
        cur = self._cur
        if cur.undo is not None and not cur.undo.done():
            raise RuntimeError("update() before persist(): the write-ahead rule would be broken")
        self._wait_read()
        cur.updated = True
        fn()
        self.hit("after-update")

    def mark_updated(self) -> None:
        """The step's rows changed in place outside ``update`` (a fused backward did it)."""
        self._cur.updated = True

    def abort(self) -> None:
        """The step failed: put its rows back and make the previous step a recovery point, so
        the pool needs no recovery afterwards."""
        cur = self._cur
        if cur is None:
            return
        if cur.updated and cur.before is not None and cur.complete:
            for (t, rows), b in zip(cur.touched, cur.before):
                t.scatter_rows(rows, b)
            if self.pool.real_pmem:
                self.pool.persist_rows([(t, rows) for t, rows in cur.touched])
        elif cur.updated:
            # The changed rows cannot be put back from this step's records: a journaled tier
            # keeps no before-images (the rows live only in this process's working copy and
            # never reached durable media), and inside a window only the rows the window
            # touched first were logged. The pool on media is at its last recovery point plus
            # the recorded steps; this process must not train on: every later step refuses.
            self._broken = f"step {cur.k} failed after changing rows in memory"
        self._cur = None
        if self.coordinator is None and not self._broken:
            self.checkpoint_now(cur.k - 1)

    def commit(self, step: int, *, final: bool = False, witness: dict | None = None) -> None:
        """``witness``: what replay checks the step against (``loss``: :func:`loss_bits`,
        ``position``: the data position); it goes into the step's ``END``."""
        t0 = time.perf_counter()
        cur = self._cur
        self.stats.steps += 1
        crash_wait = self.crash is not None and self.crash.at(step, *COMMIT_PHASES)
        # (mid-dense needs a recovery point to crash in; not with several ranks, whose windows
        # must end at the same steps on every rank, and only the crashing rank has the plan)
        forced = self.crash is not None and self.coordinator is None and self.crash.at(step, "mid-dense")
        ends = final or forced or self.policy.ends(step, self.window_start)
        if witness is None and cur is not None:
            witness = cur.witness
        doc = {"kind": "commit" if ends else "step", "step": step, **(witness or {})}
        self._submit(step, cur.txn if cur is not None else None, ends, doc, wait=final or crash_wait)
        self._release(ends)
        self.stats.max_commit_lag = max(self.stats.max_commit_lag, step - max(self._durable_commit, 0))
        self.stats.critical_seconds += time.perf_counter() - t0
        self._cur = None

    def _submit(self, step: int, txn: Transaction | None, ends: bool, doc: dict, *, wait: bool) -> None:
        # Pipeline depth one: whatever was handed over for the previous step must be durable
        # before this step's is handed over. So a crash loses at most the step in flight and the
        # one before it, and the writer never lags a step behind: the double-buffered
        # after-images it is writing are never overwritten.
        if self._last_job is not None:
            t0 = time.perf_counter()
            self.stats.commit_waits += not self._last_job.done()
            self._last_job.result()
            self.stats.commit_wait_seconds += time.perf_counter() - t0
        if ends:
            # A direct home's write-back DRAM cache goes home now: before this recovery point's
            # END (the writer appends it only after this job is handed over), so the home is
            # exact at the point and a crash before the END rolls back to the window before
            # (whose records cover every row written here: each was touched in it); and before
            # the next step's undo job, which reads its first touches from the home
            # (memory_pool/cache_writeback.py). On this thread: no step is running.
            self.pool.flush_caches()
        rows, dense = None, None
        if self.log_rows and not self.log_undo:
            # (journaled tiers, one rank: the writer notes the step's rows as the window's, in
            # step order, and at the window's end writes the after-images of all of them)
            rows = self._cur.touched if self._cur is not None else []
        if ends:
            # The dense state's live tensors (and the window's rows): the writer copies them
            # (off this thread's critical path) before the next step's persist() or update()
            # lets anything change them.
            dense = self.dense_state(step)
            carry = {s: w for s, w in self.carry.items() if s > step}
            if carry:
                doc["replay"] = [[s, w] for s, w in sorted(carry.items())]
            self.window_start = step
            self._read.clear()
        if txn is None:
            txn = self.pool.begin(step)
        fut = self._writer.submit(self._write_txn, step, txn, rows, dense, doc)
        self._last_job = fut
        if ends:
            self._inflight = fut
        if wait:
            fut.result()

    def _write_txn(self, step: int, txn: Transaction, rows, dense, doc: dict) -> None:
        cpu0 = time.thread_time()
        try:
            self._append_txn(step, txn, rows, dense, doc)
        finally:
            self.stats.writer_cpu_seconds += time.thread_time() - cpu0

    def _append_txn(self, step: int, txn: Transaction, rows, dense, doc: dict) -> None:
        crash = self.crash if (self.crash is not None and self.crash.at(step, *COMMIT_PHASES)) else None
        n = 0
        if self.log_rows:
            # Journaled tiers: the window's rows, each once, at its end. (One rank: the rows are
            # noted here, step by step; several ranks: the undo job noted them already.)
            if rows is not None:
                self._first.mark(rows)
            rows = self._first.touched_rows() if dense is not None else None
        try:
            if rows:
                self.stats.table_bytes_persisted += txn.rows(rows)
            if dense is not None:
                parts, n = self._packer.pack(dense)
                txn.dense(parts)
            # One write for the rows and the dense state; the live tensors are copied into the
            # DENSE record as it is written: from here on the next step may change them.
            txn.write()
        finally:
            self._read.set()
        if dense is not None:
            # A new window begins after this step: no row is logged in it yet (this job runs
            # before the next step's undo job: one writer thread, in order).
            self._first.reset()
            if crash:
                crash.hit(step, "mid-dense")
        # The commit record: last, and durable (Transaction.commit syncs the records first).
        txn.commit(doc, before_end=(lambda: crash.hit(step, "before-commit")) if crash else None)
        if crash:
            crash.hit(step, "after-commit")
        if dense is None:
            return
        self.stats.checkpoints += 1
        self.stats.last_commit_step = step
        first = txn.first_seq if txn.first_seq is not None else txn.committed.end.seq
        with self._lock:
            self._txn_start[step] = first
            self._txn_end[step] = txn.committed.end.seq
            if len(self._txn_end) > MAX_POINTS_KEPT:   # (the oldest: compacted_through then answers an older point)
                del self._txn_end[min(self._txn_end)]
            self._durable_commit = step
        self.stats.dense_bytes += n
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        if self.pool.compacting:
            return
        if self.journal.live_bytes < self.compact_bytes and not self._compact_soon:
            if self.apply_bytes is not None and self.pool.keeps_applied_mark:
                # Sealed segments worth apply_bytes: their rows into the images' page cache now,
                # so that a crash of the trainer replays only what follows (a no-op otherwise;
                # never on power-sim, whose every crash replays everything).
                self.pool.apply(min_bytes=self.apply_bytes)
            return
        keep = min(self._durable_commit, self._released) if self.coordinator is not None else self._durable_commit
        with self._lock:
            seq = self._txn_start.get(keep)
            for s in [s for s in self._txn_start if s < keep]:
                del self._txn_start[s]
        if seq is not None:
            # (writer thread, between transactions) a new segment first: the one being appended
            # to is never reclaimed, and segments may be larger than the threshold.
            self.journal.rotate()
            self._compact_soon = False
            self.pool.compact(seq, wait=False)

    def compacted_through(self) -> int | None:
        """The newest recovery point of this process whose transaction lies wholly before the
        journal's START: a compaction has put home every row committed up to it (None: none).
        Not the point a compaction was started at: that one's transaction, and the segment it
        shares with older ones, stay in the journal."""
        start = self.journal.start_seq
        with self._lock:
            done = [s for s, end in self._txn_end.items() if end < start]
            if not done:
                return None
            last = max(done)
            for s in done:
                if s < last:
                    del self._txn_end[s]
            return last

    def compact_soon(self) -> None:
        """Start a background compaction at the next recovery point, however little the journal
        holds (the trainer's thread; read on the writer's, after that point's commit). A DRAM
        cache's trim asks for one, and trims once it is over: then it writes home only the rows
        committed since (``dlrm_cxl.lookahead.WorkingCopyBound``)."""
        self._compact_soon = True

    def _release(self, ends: bool) -> None:
        """At a window's end, the next window's length (on this thread: the schedule is the
        trainer's, not the writer's timing). With several ranks: the newest step committed
        everywhere (a collective call, made by every rank at every commit), and the next
        window's length is another (every rank ends a window at the same step)."""
        if self.coordinator is not None:
            self._released = self.coordinator.global_min(self._durable_commit)
        if ends:
            self.policy.next_window()

    def checkpoint_now(self, step: int) -> None:
        """Make ``step`` a recovery point and wait for it (start of training, tests, abort)."""
        self._submit(step, None, True, commit_doc(step), wait=True)
        if self.coordinator is not None:
            self._released = self.coordinator.global_min(self._durable_commit)

    def _wait_read(self) -> None:
        """The newest commit's after-images and dense state are read in place by the writer
        thread: wait until they have been copied before anything changes them. The wait is a
        step's compute long, so it is almost never felt (counted as commit wait)."""
        job = self._last_job  # (the event is cleared only for a job that reads in place)
        if job is None or self._read.is_set():
            return
        t0 = time.perf_counter()
        self.stats.commit_waits += 1
        while not self._read.wait(0.05) and not job.done():
            pass  # (the event is set in a finally; this only guards a job that never ran)
        self.stats.commit_wait_seconds += time.perf_counter() - t0
        if job.done() and job.exception() is not None:
            raise job.exception()

    def drain(self) -> None:
        """Wait for the background work: the transaction in flight and a running compaction."""
        if self._last_job is not None:
            self._last_job.result()
        self.pool.wait_compaction()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.drain()
            # A compaction skipped while another ran leaves the journal past its threshold: do
            # it now, so a closed pool's journal is bounded (and the next open replays little).
            self._writer.submit(self._maybe_compact).result()
            self.pool.wait_compaction()
        finally:
            self._writer.shutdown(wait=True)


class _Inline:
    """An executor that runs each job at once, on the caller's thread, with torch's ops on that
    thread alone while it does (as on the writer's own thread: ``memory_pool.intra_op_threads``
    says why that is faster for these copies on a machine without a spare core)."""

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        try:
            with intra_op_threads(1):
                fut.set_result(fn(*args))
        except BaseException as exc:  # (delivered through the future, as a thread's would be)
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        pass


class _Later:
    """An inline writer's job run when it is first waited for (``persist``, the write-ahead
    barrier), not when it is handed over; never, when the step fails before it (no row changed:
    nothing to log). The part of a :class:`~concurrent.futures.Future` the checkpointer uses."""

    def __init__(self, writer: _Inline, fn, *args):
        self._job = (fn, args)
        self._writer = writer
        self._fut: Future | None = None

    def start(self) -> Future:
        if self._fut is None:
            fn, args = self._job
            self._fut = self._writer.submit(fn, *args)
        return self._fut

    def result(self):
        return self.start().result()

    def done(self) -> bool:
        return self._fut is not None and self._fut.done()

    def exception(self):
        return self._fut.exception() if self._fut is not None else None
