"""The trainer through its Python API (preset ``tiny``, pools under tmp_path).

Every comparison of two runs is by ``state_digest`` (all table rows, optimizer rows, dense
parameters and dense optimizer state, bit for bit); all runs use one intra-op thread.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from checkpointing import checkpoint_status, recover
from dlrm_cxl.data import SyntheticData, convert_tsv_to_zarr
from dlrm_cxl.errors import ConfigMismatchError, TrainingDivergedError
from dlrm_cxl.evaluation import evaluate
from dlrm_cxl.model import PRESETS
from dlrm_cxl.options import TrainOptions, data_spec
from dlrm_cxl.trainer import Trainer
from memory_pool import MemoryPool, destroy_pool

DATA = Path(__file__).resolve().parent / "data"
TSV = DATA / "criteo_sample_100.tsv"
TSV_HELDOUT = DATA / "criteo_rows_101_200.tsv"

TINY = PRESETS["tiny"]
TINY32 = replace(TINY, batch_size=32)  # the 100-row sample wraps after 4 batches


def train(pool, steps, cfg=TINY, *, model_only=False, **kw):
    """Run a Trainer to ``steps`` (total); returns (summary, state_digest) -- or the model digest
    (no data position, no RNG states) with ``model_only``."""
    opts = TrainOptions(pool=str(pool), steps=steps, threads=1, progress=False, **kw)
    tr = Trainer(opts, cfg, log=lambda s: None)
    try:
        summary = tr.run()
        digest = tr.digest(resume=not model_only)
    finally:
        tr.close()
    return summary, digest


class _HeldOut:
    """Synthetic samples from the training distribution (same seed) that no short run reads:
    batches 10**6 onward."""

    def __init__(self, cfg, seed=0):
        self.src = SyntheticData(data_spec(cfg), seed=seed)

    def iter_batches(self, position=None):
        return self.src.iter_batches({"batch": 10**6})


# --------------------------------------------------------------------------- learning


def test_loss_falls_and_heldout_auc_rises_on_synthetic_data(tmp_pool_dir):
    # First run: steps 1..10 -> its summary's final_loss is the mean loss of the first 10 steps.
    first, _ = train(tmp_pool_dir, 10)
    assert first.steps_run == 10 and first.final_loss is not None
    # AUC of the model at step 0 (a fresh pool with the same seed holds the step-0 state).
    tr0 = Trainer(TrainOptions(pool=str(tmp_pool_dir.parent / "p0"), steps=0, threads=1, progress=False),
                  TINY, log=lambda s: None)
    try:
        auc0 = evaluate(tr0.model, _HeldOut(TINY), 8)["auc"]
    finally:
        tr0.close()
    tr = Trainer(TrainOptions(pool=str(tmp_pool_dir), steps=60, threads=1, progress=False), TINY,
                 log=lambda s: None)
    try:
        last = tr.run()
        res = evaluate(tr.model, _HeldOut(TINY), 8)
    finally:
        tr.close()
    assert last.start_step == 10 and last.end_step == 60
    assert last.final_loss < first.final_loss - 0.05, (first.final_loss, last.final_loss)
    assert abs(auc0 - 0.5) < 0.1, auc0
    assert res["auc"] > 0.6, res
    assert math.isfinite(res["logloss"]) and res["samples"] == 8 * TINY.batch_size


def test_trainer_evaluate_on_default_heldout_synthetic_data_sees_the_learning(tmp_pool_dir):
    """``Trainer.evaluate`` (and --eval-every) default to "held-out synthetic" data: it must come
    from the distribution the model was trained on, or its AUC says nothing."""
    tr = Trainer(TrainOptions(pool=str(tmp_pool_dir), steps=60, threads=1, progress=False), TINY,
                 log=lambda s: None)
    try:
        tr.run()
        ours = evaluate(tr.model, _HeldOut(TINY), 8)["auc"]
        theirs = tr.evaluate(8)["auc"]
    finally:
        tr.close()
    assert ours > 0.6
    assert theirs > 0.6, f"Trainer.evaluate held-out AUC {theirs:.3f}, same-distribution held-out {ours:.3f}"


def test_eval_source_is_held_out_synthetic_for_synthetic_data_else_the_file():
    """``eval_source``: the one choice of eval data for ``dlrm-cxl eval`` and ``Trainer.evaluate``."""
    from dlrm_cxl.data import CriteoTSVReader
    from dlrm_cxl.evaluation import EVAL_SEED_OFFSET, HeldOutSynthetic, eval_source

    spec = data_spec(TINY)
    for data, train_data in ((None, "synthetic"), ("synthetic", "synthetic"), ("synthetic", str(TSV))):
        src = eval_source(data, spec, train_data=train_data, seed=3, zipf_alpha=1.2)
        assert isinstance(src, HeldOutSynthetic) and src.first_batch == EVAL_SEED_OFFSET
        batch, _ = next(src.iter_batches())  # the training distribution's batch EVAL_SEED_OFFSET
        want, _ = next(SyntheticData(spec, seed=3, alpha=1.2).iter_batches({"batch": EVAL_SEED_OFFSET}))
        assert torch.equal(batch.dense, want.dense) and torch.equal(batch.labels, want.labels)
    for data, train_data in ((None, str(TSV)), (str(TSV), "synthetic"), (str(TSV_HELDOUT), str(TSV))):
        src = eval_source(data, spec, train_data=train_data, skip_bad_lines=True)
        assert isinstance(src, CriteoTSVReader) and src.path == Path(data or train_data) and src.skip_bad_lines


# --------------------------------------------------------------------------- determinism / resume


def test_same_seed_same_digest_other_seed_other_digest(tmp_path):
    _, a = train(tmp_path / "a", 8, seed=0)
    _, b = train(tmp_path / "b", 8, seed=0)
    _, c = train(tmp_path / "c", 8, seed=1)
    assert a == b
    assert c != a


def test_runs_with_checkpoint_none_keep_the_journal_to_the_newest_commit_and_resume_bit_exact(tmp_path, monkeypatch):
    # Each clean end of `--checkpoint none` commits the run's changed rows in one transaction.
    # Past the compaction threshold, everything before that transaction is written back and
    # dropped (before: never, so every open replayed every run's rows).
    monkeypatch.setenv("DLRM_CXL_COMPACT_MB", "0.05")   # 50 KiB: each run's rows cross it
    _, straight = train(tmp_path / "straight", 9, tier="pmem")
    pool = tmp_path / "p"
    for steps in (3, 6, 9):
        _, digest = train(pool, steps, tier="pmem", checkpoint="none")
        with MemoryPool.open(pool, read_only=True, rows=False) as p:
            assert [t.tag for t in p.journal.txns] == [steps], [t.tag for t in p.journal.txns]
    assert digest == straight


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_a_resume_applies_the_journals_rows_as_the_steps_need_them_and_ends_bit_exact(tmp_path, tier):
    # The trainer opens its pool with replay="on-demand" (memory_pool/ondemand.py): nothing of
    # the journal is applied before the first step, each step applies the rows it reads.
    _, straight = train(tmp_path / "straight", 10, tier=tier)
    train(tmp_path / "p", 5, tier=tier)
    tr = Trainer(TrainOptions(pool=str(tmp_path / "p"), steps=10, threads=1, progress=False), TINY, log=lambda s: None)
    try:
        deferred = tr.pool.stats.rows_deferred
        assert deferred > 0 and tr.pool.rows_pending == deferred  # the trainer's build applied none
        tr.run()
        assert 0 < tr.pool.stats.rows_replayed and 0 < tr.pool.rows_pending < deferred
        # (the digest reads the rows still pending with their journal values, and applies none:
        # Table.snapshot; it equals the uninterrupted run's below)
        pending = tr.pool.rows_pending
        digest = tr.digest()
        assert tr.pool.rows_pending == pending
    finally:
        tr.close()
    assert digest == straight


def test_steps_is_the_total_and_rerunning_does_nothing(tmp_path):
    _, straight = train(tmp_path / "straight", 10)
    s5, d5 = train(tmp_path / "p", 5)
    assert (s5.start_step, s5.end_step, s5.steps_run) == (0, 5, 5)
    s10, d10 = train(tmp_path / "p", 10)
    assert (s10.start_step, s10.end_step, s10.steps_run) == (5, 10, 5)
    assert d10 == straight and d5 != d10
    again, d_again = train(tmp_path / "p", 10)
    assert (again.start_step, again.end_step, again.steps_run, again.samples) == (10, 10, 0, 0)
    assert d_again == straight
    # a smaller total than the pool's step neither trains nor goes back
    less, d_less = train(tmp_path / "p", 3)
    assert (less.end_step, less.steps_run) == (10, 0) and d_less == straight


# --------------------------------------------------------------------------- real data


def test_train_on_criteo_tsv_wraps_epochs_then_eval_is_finite(tmp_pool_dir):
    s, _ = train(tmp_pool_dir, 5, cfg=TINY32, data=str(TSV))
    assert s.end_step == 5 and s.samples == 5 * 32
    assert s.epochs is not None and s.epochs >= 1  # 160 rows read from a 100-row file
    assert s.final_loss is not None and math.isfinite(s.final_loss)
    tr = Trainer(TrainOptions(pool=str(tmp_pool_dir), steps=5, data=str(TSV), threads=1, progress=False),
                 None, log=lambda s: None)
    try:
        for res in (tr.evaluate(3), tr.evaluate(3, data=str(TSV_HELDOUT))):
            assert math.isfinite(res["auc"]) and 0.0 <= res["auc"] <= 1.0, res
            assert math.isfinite(res["logloss"]) and res["logloss"] > 0, res
            assert res["samples"] == 96
    finally:
        tr.close()


def test_zarr_converted_from_tsv_trains_to_the_same_digest(tmp_path):
    z = tmp_path / "sample.zarr"
    stats = convert_tsv_to_zarr(TSV, z, data_spec(TINY32), chunk_rows=30)  # batches span chunks
    assert stats["rows"] == 100 and stats["skipped"] == 0
    s_tsv, d_tsv = train(tmp_path / "from_tsv", 7, cfg=TINY32, data=str(TSV), model_only=True)
    s_zarr, d_zarr = train(tmp_path / "from_zarr", 7, cfg=TINY32, data=str(z), model_only=True)
    assert s_zarr.epochs == s_tsv.epochs == 2  # 224 rows
    assert d_zarr == d_tsv  # the model digest: the positions are a byte offset and a row index


@pytest.mark.parametrize("kind", ["tsv", "zarr"])
def test_data_position_is_restored_on_resume(tmp_path, kind):
    data = TSV
    if kind == "zarr":
        data = tmp_path / "d.zarr"
        convert_tsv_to_zarr(TSV, data, data_spec(TINY32), chunk_rows=30)
    _, straight = train(tmp_path / "straight", 8, cfg=TINY32, data=str(data))
    train(tmp_path / "p", 4, cfg=TINY32, data=str(data))
    s8, resumed = train(tmp_path / "p", 8, cfg=TINY32, data=str(data))
    assert (s8.start_step, s8.end_step) == (4, 8)
    assert resumed == straight


# --------------------------------------------------------------------------- divergence


DIVERGE = replace(TINY, dense_optimizer="sgd", dense_lr=1e30)


def _inspect(pool):
    from checkpointing import committed_state, state_digest

    with MemoryPool.open(pool, read_only=True) as p:
        st = checkpoint_status(p)
        digest = None
        if st["committed_step"] is not None and not st["needs_recovery"]:
            digest = state_digest(p, committed_state(p)[1])
    return st, digest


def test_nan_loss_raises_and_the_pool_keeps_the_last_good_step(tmp_pool_dir):
    _, d1 = train(tmp_pool_dir, 1, cfg=DIVERGE)  # step 1's loss is finite; its update explodes
    with pytest.raises(TrainingDivergedError) as ei:
        train(tmp_pool_dir, 20, cfg=DIVERGE)
    assert "step 2" in str(ei.value) and ei.value.exit_code == 8
    st, _ = _inspect(tmp_pool_dir)
    assert st["committed_step"] == 1
    rep = recover(tmp_pool_dir)  # whatever is there, it brings back exactly step 1
    assert rep.committed_step == 1 and rep.state_digest == d1


def test_nan_loss_leaves_nothing_to_roll_back(tmp_pool_dir):
    """The diverged step applied nothing, so the pool is consistent at the step before it."""
    _, d1 = train(tmp_pool_dir, 1, cfg=DIVERGE)
    with pytest.raises(TrainingDivergedError):
        train(tmp_pool_dir, 20, cfg=DIVERGE)
    st, digest = _inspect(tmp_pool_dir)
    assert (st["committed_step"], st["needs_recovery"], st["steps_to_roll_back"]) == (1, False, [])
    assert digest == d1


def test_a_batch_with_an_out_of_range_id_stops_training_at_its_step_with_every_step_before_committed(
        tmp_pool_dir):
    """The loop validates and plans batches on the prefetch thread, ahead of their steps; a bad
    batch still stops training exactly at its own turn: the steps before it are done and
    committed, nothing of it is applied, and the pool needs no recovery."""
    from dlrm_cxl.data import Batch
    from memory_pool import InvalidIdsError

    _, d2 = train(tmp_pool_dir, 2)
    opts = TrainOptions(pool=str(tmp_pool_dir), steps=6, threads=1, progress=False)
    tr = Trainer(opts, TINY, log=lambda s: None)
    good = tr.source.iter_batches

    def with_a_bad_third(position):
        for i, (b, pos) in enumerate(good(position)):
            if i == 1:  # step 4
                kjt = b.sparse
                values = kjt.values().clone()
                values[0] = 10**9
                b = Batch(b.dense, type(kjt)(keys=kjt.keys(), values=values, lengths=kjt.lengths()), b.labels)
            yield b, pos

    tr.source.iter_batches = with_a_bad_third
    try:
        with pytest.raises(InvalidIdsError, match="out of range"):
            tr.run()
        assert tr.step == 3
    finally:
        tr.close()
    st, digest = _inspect(tmp_pool_dir)
    assert (st["committed_step"], st["needs_recovery"]) == (3, False)
    _, d3 = train(tmp_pool_dir.parent / "ref", 3)
    assert digest == d3 != d2


# --------------------------------------------------------------------------- config


def test_other_preset_is_a_config_mismatch_and_fresh_starts_over(tmp_path):
    pool = tmp_path / "p"
    train(pool, 3)
    with pytest.raises(ConfigMismatchError) as ei:
        train(pool, 5, cfg=PRESETS["small"])
    assert ei.value.exit_code == 2 and "--fresh" in ei.value.hint
    with pytest.raises(ConfigMismatchError, match="batch_size"):
        train(pool, 5, cfg=TINY32)
    with pytest.raises(ConfigMismatchError):
        train(pool, 5, seed=7)
    with pytest.raises(ConfigMismatchError):
        train(pool, 5, data=str(TSV))
    # the pool is untouched by the refused runs
    s, _ = train(pool, 3)
    assert s.end_step == 3 and s.steps_run == 0
    fresh, d_fresh = train(pool, 4, cfg=TINY32, fresh=True)
    assert (fresh.start_step, fresh.end_step, fresh.steps_run) == (0, 4, 4)
    _, d_new = train(tmp_path / "new", 4, cfg=TINY32)
    assert d_fresh == d_new


# --------------------------------------------------------------------------- memory


def test_dram_cache_smaller_than_the_tables_gives_the_same_digest(tmp_path):
    # tiny holds ~640 kB of tables; the budget is split over the tables (memory_pool/cache_arena.py),
    # so cat_0 (1000 x 8 fp32 = 32 kB) gets a cache of a couple of hundred rows; no table fits
    # whole. Cached tables train on fbgemm's fused kernels over the DRAM cache arena: the cache
    # itself must change nothing (bit for bit the uncached fused path).
    budget = 300_000
    _, plain = train(tmp_path / "plain", 10)
    train(tmp_path / "cached", 5, dram_cache_bytes=budget)
    _, cached = train(tmp_path / "cached", 10, dram_cache_bytes=budget)  # reopened with a cache
    assert cached == plain
    with MemoryPool.open(tmp_path / "cached", dram_cache_bytes=budget) as p:
        info = p.describe()
    assert any(t["cached"] and 0 < t["cache_rows"] < t["num_embeddings"] for t in info["tables"])


def test_pmem_shm_and_power_sim_tiers_train_to_the_same_digest(tmp_path):
    digests = {}
    for tier in ("pmem", "shm", "power-sim"):
        pool = tmp_path / tier
        try:
            s, digests[tier] = train(pool, 6, tier=tier)
            assert s.tier == tier and s.durability
            _, again = train(pool, 8, tier=tier)  # reopen and continue on the same tier
            digests[tier] = (digests[tier], again)
        finally:
            if (pool / "pool.json").exists():
                destroy_pool(pool)
    assert len(set(digests.values())) == 1, digests


# --------------------------------------------------------------------------- where the journal writer runs


def test_the_journal_writer_runs_inline_only_where_it_never_waits_for_a_device_and_no_core_is_spare():
    from dlrm_cxl.options import resolve_writer
    # auto: inline on a tier whose copies are durable by themselves, when torch's threads take
    # every core; its own thread with a core to spare, on journaled tiers (an fdatasync to
    # overlap) and with several ranks
    assert resolve_writer("auto", journaled=False, cores=2, threads=2) == "inline"
    assert resolve_writer("auto", journaled=False, cores=4, threads=2) == "thread"
    assert resolve_writer("auto", journaled=True, cores=2, threads=2) == "thread"
    assert resolve_writer("auto", journaled=False, ranks=2, cores=2, threads=2) == "thread"
    # asked for: as asked, on any tier
    assert resolve_writer("inline", journaled=True, cores=64, threads=1) == "inline"
    assert resolve_writer("thread", journaled=False, cores=1, threads=2) == "thread"
    with pytest.raises(ValueError, match="auto, thread, inline"):
        resolve_writer("background", journaled=False)
    with pytest.raises(ValueError, match="--writer must be one of auto, thread, inline, got 'background'"):
        Trainer(TrainOptions(pool="unused", steps=1, writer="background"), TINY)


@pytest.mark.parametrize("tier", ["shm", "pmem"])
def test_an_inline_journal_writer_trains_the_same_state_as_a_threaded_one(tmp_path, tier):
    threaded, d_thread = train(tmp_path / "thread", 6, tier=tier, writer="thread", window=1)
    inline, d_inline = train(tmp_path / "inline", 6, tier=tier, writer="inline", window=1)
    assert (threaded.checkpoint["writer"], inline.checkpoint["writer"]) == ("thread", "inline")
    assert d_inline == d_thread
    # (that a crash then loses only the step in flight: the shm-inline column of
    # test_recovery.py's crash matrix)
    # (inline, every job is done when handed over: no commit ever waits on one. Counted, not
    # timed: a loaded machine stretched the two clock reads around a finished job to 8 ms)
    assert inline.checkpoint["commit_waits"] == 0 and inline.checkpoint["checkpoints"] == 7
    with MemoryPool.open(tmp_path / "inline", read_only=True) as pool:
        assert checkpoint_status(pool)["committed_step"] == 6
    for p in ("thread", "inline"):
        destroy_pool(tmp_path / p)


def test_a_closed_trainer_gives_its_pool_back_to_a_collection_after_a_long_run(tmp_path):
    # A run of more than 32 steps moves everything out of the cyclic GC's reach for its length
    # (gc.freeze): once it is over, a closed trainer's pool must be collectable again.
    import gc
    import weakref

    gc.unfreeze()  # (a tool another test ran here may have frozen: the run then would not freeze)
    tr = Trainer(TrainOptions(pool=str(tmp_path / "p"), steps=40, threads=1, progress=False), TINY,
                 log=lambda s: None)
    tr.run()
    pool = weakref.ref(tr.pool)
    tr.close()
    del tr
    gc.collect()
    assert pool() is None
    assert gc.get_freeze_count() == 0
