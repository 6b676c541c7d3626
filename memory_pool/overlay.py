"""The row overlay: rows a compaction keeps out of the table images, packed in runs.

Why (issue #9's write amplification). On a journaled tier (emulated pmem, power-sim) a compaction
writes the newest value of every row of ~1 GiB of journal back into the table images, in place.
A 256-byte row alone in its 4 KiB page costs the whole page: on ``kaggle`` (33.8 M rows) most rows
a compaction writes back are alone in their page, and the write-back costs 1.75x the journal's
bytes (write amplification 2.75, ``tools/writeback_model.py``). With the overlay a compaction writes
in place only the pages where at least a quarter of the bytes changed (rows already carried in the
overlay counted in); every other row of its window is appended, packed, to one new **run** (a
256-byte row costs 264 bytes there, its id included, not 4 KiB). Runs are cleaned first in, first
out: while they hold more than the overlay's bound (2 GiB by default), the oldest run's rows that
are still the newest value of their row move into the new run and the oldest run is dropped (or,
when the rows still carried would fill most of the bound by themselves, they go home in place).
Modelled on ``kaggle``'s ids over 9,600 steps (80 GB of journal): WA 1.43 in the steady state
against 2.75 in place (``tools/writeback_model.py --steady 9600 --cap 2048``).

Where a row's newest durable value lives: in the journal if it holds the row (newest first); else
in the newest run holding it, unless a newer run holds a **tombstone** for it (the row was written
home in place since); else in the image. In memory, ``where[table][row]`` is the slot of the run
holding its newest run value (0: the image), negative while that value is not in the working copy
yet (an open's pending rows: one array for both, which halves what an open writes).

Layout of ``<pool>/runs/``::

    MANIFEST              the live runs, oldest first, and the next generation number (JSON with
                          a crc32; replaced atomically and durably): a run counts from the moment
                          the manifest names it, and stops counting when it no longer does
    run-<gen, 16 hex>.bin one compaction's run

Run file: its format, and writing and opening one: :mod:`memory_pool.runfile`.

A compaction, in this order (SQLite's rule: the commit marker last, and durably):

1. the rows of dense pages go into the images (through the page cache), the others into the new
   run's file; a carried row that goes home in place gets a tombstone in the new run;
2. the run file is fdatasync'ed, and so are the images (the pool does it);
3. the manifest is replaced: the new run counts, the cleaned runs no longer do. (The first time,
   the pool's header says format version 3 first, so that a dlrm-cxl that does not know runs
   refuses the pool instead of reading its images as if they were complete.)
4. the journal's START moves past the window (its segments are dropped: the journal's part);
5. the files of the cleaned runs are deleted.

A crash before 3 leaves the old manifest and the whole journal: opening replays the journal over
the old runs, the same values as before. A crash between 3 and 4 leaves the new manifest and the
whole journal: the journal replays the same values over the new runs. Files that no manifest
names (a run written before a crash, a cleaned one not deleted yet) are removed by the next writer.

Damage: a run's header and index are verified when the pool opens (``RunCorruptError``, exit 4,
nothing changed; a run the manifest names and the directory lacks is damage too); its rows are
verified a 4 KiB block at a time when they are first read (replay, cleaning, a write home), and a
block that fails raises the same error before any of its rows is used -- reading every run at
every open would cost ~1.3 s per 2 GiB after a power loss.

Opening applies the runs' rows to the working copy like the journal's (``replay``): eagerly, or on
demand -- a row is copied in when it is first read (:meth:`Overlay.take`), as
:mod:`memory_pool.ondemand` does for the journal's rows, which are newer and so take precedence:
a row the journal holds is never taken from a run.

Behind a DRAM cache (``Compaction.bound``; tables larger than the DRAM budget) the pool keeps an
overlay whatever its size: there the working copy is given back at recovery points (mapped afresh
over the images, or its pages dropped: ``Compaction.trim``, ``refresh``), and a trim writes every
committed row home first -- in place, a read and a write of a 4 KiB page per 256-byte row of a
home far larger than the page cache; through the overlay, a compaction: the rows packed into a
run, sequential writes, no read. Five rules keep every row right (a sixth: ``pend_absorbed``):

* **given back, pending again** (:meth:`repend`): a run's row copied into the working copy is
  gone with it, so every row whose newest value is a run's is pending again, and the next read
  takes it from its run (:meth:`take` reads any run, not only those the open mapped), and a cleaning moves it on
  pending, into the new run (it was copied into the working copy first before: a copy-on-write
  fault of a home page per row, 3/4 of a compaction's CPU on `kaggle` at the runs' bound);
* **written home while pending, read from the image** (``HOME``): a compaction that writes a
  pending row home in place (its page dense, or the oldest run's rows evicted) leaves it
  pending, from the image -- a page of the working copy copied on write before keeps an older
  value of it -- until the working copy is mapped afresh (``repend(remapped=True)``);
* **written home, out of the runs** (:meth:`forget_home`): a refresh writes the cache's evicted
  dirty rows into the images; their run values stop counting in this process, and the next
  compaction tombstones the runs' older values of every row it writes home (:meth:`absorb`) --
  the journal holds their newer values until then, which a reopen replays over the runs;
* **evicted dirty, taken first** (``CacheArena._write_back_slots``): a pending row is taken before
  a slot's newer value is written over it, or a later read would take the run's older one;
* **refreshed, not written again by older records** (``absorb_rows``' superseded): a compaction
  writes each row's newest record among the segments it drops, and the segment being written
  when it began is kept. A row a refresh wrote home with a value from that segment is newer than
  all of them: the compaction neither writes it home nor into its run, and tombstones it as a
  row written home (``absorb(superseded=)``).
"""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import numpy as np
import torch

from .arena import PAGE, Arena
from . import fileio
from .durable import atomic_write, fsync_dir, json_crc_ok, json_with_crc, parse_json_object
from .errors import PoolCorruptError
from .records import copy_rows
from .overlay_compaction import DENSE_FRACTION, HOME, MAX_RUNS, NEW, OverlayCompaction, Plan
from .runfile import BLOCK, Run, RunCorruptError, write_run

__all__ = ["Overlay", "Run", "RunCorruptError", "write_run", "RUNS_DIR", "MANIFEST", "DEFAULT_BOUND",
           "DENSE_FRACTION", "HOME", "image_rows"]

RUNS_DIR = "runs"
MANIFEST = "MANIFEST"
DEFAULT_BOUND = 2 << 30           # bytes of runs kept (the model: 2 GiB reach WA 1.43 on kaggle; 1 GiB do not)
SOURCE_AFTER = 16                 # the read of a table's pending run rows at which Overlay._source finds them all


class Overlay(OverlayCompaction):
    """The row overlay of one pool (see the module docstring): its runs, ``where`` (the newest run
    value of every row), the rows an open has not applied to the working copy yet, and the
    compaction's part (:class:`~memory_pool.overlay_compaction.OverlayCompaction`).
    ``regions``: the pool's table regions by name (set by :meth:`attach`).
    Thread-safe: the trainer, the journal writer and the compactor may take rows while a
    compaction runs; one lock guards ``where``, the pending rows and the list of runs."""

    def __init__(self, directory: Path, *, read_only: bool, stats=None):
        self.dir = Path(directory)
        self.read_only = read_only
        # (PoolStats: run_rows_replayed counts every row take() copies in -- a compaction's own too)
        self.stats = stats
        self.runs: list[Run] = []
        self.next_gen = 1
        self.reset: dict[str, int] = {}    # table -> generation: its entries in older runs no longer count
        # table -> int8 [rows]: slot of the run holding the newest run value; negative: not in the
        # working copy yet (pending); NEW: the run this compaction is writing
        self.where: dict[str, torch.Tensor] = {}
        self.pending_rows = 0
        self.regions: dict = {}
        self._lock = threading.RLock()
        self._free_slots = list(range(NEW - 1, 0, -1))
        self._plan: Plan | None = None
        self.broken: str | None = None
        self._window: Arena | None = None
        self._open_runs: list[Run] = []
        self._sources: dict[str, tuple | int] = {}   # table -> (pending rows, window offsets), or reads so far
        self._win = torch.zeros(NEW + 1, dtype=torch.bool)   # slot -> it names a run mapped in the window
        # Tables that may hold entries > 0, and the rows that may (see repend): sorted distinct
        # tensors and their count; None: any row may (repend scans the whole table)
        self._positive: dict[str, list[torch.Tensor] | None] = {}
        self._positive_n: dict[str, int] = {}
        # table -> rows made HOME since the last remap (None: too many listed, repend scans)
        self._homed: dict[str, list[torch.Tensor] | None] = {}
        self._took: set[str] = set()   # tables take() copied rows into since their last repend (taken())

        self._strided: dict[int, torch.Tensor] = {}
        mpath = self.dir / MANIFEST
        if mpath.exists():
            try:
                doc = parse_json_object(mpath.read_bytes(), mpath, "the runs' manifest")
            except PoolCorruptError as exc:
                raise RunCorruptError(exc.message) from None
            if not json_crc_ok(doc) or not isinstance(doc.get("runs"), list):
                raise RunCorruptError(f"{mpath}: fails its checksum")
            if len(doc["runs"]) > MAX_RUNS:
                raise RunCorruptError(f"{mpath}: names {len(doc['runs'])} runs; a pool keeps at most {MAX_RUNS}")
            self.next_gen = int(doc.get("next_gen", 1))
            self.reset = {str(k): int(v) for k, v in doc.get("reset", {}).items()}
            # The runs an open finds are mapped side by side into one window, so that the rows
            # still pending from any of them are copied in with a single gather (see take).
            self._window = Arena(sum(int(r.get("bytes", 0)) for r in doc["runs"]) + PAGE)
            try:
                for r in doc["runs"]:
                    run = Run.open(self.dir / r["file"], self._window)
                    if run.gen != r["gen"] or run.nbytes != r["bytes"]:
                        raise RunCorruptError(f"run {run.path}: generation {run.gen} / {run.nbytes} bytes, the "
                                              f"manifest says {r['gen']} / {r['bytes']}")
                    run.slot = self._free_slots.pop()
                    self._win[run.slot] = run.window is not None
                    self.runs.append(run)
                self._open_runs = list(self.runs)
                # One "verified" and one "advised" array over every block of the open's runs (each
                # run's own are views of them): take() looks a batch's blocks up once each.
                counts = [len(r.crcs) for r in self._open_runs]
                self._gverified, self._gadvised = np.zeros(sum(counts), dtype=bool), np.zeros(sum(counts), dtype=bool)
                at = 0
                for r, c in zip(self._open_runs, counts):
                    r.verified, r.advised, r.gblock = self._gverified[at:at + c], self._gadvised[at:at + c], at
                    at += c
                self._wbases = torch.tensor([r.wbase for r in self._open_runs], dtype=torch.int64)
                self._gblocks = torch.tensor([r.gblock for r in self._open_runs], dtype=torch.int64)
            except BaseException:
                self.close()
                raise
        if not read_only and self.dir.is_dir():
            # Run files no manifest names: written before a crash, or cleaned and not yet deleted.
            live = {r.path.name for r in self.runs}
            stray = [p for p in self.dir.glob("run-*.bin") if p.name not in live]
            for p in stray:
                fileio.unlink(p)
            if stray:
                fsync_dir(self.dir)  # removed for good (a power loss would bring them back)

    # -- what the runs hold
    @property
    def run_bytes(self) -> int:
        return sum(r.nbytes for r in self.runs)

    def _counts(self, run: Run, name: str) -> bool:
        return run.gen >= self.reset.get(name, 0)

    def attach(self, regions: dict, journal_rows: dict[str, torch.Tensor]) -> None:
        """Build ``where`` and the pending rows for the pool's tables (``regions`` by name):
        every row whose newest durable value is a run's and not the journal's (``journal_rows``:
        the rows the journal holds, per table) is pending until :meth:`take` copies it into the
        working copy."""
        self.regions = regions
        unknown = {n for r in self.runs for n in r.tables} - set(regions)
        if unknown:
            raise RunCorruptError(f"{self.dir}: runs hold rows of unknown tables {sorted(unknown)}")
        for run in self.runs:  # oldest first: a newer run's entry or tombstone wins
            for name, t in run.tables.items():
                if not self._counts(run, name):
                    continue
                rows = regions[name].rows
                if t.ids.numel() and int(t.ids[-1]) >= rows or t.tombs.numel() and int(t.tombs[-1]) >= rows:
                    raise RunCorruptError(f"run {run.path}: table {name!r} has {rows} rows, the run holds row "
                                          f"{max(int(t.ids[-1]) if t.ids.numel() else 0, int(t.tombs[-1]) if t.tombs.numel() else 0)}")
                w = self._where(name)
                # (pending: the working copy holds the image's value; index_fill_: 2x setitem)
                w.index_fill_(0, t.ids, -run.slot)
                w.index_fill_(0, t.tombs, 0)
        for name, w in self.where.items():
            j = journal_rows.get(name)
            if j is not None and j.numel():
                w[j] = w[j].abs()        # the journal's value is newer: memory_pool.ondemand applies it
                self._made_positive(name, None)
        self.pending_rows = sum(int(torch.count_nonzero(w < 0)) for w in self.where.values())

    def _where(self, name: str) -> torch.Tensor:
        w = self.where.get(name)
        if w is None:
            # (numpy's zeros come from calloc: pages of rows no run holds are never touched)
            w = self.where[name] = torch.from_numpy(np.zeros(self.regions[name].rows, dtype=np.int8))
        return w

    def _run(self, slot: int) -> Run:
        for r in self.runs:
            if r.slot == slot:
                return r
        if self._plan is not None and self._plan.run is not None and self._plan.run.slot == slot:
            return self._plan.run
        for r in self._plan.cleaned if self._plan is not None else ():
            if r.slot == slot:
                return r
        raise RunCorruptError(f"{self.dir}: no run in slot {slot}")

    def run_values(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """The newest run values of ``rows`` (each held by a run), for a compaction: in bulk."""
        w = self.where[name]
        rb = self.regions[name].row_bytes
        out = torch.empty(rows.numel(), rb, dtype=torch.uint8)
        slots = w[rows].abs()
        for s in torch.unique(slots).tolist():
            sel = (slots == s).nonzero().flatten()
            out[sel] = self._run(s).rows(name, rows[sel], bulk=True)
        return out

    # -- the working copy (replay, eager or on demand)
    def take(self, name: str, ids: torch.Tensor | None = None, *, chunk: int = 1 << 18) -> int:
        """Copy the pending rows of table ``name`` among ``ids`` (None: all of them, ``chunk`` at
        a time) into the working copy. Returns the rows copied.

        Rows pending since the open are values of the runs it found, which lie side by side in
        one window: they are gathered with one ``index_select`` whatever run each is in (one
        per run cost ~20 us x 20 runs x 52 tables a step on `kaggle`), from offsets found once
        per table (:meth:`_source`). Rows made pending again by :meth:`repend` may be in a run
        written since, read from it (:meth:`_values`)."""
        w = self.where.get(name)
        if w is None or not self.pending_rows:
            return 0
        if ids is not None:
            # (a first look without the lock: a row is made not pending by takes, and pending
            # again only by repend, which runs while nothing reads the tables -- at a recovery
            # point, the DRAM cache paused)
            ids = ids[w[ids] < 0]
            if not ids.numel():
                return 0
        n = 0
        with self._lock:
            hit = (w < 0).nonzero().flatten() if ids is None else torch.unique(ids[w[ids] < 0])
            if not hit.numel():
                return 0
            region = self.regions[name]
            rb = region.row_bytes
            rows = region.tensor.view(torch.uint8).view(region.rows, rb)
            for a in range(0, hit.numel(), chunk):
                part = hit[a:a + chunk]
                copy_rows(rows, part, self._values(name, part, rb))
                wp = w[part]
                w[part] = torch.where(wp == HOME, 0, -wp).to(torch.int8)
                self.pending_rows -= part.numel()
                n += part.numel()
            self._made_positive(name, hit)
            self._took.add(name)
            if self.stats is not None:
                self.stats.run_rows_replayed += n
        return n

    def peek(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Which of ``ids`` (sorted, distinct) of table ``name`` are pending (their newest value
        a run's, not in the working copy), and those values (``[hits, row_bytes]`` uint8): read,
        not taken (``Replayer.peek``). None when none is."""
        w = self.where.get(name)
        if w is None or not self.pending_rows:
            return None
        with self._lock:
            mask = w[ids] < 0
            if not bool(mask.any()):
                return None
            return mask, self._values(name, ids[mask], self.regions[name].row_bytes)

    def _values(self, name: str, part: torch.Tensor, rb: int) -> torch.Tensor:
        """The newest values of pending rows ``part`` (sorted) of table ``name``, ``[n, rb]``:
        a run's, or the image's for a row written home while pending (``HOME``)."""
        home = self.where[name][part] == HOME
        if not bool(home.any()):
            return self._run_values_of_pending(name, part, rb)
        out = torch.empty(part.numel(), rb, dtype=torch.uint8)
        at = home.nonzero().flatten()
        out[at] = image_rows(self.regions[name], part[at])
        rest = (~home).nonzero().flatten()
        if rest.numel():
            out[rest] = self._run_values_of_pending(name, part[rest], rb)
        return out

    def _run_values_of_pending(self, name: str, part: torch.Tensor, rb: int) -> torch.Tensor:
        """The run values of pending rows ``part`` (sorted; none ``HOME``) of table ``name``."""
        slots = (-self.where[name][part]).to(torch.int64)
        prow, poff = self._source(name)
        if prow.numel():
            pos = torch.searchsorted(prow, part).clamp_(max=prow.numel() - 1)
            # (found where the open left it, and its slot still names that window run: a slot
            # of a run cleaned since may name a newer run now)
            win = (prow[pos] == part) & self._win[slots]
        else:
            pos, win = None, torch.zeros(part.numel(), dtype=torch.bool)
        if bool(win.all()):
            src = poff[pos]
            self._verify_window(src, rb)
            return self._window_rows(rb).index_select(0, src)
        out = torch.empty(part.numel(), rb, dtype=torch.uint8)
        if bool(win.any()):
            src = poff[pos[win]]
            self._verify_window(src, rb)
            out[win] = self._window_rows(rb).index_select(0, src)
        rest = (~win).nonzero().flatten()
        rslots = slots[rest]
        for s in torch.unique(rslots).tolist():
            sel = rest[rslots == s]
            out[sel] = self._planned(name, part[sel]) if s == NEW else self._run(s).rows(name, part[sel])
        return out

    def _source(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Table ``name``'s rows pending from a run of the open's window (sorted), and each one's
        window offset. Found once: a row only moves on to newer runs (not in the window), so an
        entry stays right while the row's slot names a window run (``_values`` checks). At the
        table's :data:`SOURCE_AFTER`-th read (until then each read searches its runs): finding
        them all took 2.2 s of `recover`'s 4.9 on a `kaggle` pool 2,700 steps old."""
        got = self._sources.get(name, 0)
        if isinstance(got, int):
            if got < SOURCE_AFTER - 1:
                self._sources[name] = got + 1
                return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
            w = self.where[name]
            rows = ((w < 0) & (w != HOME)).nonzero().flatten()
            slots = -w[rows].to(torch.int64)
            keep = self._win[slots]
            rows, slots = rows[keep], slots[keep]
            offs = torch.empty(rows.numel(), dtype=torch.int64)
            for s in torch.unique(slots).tolist():
                run = self._run(s)
                t = run.tables[name]
                sel = (slots == s).nonzero().flatten()
                offs[sel] = run.wbase + t.start + torch.searchsorted(t.ids, rows[sel]) * t.row_bytes
            got = self._sources[name] = (rows, offs)
        return got

    def repend(self, names, *, remapped: bool = True) -> int:
        """The working copy of tables ``names`` was given back (mapped afresh over the images,
        or its pages dropped: a DRAM cache's trim or refresh, ``Compaction.trim``): the rows
        whose newest value is a run's were copied into it and are now read from the image
        again, which does not hold them. They are pending again -- the next read of such a row
        takes it from its run (:meth:`take`). Rows of the run a compaction is writing (``NEW``)
        are left alone: they are the journal's rows since its START, whose newest values are
        in a DRAM cache's dirty slots or were written home by a refresh. Returns the rows.

        ``remapped``: the working copy was mapped afresh (no page of it copied on write is left):
        the rows written home while pending (``HOME``) are read from the image as it is, not
        pending any more.

        Call order: only where nothing reads the tables (the cache paused, no step running),
        and only once no row's newest value is the journal's from before the open (the
        caller's first trim compacts those: ``WorkingCopyBound``)."""
        n = 0
        with self._lock:
            for name in names:
                w = self.where.get(name)
                if w is None:
                    continue
                self._took.discard(name)
                homed = self._homed.pop(name, []) if remapped else []
                if homed is None:   # (too many listed: _went_home)
                    idx = (w == HOME).nonzero().flatten()
                elif homed:
                    idx = torch.unique(torch.cat(homed))
                    idx = idx.masked_select(w.index_select(0, idx) == HOME)
                if homed is None or homed:
                    w.index_fill_(0, idx, 0)
                    self.pending_rows -= idx.numel()
                if name not in self._positive:
                    continue
                rows = self._positive.pop(name)
                self._positive_n.pop(name, None)
                if rows is None:
                    idx = (w > 0).nonzero().flatten()   # (a scan of the table: ~30 ms on `kaggle`)
                else:
                    # (only the rows taken or written into a run since the last repend: a
                    # refresh at nearly every recovery point scanned every table before)
                    idx = rows[0] if len(rows) == 1 else torch.unique(torch.cat(rows))
                # (one gather of their entries, index_select and masked_select, not w[idx] and
                # idx[mask] three times: on the trainer's thread, ~1 s a compaction on `kaggle`
                # behind the cache before, 3x less now)
                wi = w.index_select(0, idx)
                flip = wi > 0
                new = flip & (wi == NEW)
                if bool(new.any()):
                    self._made_positive(name, idx.masked_select(new))
                    flip &= ~new
                idx = idx.masked_select(flip)
                w.index_copy_(0, idx, wi.masked_select(flip).neg_())
                n += idx.numel()
            self.pending_rows += n
        return n

    def _made_positive(self, name: str, rows: torch.Tensor | None) -> None:
        """Rows ``rows`` (sorted, distinct; None: any) of table ``name`` may now have entries > 0
        (the lock held): the next :meth:`repend` looks at them. Past an eighth of the table's rows
        (more memory than ``where`` itself: takes without a DRAM cache never repend) it scans."""
        have = self._positive.get(name, [])
        if have is None:
            return
        n = self._positive_n.get(name, 0) + (rows.numel() if rows is not None else 0)
        if rows is None or n > self.regions[name].rows // 8:
            self._positive[name] = None
            self._positive_n.pop(name, None)
        elif rows.numel():
            have.append(rows)
            self._positive[name], self._positive_n[name] = have, n

    def pend(self, name: str, rows: torch.Tensor) -> int:
        """Rows ``rows`` (sorted, distinct) of table ``name`` are not in the working copy, and
        a compaction has just put their newest value in a run or home: pending from there
        (the run's slot, negated; ``HOME``). Used for an open's journal rows that no step has
        needed yet (``PendingRows.hand_over``): applying them instead cost a copy-on-write
        fault and a read of an image page per row, for a working copy a trim then maps afresh.
        Returns the rows made pending. (Rows pending already are left as they are.)"""
        if not rows.numel():
            return 0
        with self._lock:
            w = self._where(name)
            wi = w.index_select(0, rows)
            # (>= 0: an open's journal rows are not pending from a run (attach), and the
            # compaction gave each row it wrote a run's slot, or 0 when it went home in place)
            ok = wi >= 0
            rows, wi = rows.masked_select(ok), wi.masked_select(ok)
            home = wi == 0
            w.index_copy_(0, rows, torch.where(home, HOME, wi.neg()).to(torch.int8))
            self._list_homed(name, rows.masked_select(home))
            self.pending_rows += rows.numel()
        return rows.numel()

    def taken(self, names) -> set:
        """Those of tables ``names`` that may have rows copied in from a run (or the image) since
        their last :meth:`repend`. (Not every table with rows listed for it: a table whose rows
        only went into a run had its image's whole page cache dropped at every refresh.)"""
        with self._lock:
            return {n for n in names if n in self._took}

    def forget_home(self, name: str, rows: torch.Tensor) -> None:
        """Rows ``rows`` of table ``name`` were written into its image (a refresh), newer than
        or equal to any run's value of them: no run value of theirs counts in this process any
        more. On disk an older run's value still does, until the journal's newer record reaches
        a compaction, which tombstones it (:meth:`absorb` tombstones every row it writes home)."""
        w = self.where.get(name)
        if w is None or not rows.numel():
            return
        with self._lock:
            self.pending_rows -= int(torch.count_nonzero(w[rows] < 0))
            w[rows] = 0

    def drop_cache(self) -> None:
        """Drop the runs' pages from this process and the page cache (``Run.drop_cache``): a
        DRAM cache's budget counts them (rows taken from runs fault their pages in)."""
        with self._lock:
            for r in self.runs:
                r.drop_cache()

    def _window_rows(self, rb: int) -> torch.Tensor:
        # (the window's rows at every byte offset: Arena.rows_at_every_offset, kept per row size)
        v = self._strided.get(rb)
        if v is None:
            v = self._strided[rb] = self._window.rows_at_every_offset(rb)
        return v

    def _verify_window(self, src: torch.Tensor, rb: int) -> None:
        """Verify, each the first time only, the blocks that rows at window offsets ``src`` (``rb``
        bytes each) lie in, all their pages asked for first (``Run.will_need``)."""
        which = torch.searchsorted(self._wbases, src, right=True) - 1
        rel = src - self._wbases[which]
        g = torch.cat([rel // BLOCK, (rel + rb - 1) // BLOCK]) + self._gblocks[which].repeat(2)
        gi, runs = g.numpy(), None
        # (only the runs with blocks not yet asked for, or not yet verified: most calls, none)
        for want, act in ((~self._gadvised[gi], Run.will_need), (~self._gverified[gi], Run.verify)):
            if want.any():   # (every run's reads in flight before the first checksum waits on one)
                if runs is None:
                    runs = torch.searchsorted(self._gblocks, g, right=True) - 1
                want = torch.from_numpy(want)
                for i in torch.unique(runs[want]).tolist():
                    act(self._open_runs[i], g[(runs == i) & want] - self._open_runs[i].gblock)

    def take_all(self) -> int:
        return sum(self.take(name) for name in list(self.where))

    def forget(self, name: str) -> None:
        """Table ``name``'s rows are being replaced (a bulk load into its image): nothing of it
        is pending any more, and no run holds its newest values. Durable with :meth:`reset`,
        once the image is."""
        with self._lock:
            w = self.where.get(name)
            if w is not None:
                self.pending_rows -= int(torch.count_nonzero(w < 0))
                w.zero_()
            self._sources.pop(name, None)

    def reset_table(self, name: str) -> None:
        """After a bulk load of ``name`` is durable in its image: no value of it in the runs
        counts any more, durably (the manifest's ``reset``: runs older than the next one)."""
        with self._lock:
            if any(name in r.tables for r in self.runs):
                self.reset[name] = self.next_gen
                self._write_manifest(self.runs, self.next_gen)

    def note_resets(self, gens: dict[str, int]) -> bool:
        """Resets that the journal's reset markers commit (``gens[table]``: the generation the
        table's run values count from again; see ``MemoryPool._note_reset``), merged into
        ``reset`` at an open, before :meth:`attach`. The marker is the reset's commit point and
        the manifest holds its copy, written after it: a crash between the two leaves the
        manifest without it. True when it did lack one (:meth:`save_manifest` writes it)."""
        changed = False
        with self._lock:
            for name, gen in gens.items():
                if gen > self.reset.get(name, 0):
                    self.reset[name] = gen
                    changed = True
        return changed

    def save_manifest(self) -> None:
        """Write the manifest for the runs as they are (after :meth:`note_resets`)."""
        with self._lock:
            self._write_manifest(self.runs, self.next_gen)

    def _write_manifest(self, runs: list[Run], next_gen: int) -> None:
        doc = {"format": 1, "next_gen": next_gen, "reset": self.reset,
               "runs": [{"file": r.path.name, "gen": r.gen, "bytes": r.nbytes} for r in runs]}
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.dir / MANIFEST, json_with_crc(doc))  # (tmp, fsync, rename, fsync dir)

    def describe(self) -> dict:
        return {"runs": len(self.runs), "bytes": self.run_bytes, "rows": sum(r.entries() for r in self.runs),
                "rows_pending": self.pending_rows}

    def close(self) -> None:
        self._strided, self._sources = {}, {}
        for r in self.runs:
            r.close()
        self.runs = []
        self._window = None


def image_rows(region, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of ``region``'s image file as its page cache holds them, ``[n, row_bytes]``
    uint8: the values of rows written home while pending (``HOME``). Through a mapping of its
    own, read-only and for this call: the write-back's (``FileRegion.home``) is the compactor's,
    which drops it when it syncs."""
    region.will_need(ids)   # (its pages asked for at the disk's queue depth, not one fault after another)
    mm = mmap.mmap(region.fd, region.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        mm.madvise(mmap.MADV_RANDOM)   # (a fault reads its own page, not a readahead window)
        image = np.frombuffer(mm, dtype=np.uint8).reshape(region.rows, region.row_bytes)
        out = torch.from_numpy(image[ids.numpy()])
        del image
    finally:
        mm.close()
    return out
