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
