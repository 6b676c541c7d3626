"""The row overlay's part in a compaction (:class:`OverlayCompaction`, a base of
:class:`memory_pool.overlay.Overlay`): which of a compaction's rows go home in place and which
into its new run, the first-in first-out cleaning of old runs, and the new run written and
committed -- in the order memory_pool/overlay.py's docstring gives. Runs on the compactor's
thread; the state it works on (``where``, the runs, the lock) is the overlay's."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .arena import PAGE, populated
from . import fileio
from .durable import fsync_dir
from .records import copy_rows, copy_rows_at
from .rowsets import isin_sorted
from .runfile import HEAD, Gathered, Run, RunCorruptError, write_run

__all__ = ["OverlayCompaction", "Plan", "DENSE_FRACTION", "EVICT_FRACTION", "NEW", "HOME", "MAX_RUNS"]

DENSE_FRACTION = 0.25             # a page with at least this much of it changed is written home in place
EVICT_FRACTION = 0.75             # carried rows past this much of the bound go home instead of moving on
NEW = 127                         # ``where`` of a row going into the run being written (no run's slot)
MAX_RUNS = NEW - 1                # slots 1..126 (``where`` is int8: half the memory an open writes)
# ``where`` of a row a compaction wrote home in place while it was pending: its newest value is
# the image's, and this process's working copy may hold an older one on a page it copied on
# write -- so it stays pending, and a read takes it from the image (Overlay._values) until the
# working copy is mapped afresh (Overlay.repend). In this process only: on disk the image holds
# it and no run does (a tombstone, or the oldest run dropped).
HOME = -128


@dataclass
class Plan:
    """A compaction in the making (see :meth:`Overlay.absorb`)."""

    gen: int
    tables: dict = field(default_factory=dict)   # name -> [row bytes, ids, rows (or a Gathered), tombs]
    cleaned: list = field(default_factory=list)  # runs this compaction drops
    written_home: int = 0                        # bytes written in place
    home_tables: set = field(default_factory=set)  # tables written in place (to be synced)
    run: Run | None = None
    absorbed: dict = field(default_factory=dict)  # name -> the journal's rows it wrote (sorted): pend_absorbed



class OverlayCompaction:
    """A compaction's part of :class:`~memory_pool.overlay.Overlay` (see the module)."""

    # The rows the last finished compaction (or trim) wrote, per table, for pend_absorbed: set by
    # finish(), forgotten once used (Compaction.settled); replaced, never changed in place
    last_absorbed: dict = {}

    # -- compaction (the compactor's thread; see the module docstring for the order)
    def begin(self) -> None:
        if self.broken:
            raise RuntimeError(f"the row overlay is unusable after an error ({self.broken}): reopen the pool")
        self._plan = Plan(self.next_gen)

    def absorb(self, name: str, ids: torch.Tensor, raw: torch.Tensor, *, dense: float = DENSE_FRACTION,
               superseded: torch.Tensor | None = None) -> None:
        """A compaction's newest values of table ``name`` (``ids`` sorted and distinct, ``raw``
        their rows): the pages where at least ``dense`` of the bytes changed -- carried rows
        counted in -- go home in place (their carried rows with them, from their runs); every
        other row goes into the new run. ``superseded`` (sorted, distinct): rows of records left
        out because a refresh wrote a newer value into the image (``absorb_rows``); those not
        in ``ids`` (no record here newer than the refresh) are home already: no run value of
        theirs counts any more, tombstoned as rows written home are."""
        plan, region = self._plan, self.regions[name]
        plan.absorbed[name] = ids
        rb = region.row_bytes
        per = PAGE // rb
        w = self.where.get(name)
        if w is not None:
            # The window's rows and the carried ones, sorted: one pass over the table (a mask),
            # not a sort of their union (on `kaggle` ~1 M carried rows a table).
            mask = w != 0
            mask &= w != HOME   # (home already)
            mask.index_fill_(0, ids, True)
            rows = mask.nonzero().flatten()
            del mask
        else:
            rows = ids
        if per < 2:
            home = rows
        else:
            page = rows // per
            cnt = torch.bincount(page, minlength=int(page[-1]) + 1 if page.numel() else 0)
            home = rows[(cnt * rb >= dense * PAGE)[page]]
        in_window = isin_sorted(home, ids)
        values = populated(home.numel() * rb).view(home.numel(), rb)
        win, rest = in_window.nonzero().flatten(), (~in_window).nonzero().flatten()
        if win.numel():
            copy_rows_at(values, win, raw, torch.searchsorted(ids, home[win]))
        if rest.numel():
            copy_rows(values, rest, self.run_values(name, home[rest]))
        plan.written_home += region.write_back(home, values)
        if home.numel():
            plan.home_tables.add(name)
        # (every row written home: a row a refresh wrote home is 0 in ``where`` and may still
        # have an older value in a run; write() keeps the tombstones a surviving run needs)
        home_already = superseded[~isin_sorted(superseded, ids)] if superseded is not None else None
        if home_already is not None and home_already.numel():
            home_all = torch.unique(torch.cat([home, home_already]))
        else:
            home_all = home
        tombs = home_all if w is not None and home_all.numel() else torch.empty(0, dtype=torch.int64)
        keep = ~isin_sorted(ids, home)
        if bool(keep.all()):
            entries, kept = ids, raw
        else:
            # (not copied out: write_run gathers them into its staging buffer, runfile.Gathered)
            at = keep.nonzero().flatten()
            entries, kept = ids.index_select(0, at), Gathered(raw, at)
        with self._lock:
            if w is not None:
                # A pending row stays pending, from the image (HOME): a page of the working copy
                # copied on write before would keep an older value of it. (It was taken into the
                # working copy first before: a copy-on-write fault of a home page a row, 3/4 of
                # a compaction's CPU on `kaggle` behind a DRAM cache, where every run row is
                # pending after a trim.) (Pending again meanwhile, if a refresh ran beside this
                # compaction: repend.)
                self._went_home(name, w, home_all)
            # (under the lock: a take of a row pending from this run reads it here, _planned)
            plan.tables[name] = [rb, entries, kept, tombs]
            if entries.numel():
                # Its slot is given when the run is written (write). A row pending from a run
                # stays pending, from this one: a DRAM cache's trim or refresh gave the working
                # copy back (repend), so it does not hold the row. (Made not pending here, a
                # clean cached row read the image's old value once its slot was gone: the
                # end-of-run digest of a pool behind a cache, after a background compaction.)
                we = self._where(name)
                we[entries] = torch.where(we[entries] < 0, -NEW, NEW).to(torch.int8)
                # (listed for repend once write() gives them a slot, not now: a repend leaves
                # NEW rows alone and listed them again, and at the runs' bound a compaction
                # runs through a dozen refreshes -- each gathered the window's millions of
                # entries on the trainer's thread)

    def clean(self, bound: int) -> None:
        """First in, first out: drop the oldest runs while the runs (the new one counted in)
        hold more than ``bound`` bytes. Their still-newest rows move into the new run, or go
        home in place when the carried rows alone hold more than 3/4 of the bound (or when
        ``bound`` is 0: the overlay is being emptied)."""
        plan = self._plan

        def new_bytes():
            return sum(HEAD.size + (t[1].numel() * (t[0] + 8)) + 8 * t[3].numel() for t in plan.tables.values())

        total = self.run_bytes + new_bytes()
        evict = None
        for run in list(self.runs):
            # (and while no slot would be left for the new run: at most MAX_RUNS live runs)
            if total <= bound and len(self.runs) - len(plan.cleaned) < MAX_RUNS:
                break
            if evict is None:
                # (counted only when a run is cleaned, before any moves: passes over every
                # table's ``where``, ~0.1 s of a `kaggle` compaction, that most compactions
                # below the bound had no use for)
                # (rows in runs: not 0, not HOME; a count of each, not a mask of both)
                carried = sum((int(torch.count_nonzero(w)) - int(torch.count_nonzero(w == HOME)))
                              * (self.regions[n].row_bytes + 8) for n, w in self.where.items())
                evict = bound == 0 or carried > EVICT_FRACTION * bound
            for name, t in run.tables.items():
                w = self.where.get(name)
                if w is None or not self._counts(run, name) or not t.ids.numel():
                    continue
                live = t.ids[w[t.ids].abs() == run.slot]
                if not live.numel():
                    continue
                vals = run.rows(name, live, bulk=True)
                if evict:
                    # Each page is read and written whole, so the rows of newer runs in the
                    # same pages go home with these (``_page_mates``), tombstoned in the new run
                    # where their runs outlive it: on `kaggle` at the bound most of these rows
                    # are alone in their page of this run, not of the runs.
                    mates = self._page_mates(name, w, live, run.slot)
                    if mates.numel():
                        # (disjoint: this run's live rows, and rows whose newest value is another run's)
                        rows, at_live, at_mates = _merge_sorted(live, mates)
                        merged = torch.empty(rows.numel(), t.row_bytes, dtype=torch.uint8)
                        copy_rows(merged, at_live, vals)
                        copy_rows(merged, at_mates, self.run_values(name, mates))
                        live, vals = rows, merged
                        cur = self._plan_table(name, t.row_bytes)
                        with self._lock:
                            cur[3] = torch.unique(torch.cat([cur[3], mates]))
                    # (no older run holds this run's rows: no tombstone is needed for them)
                    plan.written_home += self.regions[name].write_back(live, vals)
                    plan.home_tables.add(name)
                    with self._lock:
                        self._went_home(name, w, live)  # (a pending row: from the image, HOME)
                else:
                    # A pending row moves on pending: write() gives it the new run's slot with its
                    # sign, and take() and peek() read it from there (_values). (It was taken
                    # into the working copy here before: behind a DRAM cache, where every run
                    # row is pending again after a trim, that was a copy-on-write fault of a
                    # page of the home per row -- 3/4 of a compaction's CPU on `kaggle` once the
                    # runs reached their bound.)
                    # (merged, not sorted: the two are sorted and disjoint -- a row the window
                    # changed is NEW, not this run's -- and each row is copied once; a sort of
                    # their union and three copies of the rows were ~half of a clean's CPU)
                    cur = self._plan_table(name, t.row_bytes)
                    ids, at_cur, at_live = _merge_sorted(cur[1], live)
                    rows = populated(ids.numel() * t.row_bytes).view(ids.numel(), t.row_bytes)
                    if isinstance(cur[2], Gathered):
                        cur[2].copy_into(rows, at_cur)
                    else:
                        copy_rows(rows, at_cur, cur[2])
                    copy_rows(rows, at_live, vals)
                    with self._lock:  # (ids and rows replaced together: _planned reads them)
                        plan.tables[name] = [cur[0], ids, rows, cur[3]]
            plan.cleaned.append(run)
            total = self.run_bytes - sum(r.nbytes for r in plan.cleaned) + new_bytes()

    def _plan_table(self, name: str, rb: int) -> list:
        """The new run's entry for table ``name`` ([row bytes, ids, rows, tombstones]), made
        empty if it has none yet."""
        cur = self._plan.tables.get(name)
        if cur is None:
            with self._lock:
                cur = self._plan.tables[name] = [rb, torch.empty(0, dtype=torch.int64),
                                                 torch.empty(0, rb, dtype=torch.uint8), torch.empty(0, dtype=torch.int64)]
        return cur

    def _page_mates(self, name: str, w: torch.Tensor, rows: torch.Tensor, slot: int) -> torch.Tensor:
        """The rows (sorted) in the pages of ``rows`` (sorted) of table ``name`` whose newest
        value is another live run's (not this compaction's window, ``NEW``; not home)."""
        per = PAGE // self.regions[name].row_bytes
        if per < 2:
            return torch.empty(0, dtype=torch.int64)
        pages = torch.unique_consecutive(rows // per)
        cand = (pages.unsqueeze(1) * per + torch.arange(per)).flatten()
        cand = cand[cand < w.numel()]
        wc = w.index_select(0, cand)
        slots = wc.to(torch.int16).abs_()   # (int16: abs of HOME, -128, fits)
        return cand[(wc != 0) & (wc != HOME) & (slots != NEW) & (slots != slot)]

    def _went_home(self, name: str, w: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows ``rows`` (sorted, distinct) of table ``name`` were written home in place (the
        lock held): no run value of theirs counts; a pending one stays pending, from the image
        (``HOME``), listed for :meth:`repend`."""
        pend = w.index_select(0, rows) < 0
        w.index_copy_(0, rows, torch.where(pend, HOME, 0).to(torch.int8))
        self._list_homed(name, rows.masked_select(pend))

    def _list_homed(self, name: str, homed: torch.Tensor) -> None:
        """Rows ``homed`` of table ``name`` were made ``HOME`` (the lock held): listed for the
        next remapped :meth:`repend`, which makes them not pending."""
        have = self._homed.get(name, [])
        if not homed.numel() or have is None:
            return
        # (past an eighth of the table's rows -- more memory than ``where`` itself, between two
        # trims that may be several compactions apart -- repend scans for HOME instead: None)
        have.append(homed)
        over = sum(h.numel() for h in have) > self.regions[name].rows // 8
        self._homed[name] = None if over else have

    def write(self) -> int:
        """Write the new run (if it holds anything), durably; give it its slot. Returns its bytes."""
        plan = self._plan
        # A tombstone only has to hide a row's value in a run that outlives this compaction.
        surviving = [r for r in self.runs if r not in plan.cleaned]
        for name, t in plan.tables.items():
            if t[3].numel():
                held = torch.zeros(t[3].numel(), dtype=torch.bool)
                for r in surviving:
                    if name in r.tables and self._counts(r, name):
                        held |= isin_sorted(t[3], r.tables[name].ids)
                t[3] = t[3][held]
        tables = {n: tuple(t) for n, t in plan.tables.items() if t[1].numel() or t[3].numel()}
        if not tables:
            return 0
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"run-{plan.gen:016x}.bin"
        write_run(path, plan.gen, tables)
        run = Run.open(path)
        run.verified[:] = True  # (its rows are the ones just written)
        with self._lock:
            run.slot = self._new_slot(plan)
            plan.run = run
            for name, t in plan.tables.items():
                w = self.where.get(name)
                if w is not None and t[1].numel():
                    # The window's rows (NEW so far) and the moved rows (pending or not, as before).
                    wt = w.index_select(0, t[1])
                    w.index_copy_(0, t[1], torch.where(wt < 0, -run.slot, run.slot).to(torch.int8))
                    # (those > 0 listed for repend: a moved row is already, it keeps its sign)
                    self._made_positive(name, t[1].masked_select(wt > 0))
        return run.nbytes

    def _planned(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """The values of rows pending from the run this compaction is writing (``where`` =
        ``-NEW``, :meth:`absorb`), from its plan (the lock held)."""
        plan = self._plan
        if plan is None or name not in plan.tables:
            raise RuntimeError(f"the row overlay is unusable after an error ({self.broken}): reopen the pool")
        t = plan.tables[name]
        at = torch.searchsorted(t[1], rows)
        return t[2].select(at) if isinstance(t[2], Gathered) else t[2][at]

    def _new_slot(self, plan: Plan) -> int:
        """The slot of the run being written: a free one, or else the slot of a run this
        compaction drops.

        Why the second: with MAX_RUNS live runs every slot is held, and a cleaned run gives its
        slot back only in :meth:`finish`, after the manifest and the journal -- the 127th
        compaction failed (IndexError) and left the overlay unusable, and so did every compaction
        after a reopen, which finds the same MAX_RUNS runs. :meth:`clean` drops at least one run
        then, and once it has, no entry of ``where`` names a cleaned run any more: its live rows
        were moved into the new run (their entries become the new run's slot in :meth:`write`)
        or written home (0). So its slot can name the new run; the cleaned run keeps slot 0
        (which names no run: :meth:`_run` cannot find it, :meth:`finish` frees nothing for it)
        until its file goes."""
        if self._free_slots:
            return self._free_slots.pop()
        for r in plan.cleaned:
            if r.slot:
                slot, r.slot = r.slot, 0
                self._win[slot] = False
                return slot
        raise RunCorruptError(f"{self.dir}: every one of the {MAX_RUNS} run slots is held and this compaction "
                              f"drops no run", hint="reopen the pool; if this persists, report it (a bug)")

    @property
    def tables_home(self) -> set:
        """The tables this compaction wrote in place (the pool syncs them before :meth:`commit`)."""
        return set(self._plan.home_tables) if self._plan is not None else set()

    @property
    def written_home(self) -> int:
        return self._plan.written_home if self._plan is not None else 0

    @property
    def changed(self) -> bool:
        """This compaction wrote a run or drops one: the manifest must say so."""
        p = self._plan
        return p is not None and (p.run is not None or bool(p.cleaned))

    def commit(self) -> None:
        """Replace the manifest: the new run counts, the cleaned ones no longer do."""
        plan = self._plan
        with self._lock:
            runs = [r for r in self.runs if r not in plan.cleaned] + ([plan.run] if plan.run is not None else [])
            self._write_manifest(runs, plan.gen + 1)
            self.runs = runs
            self.next_gen = plan.gen + 1

    def finish(self) -> None:
        """After the journal dropped the window: delete the cleaned runs' files."""
        plan, self._plan = self._plan, None
        if plan is None:
            return
        self.last_absorbed = plan.absorbed
        with self._lock:
            for r in plan.cleaned:
                r.close()
                if r.slot:  # (0: its slot went to the new run, _new_slot)
                    self._win[r.slot] = False
                    self._free_slots.append(r.slot)
                fileio.unlink(r.path, missing_ok=True)
        if plan.cleaned:
            fsync_dir(self.dir)

    def pend_absorbed(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (sorted, distinct) of table ``name`` that the last finished compaction
        wrote (:attr:`last_absorbed`) read from where it
        put them from now on: pending from its run (the slot negated), or from the image
        (``HOME``: a page of the working copy copied on write keeps an older value). Returns
        the mask of ``rows`` that read so now (already pending ones included); a row the
        compaction did not write, or one in a run being written (``NEW``), is not.

        Why: a DRAM cache's dirty slot whose value a compaction put home is made clean
        (``CacheArena.clean_through``), and dropped at its eviction; the working copy under it
        holds an older value (the cache never wrote it there), so the next read must not take
        that. Call order: no compaction running, nothing reading the table (a recovery point,
        the cache paused)."""
        absorbed = self.last_absorbed.get(name)
        ok = isin_sorted(rows, absorbed) if absorbed is not None else torch.zeros(rows.numel(), dtype=torch.bool)
        if not bool(ok.any()):
            return ok
        at = ok.nonzero().flatten()
        r = rows.index_select(0, at)
        with self._lock:
            w = self._where(name)
            wr = w.index_select(0, r)
            mag = wr.to(torch.int16).abs_()
            run = (wr > 0) & (mag != NEW)   # (its run's value, not pending yet)
            home = wr == 0                  # (written home in place)
            w.index_copy_(0, r.masked_select(run), wr.masked_select(run).neg())
            homed = r.masked_select(home)
            w.index_fill_(0, homed, HOME)
            self._list_homed(name, homed)
            self.pending_rows += int(run.sum()) + homed.numel()
            ok.index_copy_(0, at, mag != NEW)
        return ok

    def fail(self, exc: BaseException) -> None:
        """A compaction failed half way: the overlay in memory no longer matches the files."""
        self.broken = f"{type(exc).__name__}: {exc}"
        self._plan = None


def _merge_sorted(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(merged, places of a, places of b)`` of two sorted, distinct and disjoint int64 tensors:
    ``merged[places of a] == a`` and ``merged[places of b] == b``. An element's place is its
    own index plus the count of the other's elements below it."""
    at_a = torch.searchsorted(b, a).add_(torch.arange(a.numel()))
    at_b = torch.searchsorted(a, b).add_(torch.arange(b.numel()))
    merged = torch.empty(a.numel() + b.numel(), dtype=torch.int64)
    merged[at_a] = a
    merged[at_b] = b
    return merged, at_a, at_b

