"""What a training run is asked to do and what it reports: :class:`TrainOptions` (the ``train``
flags), :func:`validate_options`, :class:`TrainSummary`, and the defaults derived from them."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from .data import DataSpec

if TYPE_CHECKING:
    from .model import ModelConfig

__all__ = ["TrainOptions", "validate_options", "TrainSummary", "data_spec", "WRITERS",
           "resolve_writer"]


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
    window: int | None = None          # steps per recovery window; None: from recovery_budget
    recovery_budget: float = 1.0       # seconds a recovery may take (checkpointing.policy)
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
    writer: str = "auto"               # auto | thread | inline: where the journal writer runs (resolve_writer)
    override: tuple = ()               # deliberate changes of an existing pool: lr, dense_lr, data
    verbose: bool = False              # -v: also the details (the replay on demand's lines)
    prefetch_batches: int = 2          # batches planned (and, with a DRAM cache, read) ahead: dlrm_cxl/lookahead.py


def validate_options(o: TrainOptions) -> None:
    if not isinstance(o.steps, int) or o.steps < 0:
        raise ValueError(f"--steps must be a non-negative integer, got {o.steps!r}")
    if o.checkpoint not in ("undo", "none"):
        raise ValueError(f"--checkpoint must be undo or none, got {o.checkpoint!r}")
    if o.window is not None and (not isinstance(o.window, int) or o.window < 1):
        raise ValueError(f"--window must be an integer >= 1, got {o.window!r}")
    if not isinstance(o.recovery_budget, (int, float)) or not o.recovery_budget > 0:
        raise ValueError(f"--recovery-budget must be a number of seconds > 0, got {o.recovery_budget!r}")
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
    bad = [k for k in o.override if k not in ("lr", "dense_lr", "data")]
    if bad:
        raise ValueError(f"--override takes lr, dense_lr and data (comma-separated), got {','.join(bad)}")
    if o.writer not in WRITERS:
        raise ValueError(f"--writer must be one of {', '.join(WRITERS)}, got {o.writer!r}")
    from .lookahead import validate_prefetch_batches

    validate_prefetch_batches(o.prefetch_batches)


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
    replayed_steps: int = 0            # steps re-run from their commit records (recovery windows)
    window: int = 1                    # the recovery window's length at the end of the run
    eval: list = field(default_factory=list)
    pool_stats: dict = field(default_factory=dict)
    distributed: dict | None = None    # world size, seconds in exchanges and in commit agreement

    def as_dict(self) -> dict:
        return asdict(self)


WRITERS = ("auto", "thread", "inline")


def resolve_writer(writer: str, *, journaled: bool, ranks: int = 1, cores: int | None = None,
                   threads: int | None = None) -> str:
    """Where the journal writer runs: ``"thread"`` or ``"inline"`` (``writer`` is ``--writer``).

    On its own thread the writer pipelines: step k+1 computes while step k's bytes are gathered,
    checksummed and made durable, and a crash loses at most the step in flight and the one
    before it. That pays when the writer has a core of its own. When it has not (``cores``, the
    CPUs this process may run on, no more than torch's intra-op ``threads``), each millisecond it
    runs preempts one thread of the step's OpenMP team, and the other one spins at the next
    barrier: on this project's 2-core machine the step lost about twice the writer's CPU
    (``perf``: +2.6 s in libgomp over 300 steps of ``small``). Inline, the same work runs on the
    trainer's thread between the step's ops, with both cores in its copies: 0.87–0.92x of no
    checkpoint against 0.84–0.86x on its own thread (shm, the CLI, README). A crash then loses
    at most the step in flight.

    ``auto`` chooses inline only where the writer never waits for a device: a tier whose copies
    are durable by themselves (shm, dram, real pmem: not ``journaled``), with one rank. On a
    journaled tier (emulated pmem, power-sim) each recovery point ends in an ``fdatasync`` that
    the thread overlaps with the next step's compute."""
    if writer not in WRITERS:
        raise ValueError(f"writer must be one of {', '.join(WRITERS)}, got {writer!r}")
    if writer != "auto":
        return writer
    if journaled or ranks > 1:
        return "thread"
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    threads = torch.get_num_threads() if threads is None else threads
    return "inline" if cores <= threads else "thread"


def data_spec(cfg: ModelConfig) -> DataSpec:
    return DataSpec(num_dense=cfg.num_dense, feature_names=tuple(cfg.feature_names),
                    num_embeddings=tuple(cfg.num_embeddings), batch_size=cfg.batch_size)
