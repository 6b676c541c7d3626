"""The training loop: stream batches, look up and update rows in the pool, checkpoint each step.

``Trainer(options, model_cfg).run()`` trains until ``options.steps`` steps have been done *in
total*: on a pool that already holds training state it recovers (if a crash left an
unfinished step) and continues from the committed step, so running the same command again
after a crash ends at the same step with the same state.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import os
import random
import sys
import time
from typing import Callable

import numpy as np
import torch

from checkpointing import CrashPlan, NoCheckpointer, UndoLogCheckpointer, committed_state, state_digest
from checkpointing.digest import state_and_model_digest
from checkpointing.policy import WindowConfig
from checkpointing.recovery import replay_witnesses
from checkpointing.undo import loss_bits
from memory_pool import PoolFormatError

from .cores import CoreYield
from .data import Prefetcher, make_data_source
from .data.prefetch import prefetch_nice
from .errors import ReplayMismatchError, TrainingDivergedError
from .evaluation import eval_source, evaluate
from .metrics import open_metrics
from .lookahead import WorkingCopyBound, cache_report
from .model import ModelConfig, PoolDLRM, SparseOptimizer
from .options import TrainOptions, TrainSummary, data_spec, resolve_writer, validate_options
from .provisioning import build_dense_optimizer, capture_dense_state, open_training_pool
from .replay_source import check_replay_settings, check_replay_source, data_identity, run_settings
from .step import make_path
from .step import phase as _phase

__all__ = ["Trainer", "io_write_bytes"]


class Trainer:
    """Trains one process's share. ``dist``: a :class:`~dlrm_cxl.distributed.DistContext` when
    torchrun started several ranks (tables sharded table-wise, dense part data-parallel)."""

    def __init__(self, options: TrainOptions, model_cfg: ModelConfig | None = None,
                 log: Callable[[str], None] | None = None, dist=None):
        validate_options(options)
        prefetch_nice()   # (the environment's knob checked before any pool is made or opened)
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
        from checkpointing.jobdir import rank_dir

        from .distributed import prepare_job_dir

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
        # The kernel path of every step, chosen once (dlrm_cxl/step.py).
        self.path = make_path(self.model, self.sparse_opt, self.dense_opt, fused=self.fused, dist=self.dist)
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
        # (after --threads is applied above: the choice compares the cores with torch's threads)
        self.writer = resolve_writer(o.writer, journaled=self.pool.journaled,
                                     ranks=1 if self.dist is None else self.dist.world)
        if o.checkpoint == "undo":
            extra["inline"] = self.writer == "inline"
        self.window_cfg = WindowConfig(window=o.window, recovery_budget=o.recovery_budget)
        self.ckpt = ckpt_cls(self.pool, self.live_dense_state, window=self.window_cfg, crash=self.crash, **extra)
        # A journaled pool's working copy behind a DRAM cache, kept near the budget (lookahead.py).
        self.bound = WorkingCopyBound.for_trainer(self.pool, self.model, self.ckpt, o.checkpoint)
        # One intra-op thread fewer while a background compaction runs, where that changes no
        # result (dlrm_cxl/cores.py). Not with several ranks or a GPU.
        self.cores = CoreYield(self.pool, self.model, cfg.batch_size, cfg.num_dense) \
            if self.dist is None and o.device == "cpu" else None
        self.after_step: Callable[[int], None] | None = None   # (dlrm_cxl.replay's crash test)
        self.replayed = 0
        # Committed steps after the pool's recovery point (recovery windows): re-run and checked.
        self.witness: dict[int, dict] = {}
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
            last = (self.pool.meta.get("history") or [{}])[-1]
            if "data" in last.get("override", {}) and last.get("step") == self.step:
                # --override data at this step: the new file is read from its start (the
                # position in the state is the old file's)
                self._positions = {self.step: None}
            if o.checkpoint == "undo":
                self.witness = replay_witnesses(self.pool)
        meta = self.pool.meta
        if self.witness:
            # A replay needs the data the steps read: never replay other data.
            check_replay_source(meta.get("data_identity"), o.data, first=min(self.witness),
                                last=max(self.witness), step=self.step)
            check_replay_settings(meta.get("run"), first=min(self.witness), last=max(self.witness), step=self.step)
            self.ckpt.carry = dict(self.witness)
        else:
            settings = run_settings(torch.get_num_threads(), "fused" if self.fused else "reference", o.device,
                                    o.dram_cache_bytes)
            ident = data_identity(o.data)
            if meta.get("data_identity") != ident or meta.get("run") != settings:
                self.pool.set_meta(data_identity=ident, run=settings)

    # -- dense state
    def _dense_state(self, step: int, *, copy: bool = True) -> dict:
        return capture_dense_state(step, self.model, self.dense_opt, self._positions.get(step), copy=copy)

    def dense_state(self, step: int) -> dict:
        """The dense snapshot of ``step`` (copies): parameters, dense optimizer state, data
        position, RNG states. What a checkpointer stores and the digest covers."""
        return self._dense_state(step)

    def set_batch_position(self, k: int, position) -> None:
        """Step ``k`` trains on the batch at data ``position`` (part of step ``k``'s dense state;
        the loop does this for every batch it takes from its source)."""
        self._positions = {self.step: self._positions.get(self.step), k: position}

    def position_of(self, step: int):
        """The data position of the batch ``step`` trained on (None if unknown here)."""
        return self._positions.get(step)

    def live_dense_state(self, step: int) -> dict:
        """:meth:`dense_state` with the live tensors instead of copies: for a checkpointer that
        copies them at once (and before the next dense optimizer step)."""
        return self._dense_state(step, copy=False)

    def _load_dense(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.dense_opt.load_state_dict(state["optimizer"])
        for group in self.dense_opt.param_groups:  # (the pool's, which --override dense_lr may have changed)
            group["lr"] = self.cfg.dense_lr
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.step = state["step"]
        self._positions = {self.step: state["data_position"]}

    def digest(self, *, resume: bool = True) -> str:
        """The state digest (``resume=False``: the model digest); with several ranks, the job's
        (the same on every rank)."""
        return self._job_digest(state_digest(self.pool, self._dense_state(self.step), resume=resume))

    def digests(self) -> tuple[str, str]:
        """(the state digest, the model digest), the tables read once for both (what ``train``
        prints at its end: reading `kaggle`'s 8.8 GB twice from a home beyond DRAM took minutes)."""
        state, model = state_and_model_digest(self.pool, self._dense_state(self.step))
        return self._job_digest(state), self._job_digest(model)

    def _job_digest(self, mine: str) -> str:
        if self.dist is None:
            return mine
        from .distributed import combine_digests

        return combine_digests(self.dist.gather_strings(mine))

    # -- one step
    def plan(self, batch):
        """Validate a batch's sparse ids and index them for this trainer's path (raises
        ``InvalidIdsError``): nothing in it depends on the pool's state, so the loop makes the
        plan of the next batches on the prefetch thread, off the step's critical path."""
        if self.fused:
            # (the rows, also when only an on-demand replay of the journal needs them)
            return self.model.plan(batch.sparse, fused=True, rows=self.ckpt.needs_touched or self.pool.rows_pending > 0)
        return self.model.plan(batch.sparse)

    def run_step(self, k: int, batch, position, plan) -> tuple[float, float]:
        """Step ``k`` as :meth:`run` drives it (and the benchmarks that time it): the batch's data
        position recorded, the step trained, its time given to the checkpointer (the recovery
        window follows the measured step time), then a journaled working copy given back at a
        recovery point (``WorkingCopyBound``) -- not at the run's last step: the pool is closed
        next, which gives the whole working copy back. Returns (the loss, the seconds
        ``train_step`` took)."""
        self.set_batch_position(k, position)
        ts = time.perf_counter()
        loss = self.train_step(k, batch, plan)
        seconds = time.perf_counter() - ts
        self.ckpt.observe_step(seconds)
        # (A trim there was work for nothing: the rows it writes stay in the journal too, and its
        # new mappings are unmapped at once. It was most of `dlrm-cxl recover`'s time on a pool
        # behind a cache, whose open replays journal rows and so trims at its first recovery
        # point -- the replay's last step: 7.0 of 12.2 s on `kaggle` after 2,700 steps.)
        if self.bound is not None and k < self.o.steps:
            self.bound.after_commit(k)
        return loss, seconds

    def train_step(self, k: int, batch, plan=None) -> float:
        """One step, the same for every kernel path (``self.path``, dlrm_cxl/step.py: the call
        order of the checkpointer around it). ``plan``: ``self.plan(batch)`` if the caller made
        it already."""
        ck = self.ckpt
        if self.cores is not None:
            self.cores.before_step()
        ck.begin_step(k)
        try:
            with _phase("plan"):
                if plan is None:
                    plan = self.plan(batch)
            with _phase("log_before_image"):
                ck.log_before_image(self.sparse_opt.touched(plan))
            with _phase("forward"):
                loss, shown, pooled = self.path.forward(batch, plan)
                if not math.isfinite(float(shown)):
                    self._diverged(k, float(shown))
                witness = self._witness(k, shown)
            with _phase("backward_and_fused_update"):
                self.dense_opt.zero_grad(set_to_none=True)
                self.path.backward_and_update(ck, k, loss, pooled, plan)
        except BaseException:
            ck.abort()  # (what `with ck.step(k)` does; spelled out to time the commit below)
            raise
        with _phase("commit"):
            ck.commit(k, final=(k == self.o.steps), witness=witness)
        self.step = k
        return float(shown)

    def _witness(self, k: int, loss) -> dict:
        """Step k's witness (its loss's bits, its batch's position), checked against the record
        of a step being replayed before anything of the step is applied: a difference raises
        ReplayMismatchError and, as for a diverged loss, the pool stays at step k - 1."""
        w = {"loss": loss_bits(loss), "position": _json(self._positions.get(k))}
        rec = self.witness.get(k)
        if rec is not None:
            if rec != w:
                what = "loss" if rec.get("loss") != w["loss"] else "data position"
                raise ReplayMismatchError(
                    f"replay of step {k}: its {what} differs from the one recorded before the crash "
                    f"({rec.get(what.split()[-1])} recorded, {w[what.split()[-1]]} now): the step is not deterministic "
                    f"here; the pool stays at step {k - 1}, the last step that agreed")
            self.replayed += 1
        return w

    def _diverged(self, k: int, loss: float):
        # Nothing of step k was applied: the abort() that follows (leaving the step block, or
        # the fused path's except) has no rows to put back and, with one process, makes step
        # k - 1 a recovery point, so the pool needs no recovery afterwards (checkpointing/undo.py).
        raise TrainingDivergedError(f"loss is {loss} at step {k}; the step was not applied, the pool "
                                    f"stays at step {k - 1}")

    # -- the loop
    def run(self) -> TrainSummary:
        o = self.o
        start = self.step
        self.log(f"dlrm-cxl: pool {o.pool} | tier {self.pool.tier}: {self.pool.durability} | "
                 f"checkpoint {o.checkpoint} ({self._window_text()}"
                 f"{'; journal writer ' + ('inline' if self.writer == 'inline' else 'on its own thread') if o.checkpoint == 'undo' else ''}) | step {start} -> {o.steps}")
        if self.witness:
            ks = sorted(self.witness)
            self.log(f"replaying steps {ks[0]}..{ks[-1]} (committed before the crash; each is checked against its "
                     f"record) from step {start}, the start of their recovery window")
        losses: list[float] = []
        evals = []
        io0 = io_write_bytes()
        t0 = time.perf_counter()
        n = max(o.steps - start, 0)
        bar = None
        if o.progress and n and (self.dist is None or self.dist.rank == 0):
            from .progress import progress_bar  # a tqdm bar on a terminal, else a plain line every 10 s

            bar = progress_bar(total=o.steps, initial=start, file=sys.stderr)
        metrics = open_metrics(self)  # <pool>/metrics.jsonl: a line per step (dlrm_cxl/metrics.py)
        last_pos = self._positions.get(start)
        # Everything built so far (torch, the model, the pool) lives as long as the run: moved
        # out of the cyclic GC's reach, a full collection no longer walks it (measured: one
        # 190 ms collection per ~100 steps on `small`, ~2 ms a step).
        # (Not for a short run -- a replay of a few steps after a crash, where the collection
        # alone took 110 ms of a recovery's second -- which rarely reaches a full collection.)
        # Thawed when the run ends, whatever the way: frozen objects are never collected, so a
        # closed trainer's pool, model and tables (their cycles) would hold their memory for the
        # life of the process (`small`: ~220 MB each time; a caller's own freeze is left alone).
        froze = n > 32 and gc.get_freeze_count() == 0
        if froze:
            gc.collect()
            gc.freeze()
        try:
            if n:
                # (no batch past the last step is planned: its rows would be read into the cache
                # for nothing -- a one-step replay after a crash read 55.6k rows, not 16.1k)
                ahead = itertools.islice(self.source.iter_batches(last_pos), n)
                with Prefetcher(self.plan_ahead(ahead), depth=o.prefetch_batches) as batches:
                    for k in range(start + 1, o.steps + 1):
                        batch, pos, plan = next(batches)
                        loss, seconds = self.run_step(k, batch, pos, plan)
                        losses.append(loss)
                        metrics.step(k, losses[-1])
                        last_pos = pos
                        if self.after_step is not None:
                            self.after_step(k)
                        if self.crash is not None:
                            self.crash.expected_step_seconds = max(seconds, 1e-3)
                        if bar is not None:
                            el = time.perf_counter() - t0
                            bar.set_postfix(loss=f"{losses[-1]:.4f}",
                                            samples_s=f"{(k - start) * self.cfg.batch_size / el:,.0f}")
                            bar.update(1)
                        if o.eval_every and k % o.eval_every == 0:
                            evals.append({"step": k, **self.evaluate(o.eval_batches)})
                            metrics.evaluation(k, evals[-1])
                            self.log(f"eval at step {k}: auc {evals[-1]['auc']:.4f} logloss {evals[-1]['logloss']:.4f}")
            if self.crash is not None:
                self.crash.await_armed()  # `K:random` kills even when the run outlasts its timer
            self.ckpt.close()
        finally:
            metrics.close()
            if bar is not None:
                bar.close()
            if froze:
                gc.unfreeze()
        dt = time.perf_counter() - t0
        io1 = io_write_bytes()
        samples = n * self.cfg.batch_size
        summary = TrainSummary(
            pool=o.pool, tier=self.pool.tier, durability=self.pool.durability, start_step=start,
            end_step=self.step, steps_run=n, samples=samples, seconds=dt,
            samples_per_s=samples / dt if dt > 0 and n else 0.0,
            final_loss=float(np.mean(losses[-10:])) if losses else None,
            epochs=(last_pos or {}).get("epoch") if isinstance(last_pos, dict) else None,
            checkpoint=_with_device_bytes(self.ckpt.stats.as_dict(), io1 - io0 if io0 >= 0 else -1, n)
            | ({"writer": self.writer} if o.checkpoint == "undo" else {}),
            recovered=self.recovery.as_dict() if self.recovery else None,
            replayed_steps=self.replayed, window=self.ckpt.window,
            eval=evals, pool_stats={**self.pool.stats.as_dict(), **cache_report(self.model, self.pool, self.bound)},
            distributed=None if self.dist is None else {
                "world_size": self.dist.world, "comm_seconds": self.dist.comm_seconds,
                "coord_seconds": self.dist.coord_seconds})
        return summary

    def _window_text(self) -> str:
        if self.o.checkpoint != "undo":
            return "no recovery point until the run ends"
        c = self.window_cfg
        if c.window == 1:
            return "a recovery point every step"
        if c.window is not None:
            return f"recovery window {c.window} steps: a crash replays at most {c.window - 1}"
        return (f"recovery budget {c.recovery_budget:g} s: the window is the steps a recovery replays in it, "
                f"from the measured step time")

    def plan_ahead(self, batches):
        """``(batch, position, plan)``: the plans are made on the prefetch thread, ahead of the
        steps. A batch with invalid ids raises there, and the Prefetcher re-raises it at that
        batch's turn, before its step begins: every step before it is done and committed."""
        for batch, pos in batches:
            yield batch, pos, self.plan(batch)

    def evaluate(self, batches: int, data: str | None = None) -> dict:
        source = eval_source(data or self.o.eval_data, self.spec, train_data=self.o.data, seed=self.o.seed,
                             zipf_alpha=self.o.zipf_alpha, skip_bad_lines=self.o.skip_bad_lines)
        return evaluate(self.model, source, batches)

    def close(self) -> None:
        """Close the checkpointer (its last commit made durable) and the pool. The pool, the
        model and the checkpointer reference one another: their memory (the tables' working
        copy, the caches) returns at the next full collection of the cyclic GC once the trainer
        is dropped; ``gc.collect()`` returns it at once (not done here: it costs ~150 ms with
        torch loaded, inside `recover`'s timed second)."""
        if getattr(self, "cores", None) is not None:
            self.cores.restore()
        try:
            self.ckpt.close()
        finally:
            self.pool.close()


def _json(x):
    """``x`` as it reads back from JSON (tuples become lists), for comparing with a record."""
    return json.loads(json.dumps(x)) if x is not None else None


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
