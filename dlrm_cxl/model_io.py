"""The model of a trainer pool from outside the training loop: its stored config, the model at
its committed step (for ``eval`` and ``export``: ``dlrm_cxl/export.py``), and TorchRec state_dicts
checked against a config before ``import`` creates a pool."""

from __future__ import annotations

from pathlib import Path

import torch

from checkpointing import checkpoint_status, committed_state
from checkpointing.job import is_job
from memory_pool import MemoryPool, read_header

from .errors import InvalidConfigError, NeedsRecoveryError, PoolFormatError
from .model import PRESETS, ModelConfig, PoolDLRM, torchrec_table_key
from .pool_status import needs_recovery
from .provisioning import recovery_reason

__all__ = ["NeedsRecoveryError", "stored_config", "open_model", "load_torchrec_state"]


def stored_config(pool_path) -> ModelConfig | None:
    """The ModelConfig an existing pool was created with, or None (no trainer state)."""
    model = read_header(Path(pool_path)).get("meta", {}).get("model")
    return ModelConfig.from_dict(model) if model else None


def open_model(pool_path, read_only: bool = True, replay: str = "eager") -> tuple[MemoryPool, ModelConfig, PoolDLRM]:
    """(pool, cfg, model) of a single-process trainer pool, the model's dense part at the
    committed step. Refuses a job of several ranks and a pool that needs recovery
    (:func:`dlrm_cxl.pool_status.needs_recovery`: the same on every tier). ``replay``: as
    ``MemoryPool.open``'s (``"on-demand"`` for a reader of every row through
    ``Table.snapshot``: export). The caller closes the pool."""
    if is_job(pool_path):
        raise PoolFormatError(f"{pool_path} is a job of several ranks (tables sharded across rank-*/ pools); "
                              f"eval and export read a single-process pool",
                              hint="inspect and recover take the job directory; train a single-process pool to export")
    pool = MemoryPool.open(pool_path, read_only=read_only, consistent=read_only, replay=replay)
    try:
        if "model" not in pool.meta:
            raise PoolFormatError(f"{pool_path} holds no model (no trainer state)")
        status = checkpoint_status(pool)
        if needs_recovery(status):
            # The same rule on every tier (dlrm_cxl.pool_status): on a direct tier its rows may hold
            # steps after the committed one (reading it now mixes two states); on a journaled tier
            # the reader would see the committed step, but the pool is just as unfinished.
            why = "; it was trained with --checkpoint none and interrupted" if status["trained_without_undo"] else ""
            raise NeedsRecoveryError(
                f"{pool_path} needs recovery ({recovery_reason(status, None)}{why}); eval and export read "
                f"a pool only once nothing is left to recover (newest committed step: {status['committed_step']})",
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
    hint = ("pass the file `dlrm-cxl export` wrote, or one written by torch.save(dlrm.state_dict()) of a TorchRec "
            "DLRM (tensors only)")
    path = Path(path)
    if not path.exists():
        raise InvalidConfigError(f"--state {path}: no such file", hint="check the --state path")
    if path.is_dir():
        raise InvalidConfigError(f"--state {path}: is a directory, not a file", hint="check the --state path")
    try:
        # (weights_only: a state_dict is tensors; a file that needs more is not one, and is
        # never unpickled in full: its torch.load text, which suggests weights_only=False, is
        # not repeated to the user)
        state = torch.load(path, weights_only=True, map_location="cpu")
    except OSError:
        raise  # (unreadable: main reports the path)
    except Exception:  # torch.load's unpickler raises almost anything on a file that is not its own
        raise InvalidConfigError(f"--state {path}: not a state_dict this tool can read (not a torch.save file "
                                 f"of tensors)", hint=hint) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        held = "a dict that holds more than tensors" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise InvalidConfigError(f"--state {path}: not a state_dict this tool can read (it holds {held}, not a "
                                 f"dict of tensors)", hint=hint)

    def shapes(c):
        return {torchrec_table_key(f): (n, c.embedding_dim)
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
