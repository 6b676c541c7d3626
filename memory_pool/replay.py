"""Replay at open: the journal's committed rows (and the row overlay's runs) into a pool's
private working copy, all before the open returns (eager) or each when first needed (on demand,
memory_pool/ondemand.py) -- one object, :class:`Replayer`, that the pool holds.

An open, in this order (``MemoryPool.__init__``): the journal is opened and its unfinished tail
dropped; the compaction's state says from where to replay (the applied mark, memory_pool/
compaction.py); :meth:`Replayer.plan` reads and verifies the rows (damage is refused before
anything changes); the tables are mapped; :meth:`Replayer.start` attaches the runs (newer journal
rows win over them) and applies the rows, or indexes them (:class:`PendingRows`). Afterwards every
row path of the pool and its tables asks the replayer for the rows it is about to touch
(:meth:`Replayer.ready`, :meth:`Replayer.ready_rows`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .arena import Arena
from .compaction import Compaction
from .journal import Journal
from .ondemand import PendingRows
from .overlay import Overlay
from .persistence import replay_plan, replay_rows
from .tiers import prefetch_if_cold
from .table import PoolStats, Table
from .threads import one_intra_op_thread

__all__ = ["Replayer", "REPLAY_MODES"]

# How an open applies the journal's committed rows to the working copy: all before it returns,
# or each when first needed (memory_pool/ondemand.py).
REPLAY_MODES = ("eager", "on-demand")


class Replayer:
    """The rows an open replays into a pool's working copy, and those it has not applied yet.

    ``tables``: the pool's tables by name (the pool's own dict, filled by the open between
    :meth:`plan` and :meth:`start`); ``compaction``: the pool's :class:`Compaction`, whose
    ``since`` says from where to replay, whose ``resets`` say which rows no longer count, and
    whose ``overlay`` holds the runs' pending rows."""

    def __init__(self, journal: Journal, tables: dict[str, Table], stats: PoolStats, compaction: Compaction):
        self.journal = journal
        self._tables = tables
        self.stats = stats
        self._compaction = compaction
        self._pending: PendingRows | None = None   # on-demand replay's rows still to apply

    def plan(self, table_names: set[str], where: Path, *, on_demand: bool) -> tuple[dict[str, list], Arena | None]:
        """The journal's committed rows to replay, read and verified (``replay_plan``)."""
        # The committed rows of the journal go into this process's private working copy:
        # memory copies, no system call per row (the image is brought up to date later, by
        # compaction; the journal keeps them until then, so this is idempotent). Not marked
        # dirty: they are durable already. Rows that the images' page cache already holds
        # (below the applied mark: a crash of the trainer, not of the machine) are skipped.
        # On demand (memory_pool/ondemand.py), the rows are read and verified the same way,
        # through a window that keeps the journal mapped, and only indexed here.
        return replay_plan(self.journal, table_names, where, self._compaction.since,
                           on_demand=on_demand, resets=self._compaction.resets)

    def start(self, plan: dict[str, list], window: Arena | None, *, runs_dir: Path | None, read_only: bool,
              replay: str) -> None:
        """Once the tables are mapped: attach the runs (``runs_dir``: the pool has them), then
        apply the plan's rows (eager) or index them (on demand, ``window`` not None)."""
        fresh = self._tables.fresh
        if fresh.kept:
            # The file of rows still at their initial value is kept on a journaled tier: every
            # row of a record it may not show -- those after START (or the applied mark) -- is
            # cleared now, before anything reads one (memory_pool/fresh.py).
            for name, parts in plan.items():
                fresh.written(name, torch.cat([ids for ids, _ in parts]))
        if runs_dir is not None:
            # The runs' rows: pending until first read (on demand) or all applied below
            # (eager); a row the journal holds is the journal's (newer). (Reading the runs'
            # indexes on a thread of their own while the journal is read was slower: 1.2 s
            # against 1.05 s after a power loss on `kaggle`; the journal's scan of record
            # headers waits behind the index reads, and both halves fault in fresh memory.)
            ov = self._compaction.overlay = Overlay(runs_dir, read_only=read_only, stats=self.stats)
            unsaved_resets = self._note_run_resets()
            ov.attach({n: t.region for n, t in self._tables.items()},
                      {n: torch.cat([ids for ids, _ in parts]) for n, parts in plan.items()})
            if unsaved_resets and not read_only:
                # A crash came between a reset marker and the manifest's copy of it: the
                # copy now, before a compaction can drop the marker.
                ov.save_manifest()
        replayed = self.stats.rows_replayed
        if plan and window is not None:
            self._pending = PendingRows(plan, {n: t.region for n, t in self._tables.items()}, window,
                                        on_apply=self._count_replayed)
            self.stats.rows_deferred = self._pending.remaining
        elif plan:
            self._replay(plan)
        # (rows in the working copy that no list of a DRAM cache's names: WorkingCopyBound's first trim)
        self.stats.journal_rows_at_open = self.stats.rows_replayed - replayed + self.stats.rows_deferred
        ov = self._compaction.overlay
        if ov is not None:
            if replay == "eager":
                ov.take_all()  # (counted in stats.run_rows_replayed)
            else:
                self.stats.run_rows_deferred = ov.pending_rows
                self.stats.rows_deferred += ov.pending_rows

    def _replay(self, plan: dict[str, list]) -> None:
        """Write the journal's committed rows into the working copy (``replay_plan``'s plan).
        The time goes into copy-on-write faults of the private working copy, one per page a
        journal row lands in (~480k on `kaggle`, ~2.3 us each here): tables are replayed on
        every core, the largest first (torch releases the GIL, and faults of different tables
        run in parallel). Nothing reads a row before open() returns."""
        order = sorted(plan, key=lambda name: -sum(ids.numel() for ids, _ in plan[name]))
        for name in order:  # (the image not cached: its pages asked for all at once first)
            r = self._tables[name].region
            if r.nbytes:
                self.stats.pages_prefetched += prefetch_if_cold(r.fd, r.addr, r.row_bytes, plan[name])
        with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, 8)), thread_name_prefix="journal-replay",
                                initializer=one_intra_op_thread) as ex:  # (parallel over tables instead)
            jobs = []
            for name in order:
                r = self._tables[name].region
                jobs.append(ex.submit(replay_rows, r.tensor.view(torch.uint8).view(r.rows, r.row_bytes), plan[name]))
            for job in jobs:
                self.stats.rows_replayed += job.result()

    def _note_run_resets(self) -> bool:
        """At an open with runs: the reset markers in the journal (``runs_from``,
        ``Compaction.note_reset``) make their table's values in older runs stop counting, whether
        or not the manifest says so yet (a crash may have come between the two). True when the
        manifest did not."""
        gens: dict[str, int] = {}
        for txn in self.journal.txns:
            doc = txn.doc
            if doc.get("kind") == "reset" and isinstance(doc.get("table"), str) and isinstance(doc.get("runs_from"), int):
                gens[doc["table"]] = max(gens.get(doc["table"], 0), doc["runs_from"])
        return self._compaction.overlay.note_resets(gens)

    # -- replay on demand (memory_pool/ondemand.py)
    @property
    def journal_rows_pending(self) -> int:
        """Journal rows an on-demand replay has not applied to the working copy yet (the
        runs' pending rows left out)."""
        p = self._pending
        return p.remaining if p is not None else 0

    @property
    def rows_pending(self) -> int:
        """Journal (and run) rows an on-demand replay has not applied to the working copy yet."""
        p, ov = self._pending, self._compaction.overlay
        return (p.remaining if p is not None else 0) + (ov.pending_rows if ov is not None else 0)

    def ready(self, pairs) -> None:
        """Apply the journal's (and the runs') rows among ``[(table, ids)]`` (trusted ids) that
        an on-demand replay has not applied yet."""
        p = self._pending
        if p is not None:
            for t, ids in pairs:
                p.take(t.name, ids)
            self._done_if_empty(p)
        ov = self._compaction.overlay
        if ov is not None and ov.pending_rows:
            for t, ids in pairs:
                ov.take(t.name, ids)

    def peek(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows among ``ids`` (sorted, distinct) of table ``name`` whose newest value is not in
        the working copy yet -- a run's, else the journal's (a run's is the newer: the rows an
        open finds in the journal are not pending from a run, and a run written since holds
        newer values) -- as ``(mask over ids, their values [hits, row_bytes] uint8)``, or None.
        Read, not applied: a DRAM cache's miss takes them into its slot and the working copy
        stays as it is (each applied row cost a copy-on-write fault and a read of the image's
        page, for a value the slot then held anyway). They stay pending: whatever writes or
        reads the working copy's row later readies it first (``Table``'s row paths, the
        cache's write-back of a dirty slot: ``CacheArena._write_back_slots``)."""
        p, ov = self._pending, self._compaction.overlay
        got = ov.peek(name, ids) if ov is not None and ov.pending_rows else None
        if p is None:
            return got
        if got is None:
            return p.peek(name, ids)
        rest = (~got[0]).nonzero().flatten()
        jr = p.peek(name, ids[rest]) if rest.numel() else None
        if jr is None:
            return got
        # Both: each hit's value at its place among ids, then the hits in ids order.
        mask, vals = got[0].clone(), torch.empty(ids.numel(), got[1].shape[1], dtype=torch.uint8)
        vals[got[0]] = got[1]
        mask[rest[jr[0]]] = True
        vals[rest[jr[0]]] = jr[1]
        return mask, vals[mask]

    def ready_rows(self, name: str, ids: torch.Tensor | None = None) -> None:
        """:meth:`ready` for rows ``ids`` of table ``name`` (None: all of them)."""
        p = self._pending
        if p is not None:
            p.take(name, ids)
            self._done_if_empty(p)
        ov = self._compaction.overlay
        if ov is not None and ov.pending_rows:
            ov.take(name, ids)

    def apply_pending(self, *, chunk: int | None = None, runs: bool = True, hand_over: bool = False) -> None:
        """Apply every row not applied yet (``runs``: the runs' rows too). ``hand_over`` (a
        trim through the row overlay, which has just put every committed journal row in a run
        or home, with nothing reading meanwhile): the journal's rows are not applied but made
        pending from there (``PendingRows.hand_over``, ``Overlay.pend``)."""
        p = self._pending
        ov = self._compaction.overlay
        if p is not None:
            if hand_over and ov is not None:
                # (Applied, each row cost a copy-on-write fault and a read of its image page,
                # for a working copy the trim maps afresh right after: `kaggle` resumed after
                # 2,700 steps behind a DRAM cache, 1.5 GB of journal, spent ~65 s of its
                # first step's trim here.)
                self.stats.rows_handed_over += p.hand_over(ov.pend)
            else:
                p.take_all(chunk=chunk)
            self._done_if_empty(p)
        if runs and ov is not None and ov.pending_rows:
            ov.take_all()  # (counted in stats.run_rows_replayed)

    def forget(self, name: str) -> None:
        """Drop table ``name``'s pending rows unapplied (a bulk load replaces them all)."""
        # (inside MemoryPool._bulk_load: no compaction decides where the table's rows go meanwhile)
        p = self._pending
        if p is not None:
            p.forget(name)
            self._done_if_empty(p)
        if self._compaction.overlay is not None:
            self._compaction.overlay.forget(name)   # (in memory; durable in note_reset, after the image)

    def close(self) -> None:
        self._pending = None

    def _count_replayed(self, n: int) -> None:
        self.stats.rows_replayed += n  # (called under the PendingRows' lock: no count is lost)

    def _done_if_empty(self, p: PendingRows) -> None:
        if not p.remaining and self._pending is p:
            self._pending = None  # (and its window, the journal's mapping, once no view is left)
