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

It reads no pool and times nothing: the counts are exact for the ids drawn. What it leaves out:
the page cache's own write-back of pages dirtied between compactions (passes on `kaggle`), and
a log-structured home's cleaning.
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
    return p.parse_args(argv)


def pages_of(rows: np.ndarray, row_bytes: int) -> int:
    """Distinct 4 KiB pages that rows (sorted, distinct) of ``row_bytes`` each land in."""
    if rows.size == 0:
        return 0
    first, last = rows * row_bytes // PAGE, (rows * row_bytes + row_bytes - 1) // PAGE
    return int(np.unique(np.concatenate([first, last])).size)


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = PRESETS[a.preset]
    windows = sorted({int(w) for w in a.windows.split(",") if w})
    if not windows or windows[0] < 1:
        raise SystemExit(f"--windows must be positive step counts, got {a.windows!r}")
    spec = data_spec(cfg)
    data = SyntheticData(spec, seed=a.seed, alpha=a.alpha)
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
            ids = data.batch(k).sparse.values().view(nf, b).numpy()
            for f in range(nf):
                u = np.unique(ids[f])
                touched[f][u] = True
                journal += u.size * (row_bytes + STATE_ROW_BYTES + 2 * ID_BYTES)
            journal += a.dense_mb * 1e6
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
