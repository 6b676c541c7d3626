#!/usr/bin/env python
"""Training throughput of dlrm-cxl on each pool tier vs TorchRec's DLRM, side by side in one run.

Variants (all on the same pre-generated SyntheticData batches, the same model shape, the same
optimizers: row-wise Adagrad on the embeddings, Adagrad on the dense part):

* ``<tier>/none`` and ``<tier>/undo`` for each ``--tiers`` entry: dlrm-cxl's Trainer driven
  through its Python API (``Trainer.train_step``), tables in a pool of that tier,
  ``--checkpoint none`` or ``undo`` (recovery windows from ``--recovery-budget``, or ``--window W``);
* ``torchrec``: ``torchrec.models.dlrm.DLRM`` wrapped in ``DistributedModelParallel`` at world
  size 1 on gloo (one process; process group from a ``file://`` store), every table
  TABLE_WISE with the FUSED compute kernel and ``EmbOptimType.EXACT_ROWWISE_ADAGRAD`` fused
  params, dense parameters through ``torch.optim.Adagrad``.

Pool creation, table initialisation and TorchRec's sharding are done before any timing. After
``--warmup`` untimed steps per variant, ``--rounds`` rounds each run every variant for one
window of ``--steps`` steps, interleaved (A B C, B C A, ...). A window's time includes
waiting, at its end, for the variant's own background checkpoint work (so background work
never spills into another variant's window; conservative for ``undo``). Reported: the
median samples/s over rounds, its spread, and the ratio of medians to TorchRec.

Usage::

    python tools/bench_train.py                      # small preset, batch 2048, shm,pmem,power-sim
    python tools/bench_train.py --quick              # tiny preset, a few steps: smoke test
    python tools/bench_train.py --tiers shm --rounds 9 --steps 20 --json out.json

The module also holds the harness that ``tools/bench_checkpoint.py`` reuses.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable

_ROOT = Path(__file__).resolve().parent.parent
for _dir in (_ROOT, _ROOT / "tools"):   # the packages, and tools/baselines.py
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from baselines import BytesFloorCheckpointer  # noqa: E402
from dlrm_cxl.data import Prefetcher, SyntheticData  # noqa: E402
from dlrm_cxl.model import PRESETS, ModelConfig, torchrec_dlrm  # noqa: E402
from dlrm_cxl.options import TrainOptions, data_spec  # noqa: E402
from dlrm_cxl.trainer import Trainer  # noqa: E402
from dlrm_cxl.trainer import io_write_bytes as _io_write_bytes  # noqa: E402
from memory_pool import destroy_pool  # noqa: E402
from memory_pool.lifecycle import gc as gc_shm_regions  # noqa: E402

__all__ = ["make_batches", "PoolVariant", "TorchRecVariant", "interleave", "median", "quartiles", "paired_ratios",
           "fmt_table", "command_line", "machine_line", "drain", "io_write_bytes"]

NEVER = 10 ** 12  # TrainOptions.steps: never reached, so no step is the "final" one


# --------------------------------------------------------------------------- helpers


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])


def machine_line() -> str:
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return (f"{platform.node()} | {os.cpu_count()} cpus | torch {torch.__version__}, "
            f"{torch.get_num_threads()} intra-op threads | load avg {load}")


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def quartiles(xs) -> tuple[float, float]:
    """The first and third quartiles of ``xs`` (both the value itself for one value)."""
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def _pct_with_quartiles(ratios: list[float]) -> str:
    lo, hi = quartiles(ratios)
    return f"{100 * (median(ratios) - 1):+.1f}% ({100 * (lo - 1):+.1f}..{100 * (hi - 1):+.1f})"


def paired_ratios(xs: list[float], base: list[float]) -> list[float]:
    """Per round, a variant's samples/s over its baseline's in the same round: the two windows
    ran next to each other, so slow drifts of this machine's speed (other tenants) cancel out,
    which a ratio of medians over the whole run does not do."""
    return [x / b for x, b in zip(xs, base) if b > 0]


def make_batches(cfg: ModelConfig, n: int, seed: int = 0, alpha: float = 1.05) -> list:
    """``n`` SyntheticData batches, generated once and cycled by every variant."""
    src = SyntheticData(data_spec(cfg), seed=seed, alpha=alpha)
    out = []
    for batch, _ in src.iter_batches(None):
        out.append(batch)
        if len(out) == n:
            return out
    return out


def drain(ckpt) -> None:
    """Wait for a checkpointer's background work (the transaction in flight, compaction)."""
    ckpt.drain()


def fmt_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[("" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or ("l" + "r" * (len(headers) - 1))

    def line(r):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align))

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


# --------------------------------------------------------------------------- variants


class PoolVariant:
    """dlrm-cxl's Trainer on one tier, driven step by step through ``Trainer.train_step``.

    ``ckpt_factory(pool, dense_state_fn)``, when given, replaces the trainer's checkpointer
    (built with ``--checkpoint none``) before any step: how the baselines are measured.
    ``live_dense``: the factory gets the trainer's live dense state (no copies:
    ``Trainer.live_dense_state``) instead of copies.
    """

    def __init__(self, name: str, cfg: ModelConfig, batches: list, workdir: Path, *, tier: str,
                 checkpoint: str = "undo", window: int | None = 1, recovery_budget: float = 1.0, writer: str = "auto",
                 ckpt_factory: Callable | None = None, seed: int = 0, live_dense: bool = False):
        self.name, self.cfg, self.batches = name, cfg, batches
        self.live_dense = live_dense
        self.tier, self.checkpoint, self.window, self.recovery_budget = tier, checkpoint, window, recovery_budget
        self.writer = writer
        self.ckpt_factory = ckpt_factory
        self.path = workdir / ("pool-" + name.replace("/", "-").replace(" ", "").replace("=", ""))
        self.seed = seed
        self.trainer: Trainer | None = None
        self.k = 0
        self.durability = ""
        self.drain_seconds: list[float] = []

    def setup(self) -> None:
        o = TrainOptions(pool=str(self.path), steps=NEVER, tier=self.tier, seed=self.seed,
                         checkpoint="none" if self.ckpt_factory else self.checkpoint,
                         window=self.window, recovery_budget=self.recovery_budget, writer=self.writer, progress=False,
                         fresh=True)
        self.trainer = Trainer(o, self.cfg, log=lambda s: None)
        if self.ckpt_factory is not None:
            self.trainer.ckpt.close()
            tr = self.trainer
            self.trainer.ckpt = self.ckpt_factory(tr.pool, tr.live_dense_state if self.live_dense else tr.dense_state)
        self.k = self.trainer.step
        self.durability = self.trainer.pool.durability

    @property
    def stats(self):
        return self.trainer.ckpt.stats

    def steps(self, n: int) -> tuple[float, float]:
        """Run ``n`` steps; returns (seconds for the steps, seconds draining background work).
        As ``Trainer.run`` does, the batches' plans are made ahead on a prefetch thread."""
        tr = self.trainer
        nb = len(self.batches)
        batches = [self.batches[(k - 1) % nb] for k in range(self.k + 1, self.k + n + 1)]
        t0 = time.perf_counter()
        with Prefetcher((b, tr.plan(b)) for b in batches) as planned:
            for batch, plan in planned:
                k = self.k + 1
                tr.set_batch_position(k, {"batch": k})
                ts = time.perf_counter()
                tr.train_step(k, batch, plan)
                tr.ckpt.observe_step(time.perf_counter() - ts)  # (as Trainer.run: the window follows it)
                self.k = k
        t1 = time.perf_counter()
        drain(tr.ckpt)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def close(self) -> None:
        if self.trainer is not None:
            try:
                self.trainer.close()
            except Exception as exc:  # noqa: BLE001 - report, keep cleaning up
                print(f"warning: closing {self.name}: {exc}", file=sys.stderr)
            self.trainer = None
        try:
            destroy_pool(self.path)
        except Exception as exc:  # noqa: BLE001
            print(f"warning: removing {self.path}: {exc}", file=sys.stderr)


_PG_STORE: Path | None = None


def init_process_group(workdir: Path) -> None:
    """gloo, world size 1, rank 0, rendezvous through a file:// store."""
    import torch.distributed as dist

    global _PG_STORE
    if dist.is_initialized():
        return
    _PG_STORE = workdir / "gloo-store"
    dist.init_process_group("gloo", init_method=f"file://{_PG_STORE}", rank=0, world_size=1)


class TorchRecVariant:
    """TorchRec DLRM under DistributedModelParallel (world size 1, gloo), TABLE_WISE + FUSED,
    EXACT_ROWWISE_ADAGRAD fused into the backward; Adagrad on the dense parameters."""

    name = "torchrec"
    durability = "DRAM (torchrec DMP, world size 1, gloo)"

    def __init__(self, cfg: ModelConfig, batches: list, workdir: Path):
        self.cfg, self.batches, self.workdir = cfg, batches, workdir
        self.k = 0
        self.stats = None
        self.drain_seconds: list[float] = []

    def setup(self) -> None:
        import torch.distributed as dist
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed.embedding_types import EmbeddingComputeKernel
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
        from torchrec.distributed.types import ShardingType

        init_process_group(self.workdir)
        cfg = self.cfg
        eo = cfg.embedding_optimizer
        if eo.kind != "rowwise_adagrad" or cfg.dense_optimizer != "adagrad":
            raise ValueError("the TorchRec variant mirrors rowwise_adagrad + dense adagrad only")
        torch.manual_seed(0)
        model = torchrec_dlrm(cfg, device="meta")  # tables materialised (once) by DMP
        sharder = EmbeddingBagCollectionSharder(fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": eo.lr, "eps": eo.eps})
        constraints = {f: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value],
                                               compute_kernels=[EmbeddingComputeKernel.FUSED.value])
                       for f in cfg.feature_names}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import logging
            logging.getLogger("torchrec").setLevel(logging.ERROR)
            planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"),
                                               constraints=constraints)
            plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
            self.model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                                  sharders=[sharder])
        for f in cfg.feature_names:
            p = plan.get_plan_for_module("sparse_arch.embedding_bag_collection")[f]
            if p.sharding_type != ShardingType.TABLE_WISE.value or p.compute_kernel != EmbeddingComputeKernel.FUSED.value:
                raise RuntimeError(f"TorchRec planned {f} as {p.sharding_type}/{p.compute_kernel}")
        dense = [p for n, p in self.model.named_parameters() if ".embedding_bags." not in n]
        self.opt = torch.optim.Adagrad(dense, lr=cfg.dense_lr)

    def steps(self, n: int) -> tuple[float, float]:
        nb = len(self.batches)
        t0 = time.perf_counter()
        for _ in range(n):
            b = self.batches[self.k % nb]
            logits = self.model(b.dense, b.sparse).squeeze(-1)
            loss = F.binary_cross_entropy_with_logits(logits, b.labels)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            float(loss.detach())  # same host sync as Trainer.train_step
            self.k += 1
        return time.perf_counter() - t0, 0.0

    def close(self) -> None:
        self.model = None


# --------------------------------------------------------------------------- the run


def interleave(variants: list, *, warmup: int, steps: int, rounds: int, batch_size: int,
               on_window: Callable | None = None, log=print) -> dict[str, list[float]]:
    """Warm every variant up, then ``rounds`` rounds of one window each, rotating the order.
    Returns samples/s per window per variant (window time = steps + draining)."""
    for v in variants:
        if warmup:
            v.steps(warmup)
    # As Trainer.run does: what is built by now lives as long as the run, out of the cyclic GC's
    # reach (a full collection of it costs ~200 ms, in whichever window it falls).
    # Thawed at the end, as Trainer.run thaws: a caller that goes on (a test, a second
    # benchmark in the same process) gets the variants' memory back once it drops them.
    gc.collect()
    gc.freeze()
    try:
        out: dict[str, list[float]] = {v.name: [] for v in variants}
        for r in range(rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            parts = []
            for v in order:
                before = _snap(v)
                t_steps, t_drain = v.steps(steps)
                dt = t_steps + t_drain
                out[v.name].append(steps * batch_size / dt)
                v.drain_seconds.append(t_drain)
                if on_window is not None:
                    on_window(v, before, _snap(v), steps, dt)
                parts.append(f"{v.name} {out[v.name][-1]:,.0f}")
            log(f"  round {r + 1}/{rounds}: " + " | ".join(parts))
    finally:
        gc.unfreeze()
    return out


io_write_bytes = _io_write_bytes  # /proc/self/io write_bytes (one implementation: dlrm_cxl.trainer)


def _snap(v) -> dict:
    s = getattr(v, "stats", None)
    d = dict(vars(s)) if s is not None else {}
    d["io_write_bytes"] = io_write_bytes()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    d["cpu_seconds"] = ru.ru_utime + ru.ru_stime
    return d


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--batch-size", type=int, help="default: the preset's (2048 for small)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed window (default 10)")
    p.add_argument("--rounds", type=int, default=5, help="timed windows per variant (default 5)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first (default 5)")
    p.add_argument("--tiers", default="shm,pmem,power-sim", help="comma-separated (default shm,pmem,power-sim)")
    p.add_argument("--checkpoints", default="none,undo",
                   help="comma-separated subset of none,floor,undo (floor: the bytes of a recovery point copied "
                        "and checksummed, nothing else: BytesFloorCheckpointer in tools/baselines.py)")
    p.add_argument("--window", type=int, default=None,
                   help="undo and floor variants: a fixed recovery window of W steps (default: from --recovery-budget; floor: 1)")
    p.add_argument("--recovery-budget", type=float, default=1.0, help="undo variants: seconds (default 1.0)")
    p.add_argument("--writer", default="auto", help="undo variants: the journal writer (auto, thread, inline)")
    p.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec reference")
    p.add_argument("--num-batches", type=int, default=32, help="distinct pre-generated batches, cycled")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--workdir", type=Path, help="where pools go (default: a new dir under $TMPDIR; "
                   "must be on a real filesystem for pmem to mean disk)")
    p.add_argument("--json", type=Path, help="also write raw per-window numbers here")
    p.add_argument("--quick", action="store_true", help="tiny preset, few steps: a smoke test")
    a = p.parse_args(argv)
    if a.quick:
        a.preset = "tiny" if a.preset == "small" else a.preset
        a.steps, a.rounds, a.warmup, a.num_batches = min(a.steps, 5), min(a.rounds, 2), min(a.warmup, 2), 8
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = PRESETS[a.preset]
    if a.batch_size:
        cfg = replace(cfg, batch_size=a.batch_size)
    tiers = [t for t in a.tiers.split(",") if t]
    ckpts = [c for c in a.checkpoints.split(",") if c]
    own_workdir = a.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="dlrm-bench-train-")) if own_workdir else a.workdir
    workdir.mkdir(parents=True, exist_ok=True)

    print(f"$ {command_line()}")
    print(f"# {machine_line()}")
    print(f"# preset {a.preset}: {len(cfg.num_embeddings)} tables, {sum(cfg.num_embeddings):,} rows, dim "
          f"{cfg.embedding_dim}, {cfg.table_bytes / 1e6:.1f} MB of tables; batch {cfg.batch_size}; "
          f"windows of {a.steps} steps x {a.rounds} rounds after {a.warmup} warm-up steps; workdir {workdir}")
    batches = make_batches(cfg, a.num_batches)
    variants: list = []
    for t in tiers:
        for c in ckpts:
            if c == "floor":
                variants.append(PoolVariant(f"{t}/floor", cfg, batches, workdir, tier=t, live_dense=True,
                                            ckpt_factory=lambda pool, ds: BytesFloorCheckpointer(pool, ds, window=a.window or 1)))
            elif c in ("none", "undo"):
                variants.append(PoolVariant(f"{t}/{c}", cfg, batches, workdir, tier=t, checkpoint=c,
                                            window=a.window, recovery_budget=a.recovery_budget, writer=a.writer))
            else:
                raise SystemExit(f"--checkpoints: unknown {c!r} (none, floor, undo)")
    if not a.no_torchrec:
        variants.append(TorchRecVariant(cfg, batches, workdir))
    crit: dict[str, list[float]] = {v.name: [] for v in variants}
    wait: dict[str, list[float]] = {v.name: [] for v in variants}
    cpu: dict[str, list[float]] = {v.name: [] for v in variants}
    durable: dict[str, list[float]] = {v.name: [] for v in variants}
    device: dict[str, list[float]] = {v.name: [] for v in variants}

    def on_window(v, before, after, steps, dt):
        cpu[v.name].append((after["cpu_seconds"] - before["cpu_seconds"]) / steps)
        if "critical_seconds" not in before:
            return
        crit[v.name].append((after["critical_seconds"] - before["critical_seconds"]) / steps)
        wait[v.name].append((after.get("commit_wait_seconds", 0) - before.get("commit_wait_seconds", 0)
                             + after["log_wait_seconds"] - before["log_wait_seconds"]) / steps)
        d = sum(after[k] - before[k] for k in ("log_bytes", "table_bytes_persisted", "dense_bytes"))
        durable[v.name].append(d / steps)
        device[v.name].append((after["io_write_bytes"] - before["io_write_bytes"]) / steps)

    try:
        for v in variants:
            t0 = time.perf_counter()
            v.setup()
            print(f"# set up {v.name} in {time.perf_counter() - t0:.1f} s (untimed): {v.durability}", flush=True)
        res = interleave(variants, warmup=a.warmup, steps=a.steps, rounds=a.rounds,
                         batch_size=cfg.batch_size, on_window=on_window,
                         log=lambda s: print(s, flush=True))
    finally:
        for v in variants:
            v.close()
        if own_workdir:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
            gc_shm_regions(under=workdir)  # shm regions of pools an error left behind

    ref = median(res["torchrec"]) if "torchrec" in res else None
    rows = []
    for v in variants:
        xs = res[v.name]
        m = median(xs)
        paired = paired_ratios(xs, res.get(v.name.split("/")[0] + "/none", [])) \
            if v.name.endswith(("/undo", "/floor")) else []
        rows.append([
            v.name, f"{m:,.0f}", f"{min(xs):,.0f}-{max(xs):,.0f}", f"{1e3 * cfg.batch_size / m:.1f}",
            f"{m / ref:.2f}x" if ref else "-", f"{1e3 * median(cpu[v.name]):.0f}",
            _pct_with_quartiles(paired) if paired else "",
            f"{1e3 * median(crit[v.name]):.1f}" if crit[v.name] else "",
            f"{1e3 * median(wait[v.name]):.1f}" if wait[v.name] else "",
            f"{1e3 * median(v.drain_seconds):.0f}" if v.drain_seconds else "",
            f"{median(durable[v.name]) / 1e6:.2f}" if durable[v.name] and median(durable[v.name]) else "",
            f"{median(device[v.name]) / 1e6:.2f}" if device[v.name] and median(durable[v.name]) else "",
            f"{sum(device[v.name]) / sum(durable[v.name]):.2f}" if durable[v.name] and sum(durable[v.name]) else ""])
    print()
    print(f"# load avg at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(fmt_table(["variant", "samples/s (median)", "min-max", "ms/step", "vs torchrec", "CPU ms/step", "undo vs none",
                     "ckpt critical ms/step", "wait ms/step", "drain ms/window", "durable MB/step",
                     "device MB/step", "WA"], rows))
    print("\nvs torchrec: ratio of medians. CPU ms/step: process user+sys CPU per step, all threads (less "
          "sensitive to other load than wall time). undo vs none: same tier; the median over rounds of the "
          "two windows' "
          "ratio in one round (in brackets its quartiles: they ran side by side, so this machine's slow drifts "
          "cancel). ckpt critical: main-thread time in the "
          "checkpointer (wait is part of it: for the undo log, and for the previous step to be durable). drain: "
          "end-of-window wait for background checkpoint work (counted in the window's time). durable: touched "
          "rows + dense state made durable; device: /proc/self/io write_bytes (page-granular, all threads, "
          "compaction included when it ran); WA = device / durable over all windows.")
    if a.json:
        a.json.write_text(json.dumps({"command": command_line(), "machine": machine_line(), "preset": a.preset,
                                      "batch_size": cfg.batch_size, "samples_per_s": res,
                                      "critical_s_per_step": crit, "cpu_s_per_step": cpu, "log_wait_s_per_step": wait}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
