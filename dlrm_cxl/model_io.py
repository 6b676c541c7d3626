"""The model of a trainer pool from outside the training loop: its stored config, the model at
its committed step (for ``eval`` and ``export``), and TorchRec state_dicts checked against a
config before ``import`` creates a pool."""

from __future__ import annotations

from pathlib import Path

import torch

from checkpointing import checkpoint_status, committed_state
from checkpointing.job import is_job
from memory_pool import MemoryPool, read_header

from .errors import NeedsRecoveryError, PoolFormatError
from .model import PRESETS, ModelConfig, PoolDLRM

__all__ = ["NeedsRecoveryError", "stored_config", "open_model", "load_torchrec_state"]


def stored_config(pool_path) -> ModelConfig | None:
    """The ModelConfig an existing pool was created with, or None (no trainer state)."""
    model = read_header(Path(pool_path)).get("meta", {}).get("model")
    return ModelConfig.from_dict(model) if model else None


def open_model(pool_path, read_only: bool = True) -> tuple[MemoryPool, ModelConfig, PoolDLRM]:
    """(pool, cfg, model) of a single-process trainer pool, the model's dense part at the
    committed step. Refuses a job of several ranks and a pool that needs recovery. The caller
    closes the pool."""
    if is_job(pool_path):
        raise PoolFormatError(f"{pool_path} is a job of several ranks (tables sharded across rank-*/ pools); "
                              f"eval and export read a single-process pool",
                              hint="inspect and recover take the job directory; train a single-process pool to export")
    pool = MemoryPool.open(pool_path, read_only=read_only, consistent=read_only)
    try:
        if "model" not in pool.meta:
            raise PoolFormatError(f"{pool_path} holds no model (no trainer state)")
        status = checkpoint_status(pool)
        if status["needs_recovery"]:
            # Its rows may hold steps after the committed one: reading it now mixes two states.
            raise NeedsRecoveryError(
                f"{pool_path} needs recovery (uncommitted steps {status['steps_to_roll_back']}"
                + ("; it was trained with --checkpoint none and interrupted" if status["trained_without_undo"]
                   else "") + ")",
                hint=("start over with `dlrm-cxl train --fresh`" if status["trained_without_undo"] else
                      f"run `dlrm-cxl recover --pool {pool_path}` first (or `dlrm-cxl train`, which recovers)"))
        cfg = ModelConfig.from_dict(pool.meta["model"])
        model = PoolDLRM(cfg, pool)
        step, state = committed_state(pool)
        if state is not None:
            model.load_state_dict(state["model"])
    except BaseException:
        pool.close()
        raise
    return pool, cfg, model


def load_torchrec_state(path: Path, cfg: ModelConfig) -> dict:
    """torch.load a TorchRec DLRM state_dict and check its tables against ``cfg`` before any
    pool is created (ValueError naming the problem and, if one fits, the preset to pass)."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise ValueError(f"--state {path}: no such file") from None
    except Exception as exc:  # torch.load's unpickler raises almost anything on a file that is not its own
        raise ValueError(f"--state {path}: not a state_dict written by torch.save "
                         f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"--state {path}: not a state_dict (a dict of tensors)")

    def shapes(c):
        return {f"sparse_arch.embedding_bag_collection.embedding_bags.{f}.weight": (n, c.embedding_dim)
                for f, n in zip(c.feature_names, c.num_embeddings)}

    have = {k: tuple(v.shape) for k, v in state.items() if k.startswith("sparse_arch.")}
    if have != shapes(cfg):
        fits = [name for name, c in sorted(PRESETS.items()) if have == shapes(c)]
        bad = next((k for k in sorted(set(have) | set(shapes(cfg))) if have.get(k) != shapes(cfg).get(k)), None)
        raise ValueError(
            f"--state {path}: its embedding tables do not match the model config "
            f"({bad}: {have.get(bad)} in the file, {shapes(cfg).get(bad)} expected)"
            + (f"; pass --preset {fits[0]}" if fits else "; pass the --preset/--config it was exported with"))
    return state
