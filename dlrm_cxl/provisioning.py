"""Provisioning a trainer pool: create one (tables, optimizer-state tables and the metadata that
later runs are checked against) or open one, recovering first when a crash left it between
steps; and the dense side of its state (the dense optimizer, the dense snapshot).

:func:`create_trainer_pool` is the one place a trainer pool is made: ``train`` on a new
``--pool`` (through :func:`open_training_pool`) and ``import`` both call it.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from checkpointing import checkpoint_status, recover
from checkpointing.job import is_job
from memory_pool import MemoryPool, destroy_pool

from .errors import ConfigMismatchError, PoolFormatError
from .model import ModelConfig, SparseOptimizer
from .options import TrainOptions

__all__ = ["TRAINER_POOL_KIND", "create_trainer_pool", "open_training_pool", "probe_training_pool",
           "recovery_reason", "create_model_tables",
           "build_dense_optimizer", "capture_dense_state"]

TRAINER_POOL_KIND = "dlrm-cxl-trainer"  # meta["kind"] of a pool made by create_trainer_pool


def build_dense_optimizer(cfg: ModelConfig, params) -> torch.optim.Optimizer:
    if cfg.dense_optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.dense_lr)
    if cfg.dense_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.dense_lr)
    return torch.optim.Adam(params, lr=cfg.dense_lr)


def create_model_tables(pool: MemoryPool, cfg: ModelConfig, seed: int, features: list[int] | None = None) -> None:
    """The model's embedding tables (and optimizer-state tables) in ``pool``, initialised."""
    features = list(range(len(cfg.feature_names))) if features is None else features
    for f in features:
        # TorchRec's default init: uniform in [-sqrt(1/n), sqrt(1/n)]; seeded per table, so a
        # table is initialised identically whichever rank holds it.
        pool.create_table(cfg.feature_names[f], cfg.num_embeddings[f], cfg.embedding_dim, init="uniform",
                          seed=seed * 1000 + f)
    SparseOptimizer.create_state_tables(pool, cfg.embedding_optimizer, cfg, features)


def create_trainer_pool(o: TrainOptions, cfg: ModelConfig, *, path: Path | None = None,
                        features: list[int] | None = None) -> MemoryPool:
    """A new pool at ``path`` (default ``o.pool``) of tier ``o.tier`` holding the model's tables,
    initialised from ``o.seed``, and the metadata :func:`open_training_pool` checks later runs
    against (model config, seed, data, zipf_alpha, kind). Returns it open (with ``o``'s DRAM
    budget); on any failure nothing is left at ``path``. It holds no checkpoint yet: the caller
    makes step 0 the first recovery point."""
    path = Path(o.pool) if path is None else Path(path)
    if features is None and o.kernel == "fused":
        from .lookahead import check_cache_budget

        check_cache_budget(o.dram_cache_bytes, cfg)  # (a budget too small for one batch: before anything is made)
    pool = MemoryPool.create(path, tier=o.tier, capacity_bytes=o.capacity_bytes)
    try:
        create_model_tables(pool, cfg, o.seed, features)
        pool.set_meta(model=cfg.to_dict(), seed=o.seed, data=o.data, zipf_alpha=o.zipf_alpha,
                      kind=TRAINER_POOL_KIND)
        if o.dram_cache_bytes is not None:
            # Reopen so that the DRAM budget is split over all the tables, as on every later open.
            pool.persist()
            pool.close()
            pool = MemoryPool.open(path, dram_cache_bytes=o.dram_cache_bytes)
        else:
            # No budget: the tables are meant to be resident. On a journaled tier their images
            # were just written and dropped from the page cache (FileRegion.sync says why); read
            # them back now, sequentially and in the background, instead of one random read per
            # copy-on-write fault of the first steps (kaggle on pmem: the first 10 steps took 19 s).
            for name in pool.tables():
                pool.table(name).read_ahead()
    except BaseException:
        pool.close()
        destroy_pool(path)
        raise
    return pool


def probe_training_pool(o: TrainOptions, model_cfg: ModelConfig | None, path: Path | None = None
                        ) -> tuple[ModelConfig, dict]:
    """(stored model config, checkpoint status) of the existing trainer pool at ``path``
    (default ``o.pool``), read without replaying its journal or taking the writer lock, after
    checking the run's options against what the pool was created with (ConfigMismatchError)."""
    path = Path(o.pool) if path is None else Path(path)
    probe = MemoryPool.open(path, read_only=True, rows=False)  # (its meta and journal: no replay)
    try:
        meta = probe.meta
        status = checkpoint_status(probe)
    finally:
        probe.close()
    if "model" not in meta:
        raise PoolFormatError(f"{path} is a pool but holds no trainer state (created through the API?)",
                              hint="train into a new --pool directory")
    stored = ModelConfig.from_dict(meta["model"])
    if model_cfg is not None and _without_overrides(model_cfg, stored, o.override) != stored:
        cmp = _without_overrides(model_cfg, stored, o.override)
        diff = [k for k in asdict(stored) if asdict(stored)[k] != asdict(cmp)[k]]
        lr = {"dense_lr", "embedding_optimizer"} & set(diff)
        raise ConfigMismatchError(
            f"{path} was created with a different model ({', '.join(diff)} differ)",
            hint="pass --override lr,dense_lr to change the learning rates of an existing pool on purpose (recorded "
                 "in its history), drop the flag to continue it as created, or --fresh to start over"
            if lr and set(diff) <= {"dense_lr", "embedding_optimizer"} else None)
    if o.data != meta.get("data", o.data) and "data" not in o.override:
        raise ConfigMismatchError(f"{path} was trained on --data {meta.get('data')}, not {o.data}",
                                  hint="pass --override data to continue the pool on another data file on purpose "
                                       "(recorded in its history), drop --data to continue on its own, or --fresh to "
                                       "start over")
    if o.seed != meta.get("seed", o.seed):
        raise ConfigMismatchError(f"{path} was trained with --seed {meta.get('seed')}, not {o.seed}")
    if o.data == "synthetic" and o.zipf_alpha != meta.get("zipf_alpha", o.zipf_alpha):
        raise ConfigMismatchError(f"{path} was trained with --zipf-alpha {meta.get('zipf_alpha')}, not {o.zipf_alpha}")
    return stored, status


def recovery_reason(status: dict, target: int | None) -> str:
    """Why a pool is recovered before training, in words (``status``: checkpoint_status;
    ``target``: the step the ranks of a job agreed on, when it is behind this rank's)."""
    why = []
    if status["steps_to_roll_back"]:
        steps = status["steps_to_roll_back"]
        why.append(f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} "
                   f"{'were' if len(steps) > 1 else 'was'} not committed")
    if target is not None:
        why.append(f"committed step {status['committed_step']} is ahead of the job's step {target}, which every "
                   f"rank committed")
    if status["torn_bytes"]:
        why.append(f"{status['torn_bytes']} bytes of unfinished journal records")
    if not why:
        why.append("a step was interrupted")
    return "; ".join(why)


def open_training_pool(o: TrainOptions, model_cfg: ModelConfig | None, log: Callable[[str], None],
                       *, path: Path | None = None, features: list[int] | None = None, coordinator=None):
    """Open (recovering first if needed) or create the pool. Returns (pool, cfg, recovery, created).

    Several ranks: ``path`` is this rank's pool, ``features`` the tables it holds, and
    ``coordinator.global_min`` agrees with the other ranks on the step to recover to.
    """
    path = Path(o.pool) if path is None else Path(path)
    if coordinator is None and is_job(path):
        raise ConfigMismatchError(f"{path} holds a job of several ranks (job.json, rank-*/)",
                                  hint="train it with torchrun --nproc_per_node N -m dlrm_cxl train, "
                                       "or pick another --pool")
    if o.fresh and coordinator is None and path.exists():
        destroy_pool(path)
        log(f"--fresh: removed the pool at {path}")
    if (path / "pool.json").exists():
        stored, status = probe_training_pool(o, model_cfg, path)
        rep = None
        target = None
        if coordinator is not None:
            c = status["committed_step"]
            g = coordinator.global_min(-1 if c is None else c)
            if c is not None and g < c:
                target = g
                log(f"pool {path} committed step {c}, but not every rank did: rolling back to step {g}")
        t0 = time.perf_counter()
        # On demand: the journal's rows reach the working copy as the steps need them, so a
        # resume after a power loss does not first wait for every image page they land in.
        pool = MemoryPool.open(path, dram_cache_bytes=o.dram_cache_bytes, replay="on-demand")
        try:
            st = pool.stats
            if st.rows_deferred and o.verbose:  # (a detail: -v)
                runs = f" and {st.run_rows_deferred:,} rows of the row overlay's runs" if st.run_rows_deferred else ""
                log(f"pool opened in {st.open_seconds * 1e3:.0f} ms; {st.rows_deferred - st.run_rows_deferred:,} journal "
                    f"rows{runs} are applied as the steps first read them (replay on demand)")
            if status["needs_recovery"] or status["steps_to_roll_back"] or status["torn_bytes"] or target is not None:
                log(f"pool {path} needs recovery ({recovery_reason(status, target)}): recovering")
                # On the pool this run trains on: its journal is replayed once, not once to recover
                # and again to train.
                rep = recover(path, pool=pool, digest=False, target_step=target, rank_of_job=coordinator is not None)
                rep.seconds = time.perf_counter() - t0  # (opening the pool included, as recover(path) reports it)
                log(f"recovered to step {rep.committed_step}: rolled back {len(rep.rolled_back_steps)} steps, "
                    f"{rep.rows_restored} rows, in {rep.seconds * 1e3:.1f} ms")
            if o.override:
                from checkpointing import committed_state
                from checkpointing.recovery import replay_witnesses

                if "data" in o.override and o.data != pool.meta.get("data") and replay_witnesses(pool):
                    raise ConfigMismatchError(
                        f"{path}: --override data while committed steps wait for their replay on the data they "
                        f"read", hint=f"run `dlrm-cxl recover --pool {path}` first (or `--no-replay`), then override")
                stored = apply_overrides(pool, o, model_cfg, stored, committed_state(pool)[0], log)
        except BaseException:
            pool.close()
            raise
        return pool, stored, rep, False
    if model_cfg is None:
        raise ValueError("a new pool needs a model config (pass --preset)")
    return create_trainer_pool(o, model_cfg, path=path, features=features), model_cfg, None, True


def capture_dense_state(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        data_position: dict | None, *, copy: bool = True) -> dict:
    """Everything but the tables that a resume at ``step`` needs: dense parameters, dense
    optimizer state, data position and RNG states. The dense snapshot. ``copy``: tensors are
    copies (to CPU), else the live tensors (for a caller that copies them at once)."""
    return {
        "step": step,
        "model": {k: v.detach().to("cpu", copy=copy) for k, v in model.state_dict().items()},
        "optimizer": _clone_tree(optimizer.state_dict()) if copy else optimizer.state_dict(),
        "data_position": data_position,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }


def _clone_tree(obj):
    """Copy every tensor (to CPU) of a nested dict/list; other leaves are immutable or copied."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v) for v in obj)
    return copy.copy(obj)


OVERRIDES = ("lr", "dense_lr", "data")


def _without_overrides(cfg: ModelConfig, stored: ModelConfig, override) -> ModelConfig:
    """``cfg`` with the fields ``override`` allows to differ taken from ``stored``."""
    if "dense_lr" in override:
        cfg = replace(cfg, dense_lr=stored.dense_lr)
    if "lr" in override:
        cfg = replace(cfg, embedding_optimizer=replace(cfg.embedding_optimizer, lr=stored.embedding_optimizer.lr))
    return cfg


def apply_overrides(pool: MemoryPool, o: TrainOptions, model_cfg: ModelConfig | None, stored: ModelConfig,
                    step: int | None, log: Callable[[str], None]) -> ModelConfig:
    """Deliberate changes of an existing pool (``--override``): the learning rates and the data
    file. Each is recorded in the pool's history (``meta["history"]``: the step it applies from,
    the old and the new value) and the pool's model/data become the new ones. Returns the model
    config to train with. What the digest rules say then: a run with an override is bit-exact
    with another run that made the same override at the same step, not with an uninterrupted run
    without it."""
    meta = pool.meta
    changes = {}
    new = _apply_lr(stored, model_cfg, o.override)
    if new != stored:
        if new.dense_lr != stored.dense_lr:
            changes["dense_lr"] = [stored.dense_lr, new.dense_lr]
        if new.embedding_optimizer.lr != stored.embedding_optimizer.lr:
            changes["lr"] = [stored.embedding_optimizer.lr, new.embedding_optimizer.lr]
    if "data" in o.override and o.data != meta.get("data"):
        changes["data"] = [meta.get("data"), o.data]
    if not changes:
        return stored
    history = list(meta.get("history") or []) + [{"step": step, "override": changes}]
    pool.set_meta(model=new.to_dict(), data=o.data if "data" in changes else meta.get("data"), history=history)
    log(f"--override: from step {step} on, " + "; ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items())
        + " (recorded in the pool's history)")
    return new


def _apply_lr(stored: ModelConfig, cfg: ModelConfig | None, override) -> ModelConfig:
    if cfg is None:
        return stored
    out = stored
    if "dense_lr" in override:
        out = replace(out, dense_lr=cfg.dense_lr)
    if "lr" in override:
        out = replace(out, embedding_optimizer=replace(out.embedding_optimizer, lr=cfg.embedding_optimizer.lr))
    return out
