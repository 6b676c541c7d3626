"""tools/writeback_model.py: its page counts against an independent count of the same ids."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from dlrm_cxl.data import SyntheticData
from dlrm_cxl.model import PRESETS
from dlrm_cxl.options import data_spec

TOOL = Path(__file__).resolve().parents[1] / "tools" / "writeback_model.py"


def _tool():
    spec = importlib.util.spec_from_file_location("writeback_model", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_writeback_model_counts_the_pages_and_bytes_the_ids_of_its_window_touch(capsys):
    tool = _tool()
    assert tool.main(["--preset", "tiny", "--windows", "2", "--dense-mb", "0"]) == 0
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.split() and ln.split()[0] == "2"]
    window, journal_gb, distinct, in_place, _, packed, wa = row[0].replace(",", "").split()

    # The same two batches, counted here without the tool's helpers.
    cfg = PRESETS["tiny"]
    data = SyntheticData(data_spec(cfg), seed=0)
    nf, b, rb = len(cfg.num_embeddings), cfg.batch_size, cfg.embedding_dim * 4
    ids = [data.batch(k).sparse.values().view(nf, b).numpy() for k in range(2)]
    rows = [np.unique(np.concatenate([i[f] for i in ids])) for f in range(nf)]
    pages = sum(len({r * rb // 4096 for r in rs} | {(r * rb + rb - 1) // 4096 for r in rs})
                + len({r * 4 // 4096 for r in rs}) for rs in rows)
    journal = sum(np.unique(i[f]).size for i in ids for f in range(nf)) * (rb + 4 + 16)
    assert int(distinct) == sum(rs.size for rs in rows)
    assert abs(float(journal_gb) - journal / 1e9) < 0.006
    assert float(in_place.rstrip("x")) == round(pages * 4096 / journal, 2)
    assert float(packed.rstrip("x")) == round(sum(rs.size for rs in rows) * (rb + 4) / journal, 2)
    assert float(wa.rstrip("x")) == round(1 + pages * 4096 / journal, 2)


def test_popularity_rank_orders_rows_by_how_often_the_data_draws_them():
    # The rank is what the generator draws before it scatters ranks over rows: rank 0 is the
    # most frequent row, and ranks are a bijection of the table's rows.
    cfg = PRESETS["small"]
    data = SyntheticData(data_spec(cfg), seed=3)
    f = int(np.argmax(cfg.num_embeddings))
    n = cfg.num_embeddings[f]                                        # 100k rows
    ranks = data.popularity_rank(f, np.arange(n))
    assert np.array_equal(np.sort(ranks), np.arange(n))
    drawn = np.concatenate([data.batch(k).sparse.values().view(len(cfg.num_embeddings), -1)[f].numpy()
                            for k in range(8)])
    rows, counts = np.unique(drawn, return_counts=True)
    assert rows[np.argmax(counts)] == np.flatnonzero(ranks == 0)[0]
    assert np.median(data.popularity_rank(f, drawn)) < n / 100   # draws concentrate on low ranks


def _home(tool, **kw):
    # One table of 64 rows of 256 bytes: 16 rows a page, 4 pages; a packed row takes 264 bytes.
    return tool._Home("t", [64], [(256, 264)], **kw)


def _window(*rows):
    w = np.zeros(64, dtype=bool)
    w[list(rows)] = True
    return [w]


def test_the_steady_model_writes_dense_pages_in_place_and_carries_or_appends_the_other_rows():
    tool = _tool()
    in_place = _home(tool, runs=False, cap=float("inf"), dense=0)
    carry = _home(tool, runs=False, cap=1e9, dense=0.25)   # a page goes home from 4 changed rows
    runs = _home(tool, runs=True, cap=1e9, dense=0.25)
    for rows, want in (((0, 1, 2, 3, 17), (2 * 4096, 4096 + 264, 4096 + 264)),
                       # the carry file holds 17 and 18 again; a new run only 18
                       ((18,), (4096, 2 * 264, 264)),
                       # 17, 18, 19, 20: page 1 is dense now and goes home; nothing is carried
                       ((19, 20), (4096, 4096, 4096))):
        before = [h.written for h in (in_place, carry, runs)]
        for h in (in_place, carry, runs):
            h.compact(_window(*rows))
        assert tuple(h.written - b for h, b in zip((in_place, carry, runs), before)) == want, rows
    assert carry.live == runs.live == 0
    # pages written in place: page 0 at once, page 1 (in place: each time it changed) at the end
    assert (in_place.pages, carry.pages, runs.pages) == (4, 2, 2)


def test_the_steady_model_writes_the_fullest_carried_page_in_place_past_its_bound():
    tool = _tool()
    carry = _home(tool, runs=False, cap=1.5 * 264, dense=0.25)
    carry.compact(_window(17, 33, 34))      # 3 rows to carry, room for 1: page 2 (two rows) goes home
    assert carry.written == 4096 + 264 and carry.live == 264
    where = carry.where[0][0]   # (row kind 0, table 0)
    assert where[17] >= 0 and where[33] == where[34] == -1

    runs = _home(tool, runs=True, cap=3 * 264, dense=0.25)
    runs.compact(_window(17, 33))           # run 1: 17, 33
    runs.compact(_window(17, 49))           # run 2: 17, 49; run 1's 17 is dead, and 4 rows of runs > 3:
    assert runs.written == 2 * 264 + 2 * 264 + 264   # run 1's live row (33) moves on into run 2
    assert runs.run_bytes == {2: 3 * 264} and runs.live == 3 * 264
    assert runs.moved == 264 and runs.pages == 0 and carry.pages == 1
