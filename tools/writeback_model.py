#!/usr/bin/env python
"""What the write-back of a journal costs in device bytes, by layout: a model of issue #9's
write amplification target, from the ids the trainer really draws.

Emulated pmem makes each step durable as a sequential journal of the touched rows' after-images
(and the dense state); a compaction then writes the newest value of every row it holds back
into the table images, in place. A 256-byte row alone in its 4 KiB page costs the whole page.
This tool replays the synthetic data's ids for windows of W steps (the journal a compaction
finds) and counts, per window, the bytes that write-back costs for three layouts of the images:

* ``in place``: the images as they are (row ``r`` of a table at byte ``r * row_bytes``): one
  4 KiB page per distinct page the window's rows land in (rows and their Adagrad state);
* ``by frequency``: the same, with every table's rows laid out hottest first (the data's true
  popularity order, which a real layout could only approximate): the best a hot/cold layout of
  an in-place image can do;
* ``packed``: only the distinct rows' bytes, as a log-structured home (rows appended densely)
  would write them: the lower bound of any write-back.

Each is printed as a multiple of the journal's bytes for the window; the write amplification of
a run is about 1 + that (the journal itself is written once, plus its record headers).

    python tools/writeback_model.py                                # kaggle, windows 30..1000
    python tools/writeback_model.py --preset small --windows 120,480

``--steady S`` instead runs S steps with a compaction every ``--every`` steps (120: the 1 GiB
threshold on ``kaggle``) and prints the write amplification so far, every few compactions, for
three homes a compaction could write to:

* ``in place``: every row the window changed, its whole page (what the pool does);
* ``carry C``: only pages where at least ``--dense`` of the page changed since it was last
  written are written in place; the other rows are *carried* in one packed overlay file of at
  most C MB, rewritten whole at each compaction (past C, the pages with the most carried bytes
  are written in place until it fits);
* ``runs C``: the same split, but each compaction appends its sparse rows as a new packed run
  and leaves older runs alone; past C MB of runs the oldest run's still-newest rows are copied
  into the new one and it is dropped (first-in first-out cleaning, as a log-structured store).

    python tools/writeback_model.py --steady 2400 --every 120 --cap 512
    python tools/writeback_model.py --steady 9600 --every 120 --cap 2048   # what memory_pool/overlay.py does

Run long enough for the run files to reach the bound and the carried rows to settle: on
``kaggle`` with ``--cap 2048`` the runs reach the bound after ~2,900 steps and the carried rows
settle at ~1.07 GB (9,600 steps: 1.43x since the row before, steady). With ``--dense 0.5`` the
carried rows outgrow the bound after ~5,000 steps and the steady state is 3.15x, worse than in
place: a 3,600-step run shows neither.

Its last two columns are the runs home's pages written in place per compaction and the bytes its
cleaning moved, since the row before: what a compaction's CPU follows -- a page home costs ~24 us
of the machine's CPU on the 2-core VM, a row packed ~0.05 us (``tools/bench_page_rmw.py``). With
``--every 210`` (the 1 GiB threshold at the window `kaggle` gets behind a DRAM cache) the pages
grow from ~33 k a compaction to ~80 k at 2,520 steps and ~103 k at 5,040, with the carried rows.

It reads no pool and times nothing: the counts are exact for the ids drawn. What it leaves out:
the page cache's own write-back of pages dirtied between compactions (passes on `kaggle`); in
``--steady``, the reads, and the index a carried or run row needs to be found at open.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from dlrm_cxl.data import SyntheticData  # noqa: E402
from dlrm_cxl.model import PRESETS  # noqa: E402
from dlrm_cxl.options import data_spec  # noqa: E402

PAGE = 4096
ID_BYTES = 8          # each row record keeps its id
STATE_ROW_BYTES = 4   # the row-wise Adagrad state: one float per row, its own table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="kaggle", choices=sorted(PRESETS))
    p.add_argument("--windows", default="30,120,240,480,1000",
                   help="steps between compactions to model, comma-separated (default 30,120,240,480,1000)")
    p.add_argument("--alpha", type=float, default=1.05, help="the ids' power-law exponent (the trainer's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense-mb", type=float, default=4.03,
                   help="dense state made durable per step, MB (what `dlrm-cxl train` reports: 4.03 for small/kaggle)")
    p.add_argument("--steady", type=int, default=0, metavar="S",
                   help="simulate S steps of compactions instead (see the module's docstring)")
    p.add_argument("--every", type=int, default=120, help="--steady: steps between compactions (default 120)")
    p.add_argument("--cap", type=float, default=512, help="--steady: the carried/run bytes' bound, MB (default 512)")
    p.add_argument("--dense", type=float, default=0.25,
                   help="--steady: the changed fraction of a page from which it is written in place (default 0.25)")
    return p.parse_args(argv)


def pages_of(rows: np.ndarray, row_bytes: int) -> int:
    """Distinct 4 KiB pages that rows (sorted, distinct) of ``row_bytes`` each land in."""
    if rows.size == 0:
        return 0
    first, last = rows * row_bytes // PAGE, (rows * row_bytes + row_bytes - 1) // PAGE
    return int(np.unique(np.concatenate([first, last])).size)


def _draw(data, k: int, marks: list[np.ndarray], row_bytes: int, dense_mb: float) -> float:
    """Mark step ``k``'s rows in ``marks`` (a bool mask per table); the journal bytes it adds."""
    ids = data.batch(k).sparse.values().view(len(marks), -1).numpy()
    added = dense_mb * 1e6
    for f, mark in enumerate(marks):
        u = np.unique(ids[f])
        mark[u] = True
        added += u.size * (row_bytes + STATE_ROW_BYTES + 2 * ID_BYTES)
    return added


class _Home:
    """One home layout in ``--steady``: its bytes written so far, and which rows it holds
    outside the images (``where[kind][table][row]``: -1 in the image, else the run holding the
    row's newest value; ``carry`` keeps a single run, rewritten whole)."""

    def __init__(self, name: str, sizes: list[int], kinds: list[tuple[int, int]], *, runs: bool, cap: float,
                 dense: float):
        self.name, self.kinds, self.runs, self.cap, self.dense = name, kinds, runs, cap, dense
        self.where = [[np.full(n, -1, dtype=np.int32) for n in sizes] for _ in kinds]
        self.run_bytes: dict[int, float] = {}
        self.written = 0.0
        self.pages = 0          # pages written in place so far (dense and evicted)
        self.moved = 0.0        # bytes a cleaning moved from an old run into a new one so far
        self.seq = 0

    def compact(self, window: list[np.ndarray]) -> None:
        """Write back a window's changed rows (``window[table]``: a bool mask). Everything is
        decided first (dense pages, then pages evicted past the bound), then written once."""
        self.seq += 1
        r = self.seq
        for ki, (image_bytes, _) in enumerate(self.kinds):
            per = PAGE // image_bytes
            for t, changed in enumerate(window):
                where = self.where[ki][t]
                rows = np.flatnonzero((where >= 0) | changed)
                pages, inv, cnt = np.unique(rows // per, return_inverse=True, return_counts=True)
                full = cnt * image_bytes >= self.dense * PAGE
                self.written += int(full.sum()) * PAGE
                self.pages += int(full.sum())
                where[rows[full[inv]]] = -1
                if self.runs:   # only this window's sparse rows go into the new run
                    mine = np.flatnonzero(changed)
                    mine = mine[~full[np.searchsorted(pages, mine // per)]]
                else:           # every carried row is written again
                    mine = rows[~full[inv]]
                where[mine] = r
        if self.live > self.cap:
            self._evict(self.live - self.cap)
        if not self.runs:
            self.run_bytes = {}
        self.run_bytes[r] = self._count(r)
        self.written += self.run_bytes[r]
        while self.runs and sum(self.run_bytes.values()) > self.cap and len(self.run_bytes) > 1:
            old = min(self.run_bytes)       # first in, first out: its still-newest rows move on
            moved = self._count(old)
            for ws in self.where:
                for where in ws:
                    where[where == old] = r
            del self.run_bytes[old]
            self.run_bytes[r] += moved
            self.written += moved
            self.moved += moved

    def _count(self, run: int) -> float:
        """Bytes of the rows whose newest value is in ``run``."""
        return sum(int((w == run).sum()) * packed for (_, packed), ws in zip(self.kinds, self.where) for w in ws)

    @property
    def live(self) -> float:
        """Bytes of rows whose newest value is outside the images."""
        return sum(int((w >= 0).sum()) * packed for (_, packed), ws in zip(self.kinds, self.where) for w in ws)

    def _evict(self, excess: float) -> None:
        """Write in place the pages holding the most carried bytes until ``excess`` is gone.
        (What they held in a run stays there, dead, until that run is cleaned.)"""
        cands = []
        for ki, (image_bytes, packed_bytes) in enumerate(self.kinds):
            per = PAGE // image_bytes
            for t, where in enumerate(self.where[ki]):
                rows = np.flatnonzero(where >= 0)
                pages, cnt = np.unique(rows // per, return_counts=True)
                cands += [(c * packed_bytes, ki, t, pg) for pg, c in zip(pages.tolist(), cnt.tolist())]
        cands.sort(key=lambda c: -c[0])
        for nbytes, ki, t, pg in cands:
            if excess <= 0:
                break
            per = PAGE // self.kinds[ki][0]
            self.where[ki][t][pg * per:(pg + 1) * per] = -1
            self.written += PAGE
            self.pages += 1
            excess -= nbytes

    @property
    def held(self) -> float:
        """Bytes of the run files (the newest values and, in runs, the dead ones not cleaned yet)."""
        return sum(self.run_bytes.values())


def steady(a, cfg, data) -> int:
    """``--steady``: compactions every ``a.every`` steps for ``a.steady`` steps, three homes."""
    row_bytes = cfg.embedding_dim * 4
    kinds = [(row_bytes, row_bytes + ID_BYTES), (STATE_ROW_BYTES, STATE_ROW_BYTES + ID_BYTES)]
    cap = a.cap * 1e6
    homes = [_Home("in place", cfg.num_embeddings, kinds, runs=False, cap=0, dense=0),
             _Home(f"carry {a.cap:g}", cfg.num_embeddings, kinds, runs=False, cap=cap, dense=a.dense),
             _Home(f"runs {a.cap:g}", cfg.num_embeddings, kinds, runs=True, cap=cap, dense=a.dense)]
    homes[0].cap = float("inf")  # (dense=0: every changed page is written: nothing is carried)
    window = [np.zeros(n, dtype=bool) for n in cfg.num_embeddings]
    journal = 0.0
    print(f"# preset {a.preset}: a compaction every {a.every} steps; pages written in place from {a.dense:.0%} "
          f"changed; carried/run bytes bounded at {a.cap:g} MB. WA = (journal + write-back) / journal, so far")
    print(f"{'steps':>6} {'journal GB':>10} " + " ".join(f"{h.name:>14}" for h in homes) +
          f" {'carry file MB':>13} {'run files MB':>12} {'runs: pages/compaction':>22} {'moved MB':>8}"
          f"   (in brackets: WA since the row before; the last two: the runs home, since the row before)")
    last_j, last_w = 0.0, [0.0] * len(homes)
    last_pages, last_moved, last_k = 0, 0.0, 0
    report = max(1, (a.steady // a.every) // 10) * a.every
    for k in range(a.steady):
        journal += _draw(data, k, window, row_bytes, a.dense_mb)
        if (k + 1) % a.every == 0:
            for h in homes:
                h.compact(window)
            for w in window:
                w[:] = False
            if (k + 1) % report == 0 or k + 1 == a.steady:
                print(f"{k + 1:>6} {journal / 1e9:>10.2f} " +
                      " ".join(f"{1 + h.written / journal:>5.2f}x ({1 + (h.written - w) / (journal - last_j):.2f}x)"
                               for h, w in zip(homes, last_w)) +
                      f" {homes[1].held / 1e6:>13.0f} {homes[2].held / 1e6:>12.0f}"
                      f" {(homes[2].pages - last_pages) / ((k + 1 - last_k) // a.every):>22,.0f}"
                      f" {(homes[2].moved - last_moved) / 1e6:>8.0f}", flush=True)
                last_j, last_w = journal, [h.written for h in homes]
                last_pages, last_moved, last_k = homes[2].pages, homes[2].moved, k + 1
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = PRESETS[a.preset]
    windows = sorted({int(w) for w in a.windows.split(",") if w})
    if not windows or windows[0] < 1:
        raise SystemExit(f"--windows must be positive step counts, got {a.windows!r}")
    spec = data_spec(cfg)
    data = SyntheticData(spec, seed=a.seed, alpha=a.alpha)
    if a.steady:
        if a.every < 1 or a.steady < a.every:
            raise SystemExit(f"--steady must be at least --every (>= 1), got {a.steady} and {a.every}")
        return steady(a, cfg, data)
    nf, b = len(cfg.num_embeddings), cfg.batch_size
    row_bytes = cfg.embedding_dim * 4
    touched = [np.zeros(n, dtype=bool) for n in cfg.num_embeddings]
    journal = 0.0
    print(f"# preset {a.preset}: {nf} tables, {sum(cfg.num_embeddings):,} rows of {row_bytes} B (+{STATE_ROW_BYTES} B "
          f"of Adagrad state); batch {b}; ids: power law alpha={a.alpha}, seed {a.seed}; dense {a.dense_mb} MB/step")
    print(f"{'window':>7} {'journal GB':>10} {'distinct rows':>13} {'in place':>9} {'by frequency':>12} "
          f"{'packed':>7} {'WA in place':>11}")
    k = 0
    for w in windows:
        while k < w:
            journal += _draw(data, k, touched, row_bytes, a.dense_mb)
            k += 1
        distinct = in_place = by_freq = 0
        for f in range(nf):
            rows = np.flatnonzero(touched[f])
            distinct += rows.size
            in_place += (pages_of(rows, row_bytes) + pages_of(rows, STATE_ROW_BYTES)) * PAGE
            ranks = np.sort(data.popularity_rank(f, rows))
            by_freq += (pages_of(ranks, row_bytes) + pages_of(ranks, STATE_ROW_BYTES)) * PAGE
        packed = distinct * (row_bytes + STATE_ROW_BYTES)
        print(f"{w:>7} {journal / 1e9:>10.2f} {distinct:>13,} {in_place / journal:>8.2f}x {by_freq / journal:>11.2f}x "
              f"{packed / journal:>6.2f}x {1 + in_place / journal:>10.2f}x")
    print("\nin place / by frequency / packed: write-back bytes of a compaction after that many steps, as a multiple "
          "of the journal's bytes for them. WA in place: 1 + in place (the journal, then its write-back).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
