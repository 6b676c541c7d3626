"""The training loop: stream batches, look up and update rows in the pool, checkpoint each step.

``Trainer(options, model_cfg).run()`` trains until ``options.steps`` steps have been done *in
total*: on a pool that already holds training state it recovers (if a crash left an
unfinished step) and continues from the committed step, so running the same command again
after a crash ends at the same step with the same state.
"""

from __future__ import annotations

import copy
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from checkpointing import (CrashPlan, NoCheckpointer, UndoLogCheckpointer, checkpoint_status, committed_state,
                           recover, state_digest)
from checkpointing.job import is_job
from memory_pool import ConfigMismatchError, MemoryPool, PoolFormatError, TrainingDivergedError, destroy_pool

from .data import DataSpec, Prefetcher, SyntheticData, make_data_source
from .model import ModelConfig, PoolDLRM, SparseOptimizer

__all__ = ["TrainOptions", "Trainer", "TrainSummary", "evaluate", "open_training_pool", "data_spec",
           "build_dense_optimizer", "EVAL_SEED_OFFSET", "HeldOutSynthetic", "capture_dense_state",
           "create_model_tables", "default_dense_every"]

EVAL_SEED_OFFSET = 1_000_003  # synthetic eval batches start here: same problem, batches training never reads


class HeldOutSynthetic:
    """Synthetic batches of the training distribution that training does not read.

    The seed also fixes the true effects of the rows, so held-out data must use the training
    seed; it starts at batch EVAL_SEED_OFFSET instead."""

    def __init__(self, source: SyntheticData, first_batch: int = EVAL_SEED_OFFSET):
        self.source, self.first_batch = source, first_batch

    def iter_batches(self, position=None):
        return self.source.iter_batches(position or {"batch": self.first_batch})


@dataclass(frozen=True)
class TrainOptions:
    pool: str
    steps: int
    data: str = "synthetic"
    seed: int = 0
    tier: str = "auto"
    device: str = "cpu"
    eval_every: int = 0
    eval_batches: int = 4
    eval_data: str | None = None
    checkpoint: str = "undo"           # undo | none
    dense_every: int | None = None     # None: by tier, see default_dense_every
    crash_at: tuple[int, str] | None = None
    crash_rank: int = 0                # several ranks: which rank --crash-at kills
    threads: int | None = None
    skip_bad_lines: bool = False
    capacity_bytes: int | None = None
    dram_cache_bytes: int | None = None
    fresh: bool = False
    progress: bool = True
    zipf_alpha: float = 1.05
    kernel: str = "fused"              # fused (fbgemm TBE in place) | reference (see model.py)


def validate_options(o: TrainOptions) -> None:
    if not isinstance(o.steps, int) or o.steps < 0:
        raise ValueError(f"--steps must be a non-negative integer, got {o.steps!r}")
    if o.checkpoint not in ("undo", "none"):
        raise ValueError(f"--checkpoint must be undo or none, got {o.checkpoint!r}")
    if o.dense_every is not None and o.dense_every < 1:
        raise ValueError(f"--dense-every must be >= 1, got {o.dense_every}")
    if o.eval_every < 0 or o.eval_batches < 1:
        raise ValueError(f"--eval-every must be >= 0 and --eval-batches >= 1, got {o.eval_every}, {o.eval_batches}")
    if o.device not in ("cpu", "cuda") and not o.device.startswith("cuda:"):
        raise ValueError(f"--device must be cpu or cuda, got {o.device!r}")
    if o.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available on this machine")
    if o.kernel not in ("fused", "reference"):
        raise ValueError(f"--kernel must be fused or reference, got {o.kernel!r}")
    if o.threads is not None and o.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {o.threads}")


@dataclass
class TrainSummary:
    pool: str
    tier: str
    durability: str
    start_step: int
    end_step: int
    steps_run: int
    samples: int
    seconds: float
    samples_per_s: float
    final_loss: float | None
    epochs: int | None
    checkpoint: dict
    recovered: dict | None
    eval: list = field(default_factory=list)
    pool_stats: dict = field(default_factory=dict)
    distributed: dict | None = None    # world size, seconds in exchanges and in commit agreement

    def as_dict(self) -> dict:
        return asdict(self)


def default_dense_every(pool: MemoryPool) -> int:
    """Steps between recovery points when --dense-every is not given: every step, on every tier.

    Persisting costs what its bytes cost (the journal is byte-granular with group commit, and
    the commit of step k is written while step k+1 computes), so there is no reason to lose
    more than the step in flight and the one before it. See tools/bench_train.py."""
    return 1


def data_spec(cfg: ModelConfig) -> DataSpec:
    return DataSpec(num_dense=cfg.num_dense, feature_names=tuple(cfg.feature_names),
                    num_embeddings=tuple(cfg.num_embeddings), batch_size=cfg.batch_size)


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
        probe = MemoryPool.open(path, read_only=True)
        try:
            meta = probe.meta
            status = checkpoint_status(probe)
        finally:
            probe.close()
        if "model" not in meta:
            raise PoolFormatError(f"{path} is a pool but holds no trainer state (created through the API?)",
                                  hint="train into a new --pool directory")
        stored = ModelConfig.from_dict(meta["model"])
        if model_cfg is not None and model_cfg != stored:
            diff = [k for k in asdict(stored) if asdict(stored)[k] != asdict(model_cfg)[k]]
            raise ConfigMismatchError(f"{path} was created with a different model ({', '.join(diff)} differ)")
        if o.data != meta.get("data", o.data):
            raise ConfigMismatchError(f"{path} was trained on --data {meta.get('data')}, not {o.data}")
        if o.seed != meta.get("seed", o.seed):
            raise ConfigMismatchError(f"{path} was trained with --seed {meta.get('seed')}, not {o.seed}")
        if o.data == "synthetic" and o.zipf_alpha != meta.get("zipf_alpha", o.zipf_alpha):
            raise ConfigMismatchError(f"{path} was trained with --zipf-alpha {meta.get('zipf_alpha')}, not {o.zipf_alpha}")
        rep = None
        target = None
        if coordinator is not None:
            c = status["committed_step"]
            g = coordinator.global_min(-1 if c is None else c)
            if c is not None and g < c:
                target = g
                log(f"pool {path} committed step {c}, but not every rank did: rolling back to step {g}")
        if status["needs_recovery"] or status["steps_to_roll_back"] or status["torn_bytes"] or target is not None:
            log(f"pool {path} needs recovery (steps {status['steps_to_roll_back']} were not committed): recovering")
            rep = recover(path, digest=False, target_step=target, rank_of_job=coordinator is not None)
            log(f"recovered to step {rep.committed_step}: rolled back {len(rep.rolled_back_steps)} steps, "
                f"{rep.rows_restored} rows, in {rep.seconds * 1e3:.1f} ms")
        pool = MemoryPool.open(path, dram_cache_bytes=o.dram_cache_bytes)
        return pool, stored, rep, False
    cfg = model_cfg
    if cfg is None:
        raise ValueError("a new pool needs a model config (pass --preset)")
    pool = MemoryPool.create(path, tier=o.tier, capacity_bytes=o.capacity_bytes)
    try:
        create_model_tables(pool, cfg, o.seed, features)
        pool.set_meta(model=cfg.to_dict(), seed=o.seed, data=o.data, zipf_alpha=o.zipf_alpha,
                      kind="dlrm-cxl-trainer")
        if o.dram_cache_bytes is not None:
            # Reopen so that the DRAM budget is split over all the tables, as on every later open.
            pool.persist()
            pool.close()
            pool = MemoryPool.open(path, dram_cache_bytes=o.dram_cache_bytes)
    except BaseException:
        pool.close()
        destroy_pool(path)
        raise
    return pool, cfg, None, True


class Trainer:
    """Trains one process's share. ``dist``: a :class:`~dlrm_cxl.distributed.DistContext` when
    torchrun started several ranks (tables sharded table-wise, dense part data-parallel)."""

    def __init__(self, options: TrainOptions, model_cfg: ModelConfig | None = None,
                 log: Callable[[str], None] | None = None, dist=None):
        validate_options(options)
        self.o = options
        self.dist = dist
        self.log = log or (lambda s: print(s, flush=True))
        if dist is not None and dist.rank != 0:
            self.log = lambda s: None
        if options.threads:
            torch.set_num_threads(options.threads)
        if dist is None:
            opened = open_training_pool(options, model_cfg, self.log)
        else:
            opened = self._open_rank_pool(model_cfg)
        self.pool, self.cfg, self.recovery, created = opened
        try:
            self._build(created)
        except BaseException:
            self.pool.close()
            raise

    def _open_rank_pool(self, model_cfg):
        from .distributed import prepare_job_dir, rank_dir

        d, o = self.dist, self.o
        job = {"seed": o.seed, "data": o.data, "model": model_cfg.to_dict() if model_cfg else None}
        exists = prepare_job_dir(o.pool, d, fresh=o.fresh, job=job, log=self.log)
        if not exists and model_cfg is None:
            raise ValueError("a new pool needs a model config (pass --preset)")
        return open_training_pool(o, model_cfg, self.log, path=rank_dir(o.pool, d.rank),
                                  features=d.features, coordinator=d)

    def _build(self, created: bool) -> None:
        o, cfg = self.o, self.cfg
        # Every RNG the process has is seeded (and part of the dense state and of the digest),
        # so the same seed gives the same state whatever ran in this process before.
        torch.manual_seed(o.seed)
        random.seed(o.seed)
        np.random.seed(o.seed % 2**32)
        features = self.dist.features if self.dist is not None else None
        self.model = PoolDLRM(cfg, self.pool, dense_device=o.device, features=features)
        # fbgemm's fused kernels in place on the pool (see model.py); the reference path when a
        # table is behind a DRAM row cache, or with several ranks (tables sharded).
        self.fused = self.dist is None and o.kernel == "fused" and self.model.bind_fused(self.pool)
        self.dense_opt = build_dense_optimizer(cfg, self.model.parameters())
        self.sparse_opt = SparseOptimizer(cfg.embedding_optimizer, self.pool, self.model.tables)
        self.spec = data_spec(cfg)
        self.source = make_data_source(o.data, self.spec, seed=o.seed, skip_bad_lines=o.skip_bad_lines,
                                       alpha=o.zipf_alpha)
        self.crash = CrashPlan(*o.crash_at, seed=o.seed) if o.crash_at else None
        if self.dist is not None and self.crash is not None and (
                self.dist.rank != o.crash_rank or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"):
            self.crash = None  # only the chosen rank, and only once per job (not after a restart)
        self._positions: dict[int, dict | None] = {}
        ckpt_cls = UndoLogCheckpointer if o.checkpoint == "undo" else NoCheckpointer
        extra = {"coordinator": self.dist} if self.dist is not None and o.checkpoint == "undo" else {}
        self.dense_every = o.dense_every or default_dense_every(self.pool)
        self.ckpt = ckpt_cls(self.pool, self._live_dense_state, dense_every=self.dense_every, crash=self.crash,
                             **extra)
        if created:
            self.step = 0
            self._positions[0] = None
            self.ckpt.checkpoint_now(0)  # step 0 (the initial state) is the first recovery point
        else:
            step, state = committed_state(self.pool)
            if state is None:
                raise PoolFormatError(
                    f"{self.pool.path} holds tables but no checkpoint: its creation was interrupted "
                    f"before the first commit", hint="start over with --fresh")
            self._load_dense(state)

    # -- dense state
    def _dense_state(self, step: int, *, copy: bool = True) -> dict:
        return capture_dense_state(step, self.model, self.dense_opt, self._positions.get(step), copy=copy)

    def _live_dense_state(self, step: int) -> dict:
        # For the checkpointer, which packs (copies) the tensors into its buffer at once.
        return self._dense_state(step, copy=False)

    def _load_dense(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.dense_opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.step = state["step"]
        self._positions = {self.step: state["data_position"]}

    def digest(self, *, resume: bool = True) -> str:
        """The state digest (``resume=False``: the model digest); with several ranks, the job's
        (the same on every rank)."""
        mine = state_digest(self.pool, self._dense_state(self.step), resume=resume)
        if self.dist is None:
            return mine
        from .distributed import combine_digests

        return combine_digests(self.dist.gather_strings(mine))

    # -- one step
    def train_step(self, k: int, batch) -> float:
        """One step. The call order of the checkpointer (checkpointing/base.py) around fbgemm's
        fused kernels: log the before-images of the rows the step will change, forward, and the
        write-ahead barrier right before the fused backward changes them in place; commit."""
        if self.dist is not None:
            return self._train_step_sharded(k, batch)
        if not self.fused:
            return self._train_step_reference(k, batch)
        ck, model = self.ckpt, self.model
        ck.begin_step(k)
        try:
            with _phase("plan"):
                plan = model.plan(batch.sparse, fused=True)
            with _phase("log_before_image"):
                ck.log_before_image(self.sparse_opt.touched(plan))
            with _phase("forward"):
                logits, pooled = model.forward_fused(batch.dense, plan)
                loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(logits.device))
                if not bool(torch.isfinite(loss)):
                    self._diverged(k, float(loss.detach()))
            with _phase("backward_and_fused_update"):
                self.dense_opt.zero_grad(set_to_none=True)
                # The gradient of the pooled output is ready just before fbgemm's backward updates
                # the rows in place: the write-ahead barrier goes exactly there, so the undo log's
                # write overlaps the forward and the dense backward.
                pooled.register_hook(lambda g: self._barrier(ck, k, g))
                loss.backward()
                ck.hit("mid-update")  # rows updated, dense step not yet
            with _phase("dense_optimizer"):
                ck.update(self.dense_opt.step)
        except BaseException:
            ck.abort()  # (what `with ck.step(k)` does; spelled out to time the commit below)
            raise
        with _phase("commit"):
            ck.commit(k, final=(k == self.o.steps))
        self.step = k
        return float(loss.detach())

    def _barrier(self, ck, k: int, grad: torch.Tensor) -> None:
        # A non-finite gradient would write non-finite rows: refuse before anything is written
        # (the loss can be finite while a gradient is not, e.g. after an overflow in the MLP).
        if not _all_finite(grad):
            raise TrainingDivergedError(f"the embedding gradient of step {k} is not finite (the loss is); the "
                                        f"step was not applied, the pool stays at step {k - 1}")
        ck.persist()
        ck.mark_updated()

    def _train_step_reference(self, k: int, batch) -> float:
        ck, model = self.ckpt, self.model
        with ck.step(k, final=(k == self.o.steps)):
            plan = model.plan(batch.sparse)
            ck.log_before_image(self.sparse_opt.touched(plan))
            logits, pooled = model(batch.dense, plan)
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(logits.device))
            if not bool(torch.isfinite(loss)):
                self._diverged(k, float(loss.detach()))
            self.dense_opt.zero_grad(set_to_none=True)
            loss.backward()
            updates = self.sparse_opt.compute(plan, pooled.grad, ck.before_images())
            ck.persist()
            self._apply(ck, updates)
            self.step = k
        return float(loss.detach())

    def _apply(self, ck, updates) -> None:
        # "mid-update" fires after half of the tables (after the first, with one table).
        half = max(1, len(updates) // 2)

        def apply():
            self.sparse_opt.apply(updates, between=lambda i: ck.hit("mid-update") if i == half - 1 else None)
            self.dense_opt.step()

        ck.update(apply)

    def _diverged(self, k: int, loss: float):
        # Nothing of step k was applied; abort() (leaving the step block) drops its undo log.
        # Make the last good step a recovery point, so the pool needs no recovery afterwards.
        raise TrainingDivergedError(f"loss is {loss} at step {k}; the step was not applied, the pool "
                                    f"stays at step {k - 1}")

    def _train_step_sharded(self, k: int, batch) -> float:
        """One step of a rank: see dlrm_cxl.distributed for the exchange."""
        ck, model, d = self.ckpt, self.model, self.dist
        local = d.local_slice(batch.labels.numel())
        with ck.step(k, final=(k == self.o.steps)):
            plan = model.plan(batch.sparse)            # this rank's tables, the whole batch
            ck.log_before_image(self.sparse_opt.touched(plan))
            pooled = d.pooled_to_samples(model.pooled(plan)).to(model.dense_device).requires_grad_(True)
            logits = model.forward_pooled(batch.dense[local], pooled)
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels[local].to(logits.device))
            global_loss = d.mean(float(loss.detach()))
            if not np.isfinite(global_loss):  # every rank sees the same value: all stop together
                self._diverged(k, global_loss)
            self.dense_opt.zero_grad(set_to_none=True)
            loss.backward()
            d.average_gradients(self.model.parameters())
            # d(mean over the global batch)/d(pooled) = (1/W) * d(local mean)/d(pooled)
            grad = d.grads_to_owners(pooled.grad / d.world)
            updates = self.sparse_opt.compute(plan, grad, ck.before_images())
            ck.persist()
            self._apply(ck, updates)
            self.step = k
        return global_loss

    # -- the loop
    def run(self) -> TrainSummary:
        o = self.o
        start = self.step
        self.log(f"dlrm-cxl: pool {o.pool} | tier {self.pool.tier}: {self.pool.durability} | "
                 f"checkpoint {o.checkpoint} (recovery point every {self.dense_every} steps) | step {start} -> {o.steps}")
        losses: list[float] = []
        evals = []
        io0 = io_write_bytes()
        t0 = time.perf_counter()
        n = max(o.steps - start, 0)
        bar = None
        if o.progress and n and (self.dist is None or self.dist.rank == 0):
            from tqdm import tqdm

            bar = tqdm(total=o.steps, initial=start, unit="step", file=sys.stderr, dynamic_ncols=True)
        last_pos = self._positions.get(start)
        try:
            if n:
                with Prefetcher(self.source.iter_batches(last_pos)) as batches:
                    for k in range(start + 1, o.steps + 1):
                        batch, pos = next(batches)
                        self._positions = {self.step: self._positions.get(self.step), k: pos}
                        ts = time.perf_counter()
                        losses.append(self.train_step(k, batch))
                        last_pos = pos
                        if self.crash is not None:
                            self.crash.expected_step_seconds = max(time.perf_counter() - ts, 1e-3)
                        if bar is not None:
                            el = time.perf_counter() - t0
                            bar.set_postfix(loss=f"{losses[-1]:.4f}",
                                            samples_s=f"{(k - start) * self.cfg.batch_size / el:,.0f}")
                            bar.update(1)
                        if o.eval_every and k % o.eval_every == 0:
                            evals.append({"step": k, **self.evaluate(o.eval_batches)})
                            self.log(f"eval at step {k}: auc {evals[-1]['auc']:.4f} logloss {evals[-1]['logloss']:.4f}")
            self.ckpt.close()
        finally:
            if bar is not None:
                bar.close()
        dt = time.perf_counter() - t0
        io1 = io_write_bytes()
        samples = n * self.cfg.batch_size
        summary = TrainSummary(
            pool=o.pool, tier=self.pool.tier, durability=self.pool.durability, start_step=start,
            end_step=self.step, steps_run=n, samples=samples, seconds=dt,
            samples_per_s=samples / dt if dt > 0 and n else 0.0,
            final_loss=float(np.mean(losses[-10:])) if losses else None,
            epochs=(last_pos or {}).get("epoch") if isinstance(last_pos, dict) else None,
            checkpoint=_with_device_bytes(self.ckpt.stats.as_dict(), io1 - io0 if io0 >= 0 else -1, n),
            recovered=self.recovery.as_dict() if self.recovery else None,
            eval=evals, pool_stats=self.pool.stats.as_dict(),
            distributed=None if self.dist is None else {
                "world_size": self.dist.world, "comm_seconds": self.dist.comm_seconds,
                "coord_seconds": self.dist.coord_seconds})
        return summary

    def evaluate(self, batches: int, data: str | None = None) -> dict:
        src = data or self.o.eval_data
        if src is None and self.o.data == "synthetic":
            source = HeldOutSynthetic(SyntheticData(self.spec, seed=self.o.seed, alpha=self.o.zipf_alpha))
        else:
            source = make_data_source(src or self.o.data, self.spec, seed=self.o.seed,
                                      skip_bad_lines=self.o.skip_bad_lines)
        return evaluate(self.model, source, batches)

    def close(self) -> None:
        try:
            self.ckpt.close()
        finally:
            self.pool.close()


def _all_finite(t: torch.Tensor) -> bool:
    lo, hi = torch.aminmax(t)  # one pass, no temporary; NaN propagates
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _phase(name: str):
    """A named range for torch.profiler (tools/profile_step.py); next to free when not profiling."""
    return torch.profiler.record_function(f"dlrm_cxl.{name}")


def io_write_bytes() -> int:
    """Bytes this process caused to be written to storage so far (``write_bytes`` of
    /proc/self/io: all threads, page-granular, counted when a page is dirtied); -1 if unknown."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _with_device_bytes(d: dict, device_bytes: int, steps: int) -> dict:
    """Per step: touched-row bytes (before-images on direct tiers, after-images on journaled
    ones), dense bytes, bytes written to the device, and their ratio (write amplification)."""
    n = max(steps, 1)
    rows = (d["log_bytes"] + d["table_bytes_persisted"]) / n
    dense = d["dense_bytes"] / n
    d["touched_row_bytes_per_step"] = rows
    d["dense_bytes_per_step"] = dense
    d["device_write_bytes_per_step"] = device_bytes / n if device_bytes >= 0 else None
    d["write_amplification"] = (device_bytes / n) / (rows + dense) if device_bytes >= 0 and rows + dense else None
    return d


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


@torch.no_grad()
def evaluate(model: PoolDLRM, source, batches: int) -> dict:
    """AUC and log loss over ``batches`` batches of ``source`` (from its start)."""
    from torchmetrics.functional.classification import binary_auroc

    preds, labels = [], []
    for i, (batch, _) in enumerate(source.iter_batches(None)):
        if i >= batches:
            break
        logits, _ = model(batch.dense, model.plan(batch.sparse))
        preds.append(torch.sigmoid(logits.float().cpu()))
        labels.append(batch.labels)
    p = torch.cat(preds)
    y = torch.cat(labels)
    logloss = float(F.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y))
    auc = float(binary_auroc(p, y.long())) if 0 < float(y.sum()) < y.numel() else float("nan")
    return {"auc": auc, "logloss": logloss, "samples": int(y.numel())}
