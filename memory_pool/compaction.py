"""Compaction: the journal's committed rows written back into the table images, made durable,
and the journal's segments dropped -- one object, :class:`Compaction`, that owns its state.

Its state: how far the images' page cache is up to date (the applied position, and the applied
mark that vouches for it on emulated pmem: :class:`~memory_pool.persistence.AppliedMark`), the
tables written back since their last fdatasync, the reset markers of bulk loads, the row overlay
(memory_pool/overlay.py) and the lock a bulk load into an image holds. Its jobs run one at a
time on the compactor's thread (:class:`~memory_pool.persistence.Compactor`), or inline.

The order of a compaction (:meth:`Compaction.compact`), SQLite's rule: the commit marker last,
and durably:

1. write-back: the ROWS of the window's records, newest value per row, into the images (with a
   row overlay: the dense pages home, the other rows into its new run);
2. sync: the images written since their last good fdatasync, fdatasync'ed (and the new run);
3. run and manifest: with an overlay, the manifest names the new run (the pool's header says
   format version 3 before the first one);
4. START: the journal's START moves past the window (``Journal.reclaim``), and the rows an
   on-demand replay has not applied yet are applied first, while their segments still exist;
5. unlink: the window's segments and the cleaned runs' files go.

Between compactions, :meth:`Compaction.apply` writes the sealed segments back as they are sealed,
unsynced, and moves the applied mark after them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch
from typing import Callable

from .journal import Journal, RecordType
from .overlay import DEFAULT_BOUND, DENSE_FRACTION, RUNS_DIR, Overlay
from .record_heads import RecordHeads
from .persistence import AppliedMark, Compactor, absorb_rows, table_resets
from .table import PoolStats, Table
from .validation import env_mib

__all__ = ["Compaction", "OVERLAY_FROM_BYTES"]

# A journaled pool whose tables hold more than this keeps a row overlay (memory_pool/overlay.py)
# of DEFAULT_BOUND bytes: there most rows a compaction writes back are alone in their page
# (`kaggle`); below it most pages a compaction writes are dense anyway (`small`: WA 1.18 in
# place). DLRM_CXL_RUNS_MB overrides the bound (0: none; a pool that has runs then writes them
# all home at its next compaction).
OVERLAY_FROM_BYTES = 2 << 30


class Compaction:
    """A pool's compactions and write-back passes, and the state they keep (see the module).

    ``tables``: the pool's tables by name (the pool's own dict: tables created later are in it);
    ``mark``: the applied mark (emulated pmem), or None; ``has_runs``: the pool has a row
    overlay's manifest (then every journal row is replayed at the open); ``table_names``: the
    tables of the header; ``apply_pending(chunk=, runs=)``: apply the rows an on-demand replay
    has not applied yet (memory_pool/replay.py); ``runs_format()``: write format version 3 into
    the pool's header unless it says so already. The tables' ``save_fresh()``
    (``TableSet.save_fresh``) is called before the journal's START or the applied mark moves
    past records whose rows the next open would then not clear (memory_pool/fresh.py)."""

    def __init__(self, journal: Journal, tables: dict[str, Table], stats: PoolStats, *, storage_dir: Path,
                 journaled: bool, rows: bool, mark: AppliedMark | None, has_runs: bool, table_names: list[str],
                 apply_pending: Callable[..., None], runs_format: Callable[[], None]):
        self.journal = journal
        self._tables = tables
        self.stats = stats
        self._storage_dir = storage_dir
        self._journaled = journaled
        self._rows = rows
        self._apply_pending = apply_pending
        self._runs_format = runs_format
        self._overlay: Overlay | None = None   # the row overlay's runs (the replay at open attaches it)
        # Held by a compaction or a write-back pass for as long as it runs (on the compactor's
        # thread, or inline), and by a bulk load (Table.load_, fill_) from before it forgets the
        # table's pending rows until its reset is committed: see images_held.
        self._image_lock = threading.RLock()
        self._compactor = Compactor()
        # A background compaction is only reading its journal in (JournalReader.preread): no
        # CPU of its own, so the steps keep every intra-op thread (computing, dlrm_cxl/cores.py).
        self.reading = False
        self._mark = mark
        # (With runs, every journal row is replayed: a row below the mark that the images'
        # page cache holds may have an older value in a run, which would win over the image.)
        self.since = 0 if has_runs else ((self._mark.read() if self._mark is not None else None) or 0)
        # Every ROWS record below this is in the images' page cache (a compaction, or an
        # apply, wrote it there); those above are only in the journal (and this process).
        self._applied = max(self.since, journal.start_seq)
        self._unsynced: set[str] = set()   # tables written back since their last fdatasync
        self._bounded: set[str] = set()    # tables behind a DRAM cache (bound): see _write_back
        if self.since > journal.start_seq:
            # Trusting the mark means trusting rows that an earlier process wrote into the
            # images' page cache and never synced: the next compaction, which drops their
            # journal records, must fdatasync those images too, not only the ones it writes.
            self._unsynced = set(table_names)
        # The journal's reset markers (bulk loads): a table's older rows no longer count.
        self.resets = table_resets(journal) if journaled else {}
        # Rows a refresh wrote into the images, newest as of a sequence number: [(seq, {table:
        # sorted rows})]. A write-back pass of older records skips them (see refresh()).
        self._refreshed: list[tuple[int, dict]] = []
        if self._wants_overlay:
            self._keep_heads()

    @property
    def _wants_overlay(self) -> bool:
        """Whether the pool keeps a row overlay once a compaction runs (a journaled tier whose
        rows are replayed, with a bound: :attr:`overlay_bound`)."""
        return self._journaled and self._rows and bool(self.overlay_bound)

    @property
    def overlay(self) -> Overlay | None:
        """The row overlay a compaction writes through (None: none yet). Setting one also has
        the journal keep its row records' heads (:meth:`_keep_heads`)."""
        return self._overlay

    @overlay.setter
    def overlay(self, ov: Overlay | None) -> None:
        self._overlay = ov
        if ov is not None:
            self._keep_heads()

    def _keep_heads(self) -> None:
        """A compaction through the row overlay reads each record's ids first (memory_pool/
        newest.py): from now on the journal keeps them as it writes them instead (memory_pool/
        record_heads.py). Called once the pool keeps or will keep an overlay."""
        j = self.journal
        if j.heads is None and not j.mapped and not j.read_only:
            j.heads = RecordHeads()

    # -- the compactor's thread
    @property
    def running(self) -> bool:
        return self._compactor.running

    @property
    def computing(self) -> bool:
        """A background compaction runs and is past reading its journal in."""
        return self._compactor.running and not self.reading

    def check(self) -> None:
        """Raise the error of a background job that failed, once (typed: see ``Compactor.check``).
        The checkpointer looks after every commit (``MemoryPool.compacting``), on the journal
        writer's thread, whose error reaches the trainer at its next commit -- a failure nobody
        looked at let the journal grow until the disk filled."""
        self._compactor.check()

    def wait(self) -> None:
        """Wait for a background compaction, if one is running (and raise its error)."""
        self._compactor.wait()

    def run(self, fn: Callable[[], None], *, wait: bool) -> Future | None:
        """Run ``fn`` on the compactor (``Compactor.run``)."""
        return self._compactor.run(fn, wait=wait)

    def close(self) -> None:
        """Wait for a running job and stop the thread; close the overlay."""
        self._compactor.shutdown()
        if self.overlay is not None:
            self.overlay.close()
            self.overlay = None

    # -- compaction
    def compact(self, before_seq: int | None = None, *, wait: bool = True) -> Future | None:
        """Write journal segments back into the table images and drop them: every segment
        whose records all precede ``before_seq`` (default: every complete segment). With
        ``wait=False`` it runs on a background thread (one at a time; None if one is running)."""
        if before_seq is None:
            self.journal.rotate()
        seq = self.journal.next_seq if before_seq is None else before_seq

        def absorb(refs):
            # The fresh rows' file first (memory_pool/fresh.py): the next open clears the rows of
            # the records after START, and START moves past these once this returns; every row
            # they hold was cleared in memory before it changed. (Not in a trim's _absorb: it
            # moves no START.)
            self._tables.save_fresh()
            self._absorb(refs, preread=not wait)   # (in the background: the journal read in first)

        def run():
            t0, c0 = time.perf_counter(), time.thread_time()
            with self._image_lock:  # (never beside a bulk load into an image: images_held)
                self.stats.bytes_compacted += self.journal.reclaim(seq, absorb if self._journaled else None)
                if self.overlay is not None:
                    self.overlay.finish()  # (after START moved: the cleaned runs' files go)
                if self._journaled and self.journal.start_seq > self._applied:
                    self._applied = self.journal.start_seq
                    self._vouch()
            self.stats.compactions += 1
            self.stats.compact_seconds += time.perf_counter() - t0
            self.stats.compact_cpu_seconds += time.thread_time() - c0

        return self._compactor.run(run, wait=wait)

    def _absorb(self, refs, *, preread: bool = False, trim: bool = False) -> None:
        """Write the ROWS of ``refs`` home and make them durable (the compactor's thread, the
        images held): a compaction's ``absorb``, or a trim's behind a DRAM cache (``trim``:
        ``refs`` are every committed record, and nothing reads rows meanwhile)."""
        # Most segments were written back already, one by one as they were sealed (apply):
        # what is left of them is only made durable here. With a row overlay, the order of
        # memory_pool/overlay.py: the dense pages home and the new run written, both synced,
        # then the manifest; the journal's START moves after this returns (reclaim).
        ov = self._compaction_overlay()
        try:
            if ov is not None:
                bound = self.overlay_bound
                ov.begin()
                # (a bound of 0 empties the overlay: every page goes home)
                self._write_back(refs, overlay=ov, dense=0.0 if bound == 0 else DENSE_FRACTION, preread=preread)
                ov.clean(bound)
                self.stats.bytes_to_runs += ov.write()
                self._unsynced |= ov.tables_home
            else:
                self._write_back(refs, preread=preread)
            self._sync_images()
            if ov is not None and ov.changed:
                # Before the first manifest: a dlrm-cxl that knows no runs refuses the
                # pool instead of reading images that no longer hold every row.
                self._runs_format()
                ov.commit()
            if ov is not None:
                self.stats.bytes_written_back += ov.written_home
        except BaseException as exc:
            if ov is not None:
                ov.fail(exc)
            raise
        # Rows replayed on demand that no step has needed yet point into segments about to
        # be dropped (or reused): apply them now, while the write-back has their image pages
        # in the page cache. In chunks: a step that needs rows meanwhile waits for one.
        # (Rows pending from runs stay pending: their runs are kept, see Overlay.finish.)
        # A trim through the overlay has just put every one of them in the new run or home,
        # and maps the working copy afresh next: they become pending from there instead.
        self._apply_pending(chunk=1 << 16, runs=False, hand_over=trim and ov is not None)

    def _absorb_committed(self) -> None:
        """A trim's compaction through the row overlay: every committed journal row home or
        into a run, durably (:meth:`_absorb`), the journal kept whole -- its START is the
        checkpointer's to move, which keeps its newest recovery point's transaction there (a
        trim that dropped it left a pool that no longer knew its step: found by
        ``tools/torture.py --dram-cache``). The rows stay in the journal too, newer or equal: a
        reopen replays them over the runs, and the next compaction writes them again."""
        t0, c0 = time.perf_counter(), time.thread_time()
        with self._image_lock:  # (never beside a bulk load into an image: images_held)
            refs, upto = self.journal.sealed_refs(self.journal.start_seq)
            if upto is not None:
                self._absorb(refs, trim=True)
                if self.overlay is not None:
                    self.overlay.finish()  # (the manifest no longer names the cleaned runs)
        self.stats.compact_seconds += time.perf_counter() - t0
        self.stats.compact_cpu_seconds += time.thread_time() - c0

    @property
    def keeps_applied_mark(self) -> bool:
        """Opening after a crash of the trainer trusts the images' page cache (emulated pmem):
        write-back passes between compactions (:meth:`apply`) shorten its replay. Not on
        ``power-sim``, which replays everything as after a power loss."""
        return self._mark is not None

    def apply(self, *, min_bytes: int = 1, wait: bool = False) -> Future | None:
        """Write the rows of the sealed journal segments not yet written back into the table
        images, unsynced (their page cache), and move the applied mark after them: after a crash
        of the trainer, opening the pool replays only what follows (see :class:`AppliedMark`).
        A compaction later only makes them durable and drops the segments. Nothing to do until
        such segments hold ``min_bytes``. One job at a time on the compactor's thread (None:
        one is running, or there is nothing to do); journaled tiers only."""
        if not self._journaled or self.journal.sealed_bytes(self._applied) < max(1, min_bytes):
            return None
        if self.overlay is not None or self.overlay_bound:
            # (Rows written into the images' page cache reach the disk a page each: what the
            # overlay exists to avoid; and with runs every open replays the whole journal.)
            return None

        def run():
            t0, c0 = time.perf_counter(), time.thread_time()
            with self._image_lock:  # (never beside a bulk load into an image: images_held)
                refs, upto = self.journal.sealed_refs(self._applied)
                if upto is None:
                    return
                self._write_back(refs, coalesce=False)
                self._applied = upto
                self._tables.save_fresh()  # (before the mark moves past these records: see compact)
                self._vouch()
            self.stats.applies += 1
            self.stats.compact_seconds += time.perf_counter() - t0
            self.stats.compact_cpu_seconds += time.thread_time() - c0

        return self._compactor.run(run, wait=wait)

    @contextlib.contextmanager
    def _reading(self):
        """(A background compaction's) the block reads its journal in -- the pre-read, or the
        first pass of memory_pool/newest.py: mostly device waits (~0.5 s for `kaggle`'s GiB) --
        so it counts as :attr:`reading`, not computing, timed in ``preread_seconds``."""
        t0, self.reading = time.perf_counter(), True
        try:
            yield
        finally:
            self.reading = False
            self.stats.preread_seconds += time.perf_counter() - t0

    # (compactor thread only, or inline while none runs: _applied and _unsynced are its state)
    def _write_back(self, refs, *, coalesce: bool = True, overlay: Overlay | None = None,
                    dense: float = DENSE_FRACTION, preread: bool = False) -> None:
        """Write the ROWS records of ``refs`` that are not written back yet into the images (with
        an ``overlay``: all of them, which it writes home or keeps in its new run). ``preread``:
        read their pages in first (a background compaction, see :attr:`reading`)."""
        since = self._applied if overlay is None else 0
        pending = [r for r in refs if r.type == RecordType.ROWS and r.seq >= since]
        # (a refresh's entry matters while records below it may still be written back: apply
        # passes, record after record; and compactions, which write each row's newest record
        # *among the segments they drop* -- older than a refresh's value where that came from a
        # segment kept: absorb_rows treats such rows as home already.)
        self._refreshed = [e for e in self._refreshed if e[0] > self.journal.start_seq]
        if pending and preread and overlay is None:  # (an overlay's compaction reads direct: memory_pool/newest.py)
            # The records' pages in first, before this counts as computing (Compaction.computing):
            # ~0.6 s of device reads for `kaggle`'s 1 GiB, during which the steps ran on one
            # intra-op thread fewer for nothing.
            with self._reading():
                self.stats.bytes_preread += self.journal.preread(pending)
        if pending:
            written = absorb_rows(self.journal, self._tables, pending, self.stats, coalesce=coalesce,
                                  overlay=overlay, dense=dense, resets=self.resets, superseded=self._refreshed,
                                  reading=self._reading if preread else None)
            self._unsynced |= written
            # (absorb_rows' views of the segments are gone: their pages can go too)
            self.journal.forget_read(pending)
            # Tables behind a DRAM cache: the image pages just written are counted in its budget,
            # but dirty and mapped they cannot be dropped, and they piled up pass after pass
            # (2.3 GB of image pages behind `kaggle`'s 2.2 GB budget). The mapping goes, and they
            # are written out and dropped here, on this thread, not by a refresh on the trainer's
            # (FileRegion.trim: it only reclaims clean pages). Not durable yet: the compaction's
            # fdatasync is what counts (_sync_images), and it drops the pages too.
            for name in written & self._bounded:
                r = self._tables[name].region
                r.unmap_home()
                if not r.keep_cached:  # (a home kept in memory on purpose: dlrm_cxl.fused.bind_cached)
                    r.drop_cache(write_out=True)

    @property
    def overlay_bound(self) -> int:
        """Bytes of runs the row overlay keeps (memory_pool/overlay.py); 0: no overlay. A pool
        with tables behind a DRAM cache keeps one whatever its size (see :meth:`bound`)."""
        env = env_mib("DLRM_CXL_RUNS_MB")
        if env is not None:
            return env
        used = sum(t.config.nbytes for t in self._tables.values())
        return DEFAULT_BOUND if self._journaled and (used > OVERLAY_FROM_BYTES or self._bounded) else 0

    def bound(self, regions) -> None:
        """``regions`` (tables behind a DRAM cache) are read a few rows at a time: no readahead
        (``FileRegion.read_randomly``). From now on the pool keeps a row overlay (unless
        ``DLRM_CXL_RUNS_MB=0``): a home larger than DRAM is mostly pages not cached, and a row
        written back in place costs a read and a write of its page (on `kaggle` behind a
        quarter budget the write-back passes took 8.4 s of CPU in 240 steps, and a trim 4 s);
        in a run it costs its bytes, written in order. :meth:`trim` and :meth:`refresh` work
        with it: what they give back of a run's rows is read from the run again
        (``Overlay.repend``). Its index (``Overlay.where``, a byte a row) is anonymous memory the
        DRAM budget's measurement counts (``RssAnon``), not taken out of the arena's share."""
        for r in regions:
            r.read_randomly()
        self._bounded |= {n for n, t in self._tables.items() if any(t.region is r for r in regions)}
        if self._wants_overlay:
            self._keep_heads()

    def trim(self, regions) -> bool:
        """Give back what this process holds of ``regions`` on a journaled tier: the working
        copy's copy-on-write pages (anonymous memory, else held until the pool is closed) and
        the images' clean page cache. Every committed journal row is written into the images'
        page cache (an :meth:`apply` pass over every segment, the one being written sealed
        first), then each image is mapped afresh (``FileRegion.trim``).

        Call order (``MemoryPool.trim_working_copy``): only at a recovery point with nothing in
        flight -- the checkpointer drained -- so that every change of the working copy is in a
        committed transaction: the fresh mappings then read the same values (a reader on another
        thread, the DRAM cache's prefetch, reads the same bytes before and after). False, and
        nothing done, on a tier that is not journaled.

        With a row overlay (:meth:`bound`) the committed rows go where a compaction puts them
        -- the dense pages home, the other rows into a packed run -- not each into its image
        page (:meth:`_absorb_committed`, inline, the journal kept), then the images are mapped
        afresh and the rows whose newest value is a run's are pending again (:meth:`_given_back`)."""
        self.wait()
        if not self._journaled:
            return False
        if self.overlay is not None or self.overlay_bound:
            self.journal.rotate()  # (the caller's writer is idle: see MemoryPool.trim_working_copy)
            self._compactor.run(self._absorb_committed, wait=True)
            self._given_back(regions, remap=True)
            self.stats.trims += 1
            return True
        # Rows an on-demand replay has not applied yet: into the working copy now, so that none
        # is applied later over a value a step wrote after the trim (the pass below writes them
        # into the images too, as every journal row above the applied position).
        self._apply_pending(runs=True)
        self.journal.rotate()  # (the caller's writer is idle: see MemoryPool.trim_working_copy)
        self.apply(min_bytes=1, wait=True)
        self.check()
        for r in regions:
            r.trim()
        self.stats.trims += 1
        return True

    def refresh(self, written: dict[str, torch.Tensor]) -> bool:
        """Give back the images' clean page cache (and the working copy's pages) of the tables
        ``written`` names, on a journaled tier, without the :meth:`trim`'s pass over the journal:
        ``written[name]`` (sorted rows) must be every row of the table written into the working copy since it
        was last mapped afresh (a DRAM cache's dirty rows evicted, the pool's own writes:
        ``CacheArena.take_spilled``). With a row overlay, those rows' run values stop counting
        in this process (``Overlay.forget_home``) and the rest of the runs' rows given back are
        pending again (:meth:`_given_back`). Those rows are written into the image's page cache
        (unsynced; the next compaction syncs the image), then the image is mapped afresh and its
        clean pages dropped. Every other row of the working copy is the image's own.

        Call order (``MemoryPool.trim_working_copy(names, written)``): at a recovery point, the checkpointer
        drained -- the rows written are then committed values (an uncommitted one in an image's
        page cache would outlive a crash of the trainer where the journal's replay does not
        overwrite it) -- and only after a :meth:`trim` since the pool was opened: an open's replay
        writes the journal's rows into the working copy, and nothing lists them (unless it
        replayed none: ``PoolStats.journal_rows_at_open``). False, nothing done, where
        :meth:`trim` would refuse.

        With nothing written (every ``written[name]`` empty) the checkpointer need not be
        drained: no row goes into an image, every page of the working copy is the image's own,
        so its pages are dropped where they are (``FileRegion.trim(remap=False)``), and neither
        the mapping a write-back stores through nor a running compaction is touched or waited
        for (``WorkingCopyBound.after_commit``: the trainer's wait at such recovery points)."""
        if not self._journaled:
            return False
        if not any(ids.numel() for ids in written.values()):
            self._given_back([self._tables[name].region for name in written], remap=False)
            self.stats.refreshes += 1
            return True
        self.wait()
        # The rows written hold their newest committed value (CacheArena.take_spilled leaves
        # out those a DRAM cache holds newer): every record below this sequence number is
        # older. A later write-back pass of such records must not put an older value back
        # under a working copy that reads the image -- an apply pass writes the sealed segments
        # since the applied position record after record, and a row written here could read
        # back, for seconds, the value of a window long gone: it skips these rows (absorb_rows'
        # superseded; tests/test_applied_mark.py, tests/test_dram_cache.py). So must a
        # compaction through a row overlay: it writes each row's newest record among the
        # segments it drops, and the segment being written when it began is kept -- a row
        # refreshed with a value from there would read an older one back, written home in
        # place or taken from the run (found 2026-12-05: a compaction right after a trim).
        self._refreshed.append((self.journal.next_seq, {n: ids.numpy() for n, ids in written.items() if ids.numel()}))
        with self._image_lock:  # (home()'s mapping is dropped below: never beside a write-back)
            for name, ids in written.items():
                r = self._tables[name].region
                if ids.numel():
                    raw = r.tensor.view(torch.uint8).view(r.rows, r.row_bytes).index_select(0, ids)
                    asked = r.pages_prefetched
                    self.stats.bytes_written_back += r.write_back(ids, raw)
                    self.stats.pages_prefetched += r.pages_prefetched - asked
                    self._unsynced.add(name)
                    if self.overlay is not None:
                        # (the image holds their newest values now, not a run: the next
                        # compaction tombstones the runs' older ones, Overlay.absorb)
                        self.overlay.forget_home(name, ids)
            self._given_back([self._tables[name].region for name in written], remap=True)
        self.stats.refreshes += 1
        return True

    def _given_back(self, regions, *, remap: bool) -> None:
        """``FileRegion.trim`` of ``regions``; with a row overlay, the rows of theirs whose
        newest value is a run's are pending again (``Overlay.repend``: their copies in the
        working copy are gone), and the runs' pages are dropped (counted in the budget)."""
        ov = self.overlay
        ids = {id(r) for r in regions}
        names = [n for n, t in self._tables.items() if id(t.region) in ids]
        taken = ov.taken(names) if ov is not None else set()
        for r in regions:
            r.trim(remap=remap)
        if ov is not None:
            if not remap:
                # A row taken from a run went into a copy-on-write page, and the image's page
                # under it, read by that fault, is cached but no longer mapped: MADV_PAGEOUT
                # (FileRegion.trim) cannot reclaim it, only a drop from the file can.
                for n in taken:
                    r = self._tables[n].region
                    if not r.keep_cached:
                        r.drop_cache()
            ov.repend(names, remapped=remap)
            ov.drop_cache()

    def _compaction_overlay(self) -> Overlay | None:
        """The overlay a compaction writes through: the pool's, or a new one when the pool
        should have one; None when it has none and should not."""
        if self.overlay is None and self._wants_overlay:
            ov = Overlay(self._storage_dir / RUNS_DIR, read_only=False, stats=self.stats)
            ov.attach({n: t.region for n, t in self._tables.items()}, {})
            self.overlay = ov
        return self.overlay

    def _sync_images(self) -> None:
        try:
            for name in sorted(self._unsynced):
                r = self._tables[name].region
                r.sync(drop_cache=name in self._bounded and not r.keep_cached)  # (see _write_back)
        except BaseException:
            # A failed fdatasync (EIO) may leave pages clean that never reached the disk: the
            # page cache no longer vouches for anything.
            if self._mark is not None:
                self._mark.remove()
            # Nor does a retried fdatasync: Linux reports a failed write-back once, marks the
            # pages clean (their bytes in the cache, or dropped and read back old from the disk),
            # and the next fdatasync of the file says success without writing them. So every
            # row written back since the last good sync -- since the journal's START, which only
            # moves after one -- is written again by the next compaction before any sync that
            # lets the journal go (we rewrite rather than refuse: the journal still holds every
            # such row, so rewriting them is the replay a reopen would do). An apply() pass in
            # between starts from START too.
            if self.journal is not None:
                self._applied = self.journal.start_seq
                self._unsynced |= set(self._tables)
                # Nor for the rows a refresh wrote: their records are written again too.
                self._refreshed = []
            raise
        self._unsynced.clear()

    def _vouch(self) -> None:
        if self._mark is not None:
            self._mark.write(self._applied)

    @contextlib.contextmanager
    def settled(self):
        """True: the images held, no compaction or trim running inside (the journal's START and
        the overlay still), for :meth:`pend_compacted`; the last one's rows are forgotten at the
        exit (~14 MB of ids on `kaggle`). False when one holds them now: not waited for (a caller
        between two steps tries again at its next recovery point)."""
        if not self._image_lock.acquire(blocking=False):
            yield False
            return
        try:
            yield True
        finally:
            if self.overlay is not None:
                self.overlay.last_absorbed = {}
            self._image_lock.release()

    def pend_compacted(self, names, rows: torch.Tensor) -> torch.Tensor:
        """``Overlay.pend_absorbed`` of rows ``rows`` in each of tables ``names`` (inside
        :meth:`settled`): the mask of rows that read the last compaction's value in all of them."""
        ok = torch.ones(rows.numel(), dtype=torch.bool)
        for n in names:
            ok &= self.overlay.pend_absorbed(n, rows) if self.overlay is not None else False
        return ok

    # -- bulk loads (Table.load_, fill_)
    @contextlib.contextmanager
    def images_held(self):
        """Around a bulk load of a table into its image (``MemoryPool._bulk_load``): no
        compaction and no write-back pass runs. Both write the table's older journal rows (the
        overlay its run rows) into the same image: one running beside the load put them back
        over the loaded rows (1.0 read where 5.0 was loaded, in memory and after a reopen). One
        running now is waited for (and its error raised); one started meanwhile waits for the
        lock, and then finds the reset committed (it skips the rows older than it)."""
        self.wait()
        with self._image_lock:
            yield

    def note_reset(self, name: str) -> None:
        """Table ``name`` was loaded whole into its image, durably (``Table.load_``): on a
        journaled tier its older journal rows and its run values stop counting -- else the next
        open would put them back over the loaded rows. Written after the image is synced: a
        crash before it leaves the load half done, as it would without it.

        One commit point: the reset marker, a journal transaction. With runs it also names the
        overlay's next generation (``runs_from``), so that the table's values in older runs stop
        counting at the same commit (an open honours it, see ``Replayer._note_run_resets``); the
        manifest's ``reset`` written after it is its copy, which outlives the marker once a
        compaction has dropped it. (As two durable steps, a crash between them left the old run
        values applied over the loaded rows, silently.) A journal without a transaction holds no
        row of the table: the manifest alone is then the commit point. Inside
        :meth:`images_held`: no compaction runs meanwhile (waiting for one here, under its lock,
        would never end)."""
        if not self._journaled:
            return
        ov = self.overlay
        if self.journal.txns:  # (a fresh journal holds no rows of it)
            doc = {"kind": "reset", "table": name}
            if ov is not None:
                doc["runs_from"] = ov.next_gen
            txn = self.journal.end(-1, doc)
            self.resets[name] = txn.end.seq
        if ov is not None:
            ov.reset_table(name)
