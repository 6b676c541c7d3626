"""``state_digest``, the oracle behind every "bit-exact resume" claim, is itself tested: a change
to any single part of the training state changes the digest, and an unchanged copy does not.

The state is real: a pool made by :func:`dlrm_cxl.provisioning.create_model_tables` for the
``tiny`` preset (embedding tables and their ``<table>.adagrad`` tables), a :class:`PoolDLRM`
whose ``torch.optim.Adagrad`` has taken one step, and the dense snapshot of
:func:`dlrm_cxl.provisioning.capture_dense_state` (model, optimizer, data position, RNG states).
"""

from __future__ import annotations

import copy
import io
import random

import numpy as np
import pytest
import torch

from checkpointing import state_digest
from checkpointing.digest import combine_digests
from memory_pool import MemoryPool

SEED = 7


def _next_up(t: torch.Tensor, index: int = 0) -> None:
    """Change one element of ``t`` by one ulp, in place: the smallest change there is."""
    flat = t.view(-1)
    flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf"), dtype=t.dtype))


def _build(path):
    from dlrm_cxl.model import PRESETS, PoolDLRM, state_table_name
    from dlrm_cxl.provisioning import capture_dense_state, create_model_tables

    cfg = PRESETS["tiny"]
    assert cfg.embedding_optimizer.kind == "rowwise_adagrad"
    pool = MemoryPool.create(path, tier="dram")
    create_model_tables(pool, cfg, seed=SEED)
    torch.manual_seed(SEED)
    model = PoolDLRM(cfg, pool)
    opt = torch.optim.Adagrad(model.parameters(), lr=cfg.dense_lr)
    g = torch.Generator().manual_seed(SEED)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    dense = capture_dense_state(1, model, opt, {"batch": 1})
    assert dense["optimizer"]["state"], "the dense optimizer has state after one step"
    assert state_table_name(cfg.feature_names[0]) in pool.tables()
    return cfg, pool, dense


@pytest.fixture
def state(tmp_pool_dir):
    cfg, pool, dense = _build(tmp_pool_dir)
    yield cfg, pool, dense
    pool.close()


# --------------------------------------------------------------------------- one change each


def _embedding_row(cfg, pool, dense):
    t = pool.table(cfg.feature_names[3])
    row = t.read(torch.tensor([17]))
    _next_up(row, 5)
    t.write(torch.tensor([17]), row)


def _optimizer_row(cfg, pool, dense):
    from dlrm_cxl.model import state_table_name

    t = pool.table(state_table_name(cfg.feature_names[3]))
    row = t.read(torch.tensor([17]))
    row += 0.25  # an accumulator one sparse step has grown
    t.write(torch.tensor([17]), row)


def _dense_parameter(cfg, pool, dense):
    key = sorted(k for k, v in dense["model"].items() if v.is_floating_point())[-1]
    _next_up(dense["model"][key])


def _dense_optimizer_sum(cfg, pool, dense):
    entry = dense["optimizer"]["state"][0]
    _next_up(entry["sum"], 1)


def _dense_optimizer_step(cfg, pool, dense):
    entry = dense["optimizer"]["state"][0]
    entry["step"] = entry["step"] + 1  # a tensor in current torch, an int in old ones


def _data_position(cfg, pool, dense):
    dense["data_position"] = {"batch": 2}


def _data_position_none(cfg, pool, dense):
    dense["data_position"] = None  # "start of the data" is another place than batch 1


def _rng_torch(cfg, pool, dense):
    g = torch.Generator()
    g.set_state(dense["rng"]["torch"])
    torch.rand(1, generator=g)  # one draw further
    dense["rng"]["torch"] = g.get_state()


def _rng_python(cfg, pool, dense):
    r = random.Random()
    r.setstate(dense["rng"]["python"])
    r.random()
    dense["rng"]["python"] = r.getstate()


def _rng_numpy(cfg, pool, dense):
    rs = np.random.RandomState()
    rs.set_state(dense["rng"]["numpy"])
    rs.random_sample()
    dense["rng"]["numpy"] = rs.get_state()


def _rng_numpy_cached_gaussian(cfg, pool, dense):
    # Same Mersenne Twister words, but a cached second Gaussian: the next normal() differs.
    name, key, pos, _, _ = dense["rng"]["numpy"]
    dense["rng"]["numpy"] = (name, key, pos, 1, 0.5)


def _swap_tables(cfg, pool, dense):
    a, b = [pool.table(n) for n in cfg.feature_names if pool.table(n).num_embeddings == 1000][:2]
    va, vb = a.view().clone(), b.view().clone()
    assert not torch.equal(va, vb)
    ids = torch.arange(a.num_embeddings)
    a.write(ids, vb)
    b.write(ids, va)


CHANGES = {
    "embedding-row-element": _embedding_row,
    "optimizer-state-row": _optimizer_row,
    "dense-parameter-element": _dense_parameter,
    "dense-optimizer-sum-element": _dense_optimizer_sum,
    "dense-optimizer-step": _dense_optimizer_step,
    "data-position": _data_position,
    "data-position-none": _data_position_none,
    "rng-torch": _rng_torch,
    "rng-python": _rng_python,
    "rng-numpy": _rng_numpy,
    "rng-numpy-cached-gaussian": _rng_numpy_cached_gaussian,
    "tables-swapped": _swap_tables,
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_any_single_change_changes_the_digest(state, change):
    cfg, pool, dense = state
    before = state_digest(pool, dense)
    copied = copy.deepcopy(dense)
    assert state_digest(pool, copied) == before  # an unchanged copy: the same digest
    CHANGES[change](cfg, pool, copied)
    after = state_digest(pool, copied)
    assert after != before, f"state_digest does not see a change of {change}"


def test_digest_is_deterministic_across_pools_and_a_snapshot_round_trip(tmp_path):
    _, pool_a, dense_a = _build(tmp_path / "a")
    _, pool_b, dense_b = _build(tmp_path / "b")
    try:
        d = state_digest(pool_a, dense_a)
        assert len(d) == 64 and int(d, 16) >= 0
        assert state_digest(pool_a, dense_a) == d  # no hidden state in the hash
        # A second pool built the same way (the RNG states equal: same draws since the seed).
        dense_b["rng"] = copy.deepcopy(dense_a["rng"])
        assert state_digest(pool_b, dense_b) == d
        # The dense snapshot as the checkpointer stores it (torch.save) and reads it back.
        buf = io.BytesIO()
        torch.save(dense_a, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        assert state_digest(pool_a, loaded) == d
        # A serialiser that turns tuples into lists does not change the digest.
        listed = dict(loaded, rng=dict(loaded["rng"], python=list(loaded["rng"]["python"]),
                                       numpy=list(loaded["rng"]["numpy"])))
        assert state_digest(pool_a, listed) == d
    finally:
        pool_a.close()
        pool_b.close()


def test_rng_and_position_are_hashed_only_when_present(state):
    _, pool, dense = state
    model_only = {"model": dense["model"], "optimizer": dense["optimizer"]}
    assert state_digest(pool, model_only) != state_digest(pool, dense)
    assert state_digest(pool, model_only) == state_digest(pool, dict(model_only))
    assert state_digest(pool, None) != state_digest(pool, model_only)


def test_table_name_is_part_of_the_digest(tmp_path):
    digests = []
    for name in ("a", "b"):
        with MemoryPool.create(tmp_path / name, tier="dram") as pool:
            pool.create_table(name, 16, 4, init="uniform", seed=1)
            digests.append(state_digest(pool, None))
    assert digests[0] != digests[1]


def test_nesting_is_unambiguous(tmp_path):
    with MemoryPool.create(tmp_path / "p", tier="dram") as pool:
        dig = lambda pos: state_digest(pool, {"model": {}, "optimizer": {}, "data_position": pos})
        assert dig({"x": [[1], [2]]}) != dig({"x": [[1, 2]]})
        assert dig({"x": [1, 2]}) != dig({"x": [12]})
        assert dig({"x": "1"}) != dig({"x": 1})
        assert dig({1: 0}) != dig({"1": 0})


def test_combine_digests_is_ordered():
    a, b = "0" * 64, "f" * 64
    assert combine_digests([a, b]) != combine_digests([b, a])
    assert combine_digests([a, b]) == combine_digests([a, b])


def test_both_digests_from_one_read_of_the_tables_are_the_state_and_the_model_digest(state):
    # (what `train` prints at its end: the tables read once for both)
    from checkpointing.digest import model_digest, state_and_model_digest

    cfg, pool, dense = state
    both = state_and_model_digest(pool, dense)
    assert both == (state_digest(pool, dense), model_digest(pool, dense))
    assert both[0] != both[1]   # (the data position and the RNG states are the state's only)
    _embedding_row(cfg, pool, dense)   # a row changed: both see it
    again = state_and_model_digest(pool, dense)
    assert again[0] != both[0] and again[1] != both[1]
