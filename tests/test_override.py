"""Deliberate changes of an existing pool: ``train --override lr,dense_lr,data`` (issue #28).

Without the flag a changed learning rate or data file is refused (exit 2) with a hint that names
it; with it the change applies from the pool's step on and is recorded in the pool's history.
"""

from __future__ import annotations

import json

from memory_pool import MemoryPool
from test_cli import DATA, DIGEST_RE, TINY, TSV, assert_clean_error, run_main

OTHER_TSV = DATA / "criteo_rows_101_200.tsv"


def _meta(pool) -> dict:
    with MemoryPool.open(pool, read_only=True, rows=False) as p:
        return p.meta


def _digest(out: str) -> str:
    return DIGEST_RE.findall(out)[-1]


def test_a_changed_learning_rate_is_refused_with_a_hint_and_applied_with_override(tmp_path):
    pool, same = tmp_path / "pool", tmp_path / "same"
    for p in (pool, same):
        assert run_main("train", "--pool", p, *TINY, "--tier", "pmem", "--steps", 3)[0] == 0
    code, _, err = run_main("train", "--pool", pool, *TINY, "--steps", 5, "--lr", 0.01)
    assert_clean_error(code, err, 2, "embedding_optimizer differ", "--override lr")
    assert _meta(pool).get("history") is None   # refused: nothing changed

    code, out, err = run_main("train", "--pool", pool, *TINY, "--steps", 5, "--lr", 0.01, "--dense-lr", 0.002,
                              "--override", "lr,dense_lr")
    assert code == 0, err
    meta = _meta(pool)
    assert meta["history"] == [{"step": 3, "override": {"lr": [0.05, 0.01], "dense_lr": [0.01, 0.002]}}]
    assert meta["model"]["embedding_optimizer"]["lr"] == 0.01 and meta["model"]["dense_lr"] == 0.002
    # the new rates were used: the state differs from the same pool continued without them
    code, out_same, _ = run_main("train", "--pool", same, *TINY, "--steps", 5)
    assert code == 0 and _digest(out) != _digest(out_same)
    # and they stay: a later resume without flags goes on with them (no second history entry)
    code, _, err = run_main("train", "--pool", pool, "--threads", 1, "--no-progress", "--steps", 6)
    assert code == 0, err
    assert len(_meta(pool)["history"]) == 1


def test_another_data_file_is_refused_with_a_hint_and_recorded_with_override(tmp_path):
    pool = tmp_path / "pool"
    assert run_main("train", "--pool", pool, *TINY, "--tier", "pmem", "--data", TSV, "--steps", 2)[0] == 0
    code, _, err = run_main("train", "--pool", pool, *TINY, "--data", OTHER_TSV, "--steps", 4)
    assert_clean_error(code, err, 2, "was trained on --data", "--override data")
    code, _, err = run_main("train", "--pool", pool, *TINY, "--data", OTHER_TSV, "--steps", 4, "--override", "data")
    assert code == 0, err
    meta = _meta(pool)
    assert meta["data"] == str(OTHER_TSV) and meta["data_identity"]["source"] == str(OTHER_TSV.resolve())
    assert meta["history"] == [{"step": 2, "override": {"data": [str(TSV), str(OTHER_TSV)]}}]
    # resuming without --data continues on the new file
    code, out, err = run_main("train", "--pool", pool, "--threads", 1, "--no-progress", "--steps", 5, "--json")
    assert code == 0 and json.loads(out)["end_step"] == 5, err


def test_an_unknown_override_key_is_a_usage_error(tmp_path):
    code, _, err = run_main("train", "--pool", tmp_path / "p", *TINY, "--steps", 1, "--override", "seed")
    assert code == 2 and "--override takes lr, dense_lr and data" in err, err
