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
  reads them), appends them as ``UNDO`` records and syncs; ``persist`` waits for that. Recovery
  rolls back the ``UNDO`` records after the last commit.
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

``commit(k)`` hands the transaction ``[ROWS] DENSE END(k)`` to the writer thread with the rows
the step changed and the dense state's live tensors; the writer gathers the rows' after-images,
packs the tensors (raw bytes, no pickle), appends the transaction and makes it durable with one
group commit (records synced, then the ``END``). The next step's ``persist`` (before the fused
backward changes rows) and ``update`` (the dense optimizer step) wait until they are copied, so
the trainer's thread copies neither rows nor dense state. Pipelining, not skipping: step ``k+1``
computes while ``k`` becomes durable; ``commit(k+1)`` waits only if ``k`` is still not durable
then (``commit_wait_seconds``). So a crash loses at most the step in flight and the one before
it. ``--dense-every N > 1`` makes every N-th step a recovery point instead (fewer dense bytes;
a crash loses up to N steps); the rows are still logged every step.

The journal is kept short: once a commit is durable, segments before the newest recovery point
(before the newest step every rank committed, with several ranks) are compacted into the table
images in the background and dropped.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from memory_pool import MemoryPool
from memory_pool.records import Fill, encode_logged_mark, encode_row_set
from memory_pool.segment_format import RecordType
from memory_pool.threads import one_intra_op_thread
from memory_pool.validation import env_mib

from .base import Checkpointer, CheckpointStats, Step, Touched
from .crash import COMMIT_PHASES, CrashPlan
from .store import RUNNING_MARKER, DensePacker, ckpt_dir, commit_doc, is_commit

__all__ = ["UndoLogCheckpointer", "RUNNING_MARKER", "DenseStateFn", "Step", "default_compact_bytes",
           "default_apply_bytes"]

# step -> dense state. Its tensors may be live: the writer thread packs them while the next step
# computes, so they may change only inside ``update(fn)`` (which first waits for that).
DenseStateFn = Callable[[int], dict]


def default_compact_bytes(pool: MemoryPool) -> int:
    """Journal size that triggers a compaction. Journaled tiers: large enough that the write-back
    of scattered rows (page-granular in the image) is amortised over many steps, small enough
    that replaying it at open stays around a second. Direct tiers hold only undo records and
    dense states (in RAM on shm): small."""
    env = env_mib("DLRM_CXL_COMPACT_MB")
    if env is not None:
        return env
    if not pool.journaled:
        return 128 << 20
    # Measured on `small` (tools/bench_cli.py, 300 steps, 8.1 MB durable per step): compacting
    # every 256 MiB wrote 7.3 MB of image pages per step (write amplification 1.9); every 1 GiB
    # amortises the page-granular write-back of the rows over ~125 steps (WA ~1.2). Replay at open
    # reads at most this much journal (about half of it rows).
    return 1 << 30


def default_apply_bytes(compact_bytes: int, table_bytes: int) -> int | None:
    """Sealed journal bytes written back into the images' page cache at a time, between
    compactions (journaled tiers; see ``MemoryPool.apply``): with the segment being written, what
    a crash of the trainer leaves to replay. A quarter of a compaction: on `kaggle` that bounds
    the replay to ~0.3 GiB of journal (0.5-0.8 s to recover, against 1.2 s for 1 GiB). Fewer,
    larger passes cost less: each pass copies every row version it holds (no coalescing across
    passes) and faults in the pages it touches (`kaggle`: WA 2.85 -> 3.06 with passes every
    256 MiB, the write-back debt counted).

    None (no pass between compactions) when the tables are no larger than twice the compaction
    threshold: a replay then faults in at most every page of the tables (`small`: 650 MB, 160k
    pages, ~0.3 s), whatever the journal holds, and passes would only cost CPU (measured on
    `small`: pmem undo 0.90x -> 0.78x of none with passes every 256 MiB). ``DLRM_CXL_APPLY_MB``
    overrides."""
    env = env_mib("DLRM_CXL_APPLY_MB")
    if env is not None:
        return env
    if table_bytes <= 2 * compact_bytes:
        return None
    return max(1, compact_bytes // 4)


class UndoLogCheckpointer(Checkpointer):
    """See the module docstring."""

    name = "undo"

    def __init__(self, pool: MemoryPool, dense_state: DenseStateFn, *, dense_every: int = 1,
                 crash: CrashPlan | None = None, coordinator=None, inline: bool = False):
        """``coordinator`` (several ranks): has ``global_min(int) -> int`` over all ranks. With
        one, recovery points follow a fixed schedule (every ``dense_every`` steps) so every rank
        has one at the same steps, and journal records are kept back to the newest step that
        *every* rank committed. ``inline``: the writer's work runs on the caller's thread when it
        is handed over (no pipelining; for measuring the checkpointer's own CPU cost)."""
        if dense_every < 1:
            raise ValueError(f"dense_every must be >= 1, got {dense_every}")
        self.pool = pool
        self.journal = pool.journal
        self.dense_state = dense_state
        self.dense_every = dense_every
        self.crash = crash
        self.coordinator = coordinator
        self.log_undo = not pool.journaled or coordinator is not None
        self.log_rows = pool.journaled
        # The logged mark (see the module docstring): where a step's rows change in place on the
        # surviving medium, i.e. where UNDO records are what recovery restores them from.
        self.log_mark = self.log_undo and not pool.journaled
        self.stats = CheckpointStats()
        self.compact_bytes = default_compact_bytes(pool)
        self.apply_bytes = default_apply_bytes(self.compact_bytes, pool.used_bytes())
        self._packer = DensePacker()
        self._read = threading.Event()   # the writer has copied what the newest commit reads in place
        self._read.set()
        self._writer = _Inline() if inline else ThreadPoolExecutor(1, thread_name_prefix="journal-writer",
                                                                   initializer=one_intra_op_thread)
        self._inflight: Future | None = None    # the newest recovery point handed over
        self._last_job: Future | None = None    # the newest transaction part handed over
        self._cur: Step | None = None
        commits = [t for t in self.journal.txns if is_commit(t)]
        self._durable_commit = commits[-1].tag if commits else -1
        self._last_submitted = self._durable_commit
        self._released = self._durable_commit
        self._txn_start: dict[int, int] = {t.tag: t.first_seq for t in commits[-4:]}
        self._pending_start: int | None = None   # first seq of the open transaction
        self._lock = threading.Lock()
        self._broken: str | None = None
        # Reusable gather buffers for the before-images of a journal written directly (not
        # mapped): step k's (kept until its commit, for abort) and step k+1's.
        self._bufs = {i: {} for i in (0, 1)}
        self._closed = False
        ckpt_dir(pool.storage_dir).mkdir(parents=True, exist_ok=True)

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
        if self.crash is not None:
            self.crash.arm_random(step)

    def log_before_image(self, touched: Touched) -> None:
        t0 = time.perf_counter()
        cur = self._cur
        self.hit("before-log")
        cur.touched = list(touched)
        if self.log_undo:
            # Nothing on the trainer's thread: the writer thread copies the rows' current values
            # (the step's before-images), appends and syncs them while the forward runs. No
            # row changes before persist() has waited for that.
            cur.gathered = Future()
            cur.undo = self._writer.submit(self._write_undo, cur, self._bufs[cur.k % 2])
        else:
            self.hit("mid-log")
        self.stats.critical_seconds += time.perf_counter() - t0

    def before_images(self) -> dict[str, torch.Tensor] | None:
        cur = self._cur
        if cur is None or cur.gathered is None:
            return None
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
        j = self.journal
        # The step's undo group: the sequence number of its first UNDO record. The writer
        # thread is the journal's only appender while a checkpointer trains (one writer, see
        # memory_pool.journal), so that is the next one.
        group = j.next_seq if self.log_mark else None
        mark = None
        try:
            gathers = self.pool.row_gathers(cur.touched)
            if j.mapped:
                # Copied from the tables straight into the journal's mapping (no buffer, and one
                # 4 MB copy less per `small` step); the before-images are views of the records,
                # which stay where they are until a compaction after this step's commit.
                groups: list = [None] * len(gathers)
                recs = _gather_records(RecordType.UNDO, k, cur.touched, gathers, groups, undo_group=group)
            else:
                # (A direct write's buffer is reused by the next append: the before-images, kept
                # until this step commits, are gathered into this step's own buffers first.)
                groups = self.pool.copy_row_gathers(gathers, buffers=bufs)
                recs = [(RecordType.UNDO, k, encode_row_set(tables, rows, undo_group=group))
                        for tables, rows in _row_sets(cur.touched, groups)]
            if self.log_mark:
                mark = (RecordType.LOGGED, k, encode_logged_mark(group, len(recs)))
            # Where the journal is never synced (shm, dram: a store into its shared mapping is
            # all the durability there is, and a crash of the process keeps the stores made
            # before it in program order), the mark rides in the records' own write, last: the
            # journal stores each payload before its header, so the mark's header is the last
            # store, and a valid mark implies that every UNDO byte before it was stored. Where a
            # sync is what makes bytes durable, a write's blocks may reach the media in any
            # order until it returns: the mark goes after the records' sync (below).
            same_write = mark is not None and not j.sync
            half = len(recs) // 2
            if self.crash is not None and self.crash.at(k, "mid-log"):
                for ref in j.append_many(recs[:half]):
                    self._note_start(ref)
                j.flush()
                self.crash.hit(k, "mid-log")
                recs = recs[half:]
            for ref in j.append_many(recs + [mark] if same_write else recs):
                self._note_start(ref)
        except BaseException as exc:
            # (the trainer's thread may be waiting for the before-images: it gets the cause)
            cur.gathered.set_exception(exc)
            raise
        cur.before = self.pool.rows_per_pair(cur.touched, groups)
        cur.gathered.set_result(cur.before)
        # Write-ahead rule: durable before any row it covers changes in place.
        j.flush()
        if mark is not None and not same_write:
            # The mark only once the records' sync has returned (a mark that could outlive
            # records torn by a power loss would make recovery refuse a step that never changed
            # a row), and durable itself before persist() lets a row change (a step whose rows
            # changed without a durable mark would have a bad record taken for a torn tail).
            j.append_many([mark])
            j.flush()
        n = _payload_bytes(gathers)
        self.stats.log_bytes += n
        return n

    def _note_start(self, ref) -> None:
        if self._pending_start is None:
            self._pending_start = ref.seq

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
        if cur.updated and cur.before is not None:
            for (t, rows), b in zip(cur.touched, cur.before):
                t.scatter_rows(rows, b)
            if self.pool.real_pmem:
                self.pool.persist_rows([(t, rows) for t, rows in cur.touched])
        elif cur.updated:
            # A journaled tier keeps no before-images: the changed rows live only in this
            # process's working copy and never reach durable media. The pool on media is at the
            # last commit; this process must not train on: every later step refuses.
            self._broken = f"step {cur.k} failed after changing rows in memory"
        self._cur = None
        if self.coordinator is None and not self._broken:
            self.checkpoint_now(cur.k - 1)

    def commit(self, step: int, *, final: bool = False) -> None:
        t0 = time.perf_counter()
        cur = self._cur
        self.stats.steps += 1
        crash_here = self.crash is not None and self.crash.at(step, *COMMIT_PHASES)
        if self.coordinator is None:
            due = final or crash_here or step - self._last_submitted >= self.dense_every
        else:
            due = final or step % self.dense_every == 0
        # The step's after-images and the dense state's live tensors: the writer thread copies
        # them (off this thread's critical path) before the next step's persist() or update()
        # lets anything change them (_wait_read).
        rows = cur.touched if self.log_rows and cur is not None and cur.touched else None
        dense = self.dense_state(step) if due else None
        self._submit(step, rows, dense, wait=final or crash_here)
        self._release()
        self.stats.max_commit_lag = max(self.stats.max_commit_lag, step - max(self._durable_commit, 0))
        self.stats.critical_seconds += time.perf_counter() - t0
        self._cur = None

    def _submit(self, step: int, rows, dense, *, wait: bool) -> None:
        # Pipeline depth one: whatever was handed over for the previous step must be written
        # (and, for a recovery point, durable) before this step's is handed over. So a crash
        # loses at most the step in flight and the one before it (with --dense-every N, the
        # steps since the previous recovery point and one more), and the writer never lags a
        # step behind: the double-buffered after-images it is writing are never overwritten.
        if self._last_job is not None:
            t0 = time.perf_counter()
            self._last_job.result()
            self.stats.commit_wait_seconds += time.perf_counter() - t0
        if dense is not None:
            self._last_submitted = step
        if rows is not None or dense is not None:
            self._read.clear()
        fut = self._writer.submit(self._write_txn, step, rows, dense)
        self._last_job = fut
        if dense is not None:
            self._inflight = fut
        if wait:
            fut.result()

    def _write_txn(self, step: int, touched, dense) -> None:
        cpu0 = time.thread_time()
        try:
            self._append_txn(step, touched, dense)
        finally:
            self.stats.writer_cpu_seconds += time.thread_time() - cpu0

    def _append_txn(self, step: int, touched, dense) -> None:
        crash = self.crash if (self.crash is not None and self.crash.at(step, *COMMIT_PHASES)) else None
        j = self.journal
        rows = None
        try:
            recs = []
            if touched:
                # The after-images, copied from the tables straight to where the records are
                # written (the mapping, or a direct write's buffer).
                gathers = self.pool.row_gathers(touched)
                recs = _gather_records(RecordType.ROWS, step, touched, gathers)
                rows = _payload_bytes(gathers)
            if dense is not None:
                parts, n = self._packer.pack(dense)
                recs.append((RecordType.DENSE, step, parts))
            # One write for the rows and the dense state; the live tensors are copied into the
            # DENSE record as it is written: from here on the next step may change them.
            refs = j.append_many(recs) if recs else []
        finally:
            self._read.set()
        for ref in refs:
            self._note_start(ref)
        if rows:
            self.stats.table_bytes_persisted += rows
        if dense is None:
            return
        if crash:
            crash.hit(step, "mid-dense")
        j.flush()
        if crash:
            crash.hit(step, "before-commit")
        txn = j.end(step, commit_doc(step))  # the commit record: last, and durable
        if crash:
            crash.hit(step, "after-commit")
        with self._lock:
            self._txn_start[step] = self._pending_start if self._pending_start is not None else txn.first_seq
            self._pending_start = None
            self._durable_commit = step
        self.stats.dense_bytes += n
        self.stats.checkpoints += 1
        self.stats.last_commit_step = step
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        if self.pool.compacting:
            return
        if self.journal.live_bytes < self.compact_bytes:
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
            self.pool.compact(seq, wait=False)

    def _release(self) -> None:
        """With several ranks: the newest step committed everywhere (a collective call, made by
        every rank at every commit)."""
        if self.coordinator is not None:
            self._released = self.coordinator.global_min(self._durable_commit)

    def checkpoint_now(self, step: int) -> None:
        """Make ``step`` a recovery point and wait for it (start of training, tests, abort)."""
        self._submit(step, None, self.dense_state(step), wait=True)
        self._release()

    def _wait_read(self) -> None:
        """The newest commit's after-images and dense state are read in place by the writer
        thread: wait until they have been copied before anything changes them. The wait is a
        step's compute long, so it is almost never felt (counted as commit wait)."""
        job = self._last_job  # (the event is cleared only for a job that reads in place)
        if job is None or self._read.is_set():
            return
        t0 = time.perf_counter()
        while not self._read.wait(0.05) and not job.done():
            pass  # (the event is set in a finally; this only guards a job that never ran)
        self.stats.commit_wait_seconds += time.perf_counter() - t0
        if job.done() and job.exception() is not None:
            raise job.exception()

    def drain(self) -> None:
        """Wait for the background work: the transaction in flight and a running compaction."""
        if self._inflight is not None:
            self._inflight.result()
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
    """An executor that runs each job at once, on the caller's thread."""

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # (delivered through the future, as a thread's would be)
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        pass


def _gather_records(rtype: int, step: int, touched: list, gathers: list, out: list | None = None, *,
                    undo_group: int | None = None) -> list:
    """One journal record per :class:`~memory_pool.pool.RowGather`, whose rows are copied from
    the tables straight to where the record is written. ``out[i]``: set to ``(pair indexes,
    the rows as written)`` (a view of the record) as group ``i`` is copied. ``undo_group``: see
    :func:`memory_pool.records.encode_row_set`."""
    recs = []
    for i, g in enumerate(gathers):
        tables = [(touched[j][0].name, touched[j][1]) for j in g.idx]
        if not g.rows:
            if out is not None:
                out[i] = (g.idx, g.src[:0])
            recs.append((rtype, step, encode_row_set(tables, g.src[:0], undo_group=undo_group)))
            continue

        def fill(dest, g=g, i=i) -> None:
            rows = g.into(torch.from_numpy(dest).view(g.dtype).view(g.rows, -1))
            if out is not None:
                out[i] = (g.idx, rows)

        recs.append((rtype, step, encode_row_set(tables, Fill(g.rows * g.row_bytes, fill), g.row_bytes,
                                                 undo_group=undo_group)))
    return recs


def _payload_bytes(gathers: list) -> int:
    """The bytes of row records that matter (rows and their ids) for ``gathers``."""
    return sum(g.rows * (g.row_bytes + 8) for g in gathers)


def _row_sets(touched: list, groups: list) -> list:
    """One journal record per gathered group: ``[([(table name, ids)], rows)]``."""
    return [([(touched[i][0].name, touched[i][1]) for i in idx], rows) for idx, rows in groups]
