"""The arguments of the ``dlrm-cxl`` command line (:mod:`dlrm_cxl.cli`): the parser, the flags
that make a ModelConfig, and what ``--json`` prints.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

__all__ = ["build_parser", "model_config_from_args", "PRESET_NAMES", "DEFAULT_POOL"]

DEFAULT_POOL = "runs/pool"


def _size(text: str) -> int:
    """'512M', '8G', '1000' -> bytes."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        if t.endswith("B"):
            return _size(t[:-1])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 512M, 8G)") from None


# The names of dlrm_cxl.model.PRESETS, here so that building the parser does not import TorchRec
# (2 s of every command's start; `recover`, `inspect` and `gc` never need it). A test keeps the two
# equal.
PRESET_NAMES = ("kaggle", "small", "tiny")


def build_parser() -> argparse.ArgumentParser:
    from checkpointing.crash import PHASES, RECOVERY_PHASES
    from memory_pool.tiers import TIERS

    from .options import WRITERS

    p = argparse.ArgumentParser(prog="dlrm-cxl", description=(
        "Fault-tolerant DLRM training with embedding tables in a tiered, persistent memory pool."))
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train (or continue training) a model in a pool")
    t.add_argument("--pool", default=DEFAULT_POOL, help=f"pool directory (default {DEFAULT_POOL})")
    t.add_argument("--preset", choices=sorted(PRESET_NAMES), help="model size for a new pool (default small)")
    t.add_argument("--config", type=Path, help="JSON file of ModelConfig fields overriding the preset")
    t.add_argument("--data", default="synthetic", help="synthetic | FILE.tsv (Criteo) | DIR.zarr")
    t.add_argument("--eval-data", help="data for --eval-every (default: held-out synthetic, or --data)")
    t.add_argument("--steps", type=int, default=100, help="step to reach in total (default 100)")
    t.add_argument("--batch-size", type=int)
    t.add_argument("--embedding-dim", type=int, help="embedding dim (also the bottom MLP's last layer)")
    t.add_argument("--max-rows", type=int, help="cap every table at this many rows")
    t.add_argument("--lr", type=float, help="embedding learning rate")
    t.add_argument("--dense-lr", type=float, help="dense (MLP) learning rate")
    t.add_argument("--dense-optimizer", choices=["sgd", "adagrad", "adam"])
    t.add_argument("--embedding-optimizer", choices=["sgd", "rowwise_adagrad"])
    t.add_argument("--tier", default="auto", choices=list(TIERS) + ["auto"], help="tier of a new pool")
    t.add_argument("--capacity", type=_size, help="most bytes of tables the new pool may hold")
    t.add_argument("--dram-cache", type=_size, help="DRAM budget; larger tables get a row cache")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, help="torch intra-op threads (fix it for bit-exact runs)")
    t.add_argument("--device", default="cpu", help="cpu | cuda (dense part on the GPU)")
    t.add_argument("--eval-every", type=int, default=0)
    t.add_argument("--eval-batches", type=int, default=4)
    t.add_argument("--checkpoint", choices=["undo", "none"], default="undo")
    t.add_argument("--dense-every", type=int, default=None,
                   help="recovery point (dense snapshot + persisted rows) every N steps; default 1 (every "
                        "step, on every tier: a crash loses at most the step in flight and the one before it)")
    t.add_argument("--writer", choices=list(WRITERS), default="auto",
                   help="where the journal writer runs: its own thread (step k+1 computes while step k becomes "
                        "durable; a crash loses at most 2 steps) or inline on the trainer's thread (a crash loses "
                        "at most the step in flight). auto: inline on shm/dram/real pmem when the machine has no "
                        "core to spare beside torch's threads, else its own thread")
    t.add_argument("--crash-at", metavar="STEP:PHASE",
                   help=f"SIGKILL this process at STEP in PHASE ({', '.join(PHASES)})")
    t.add_argument("--crash-rank", type=int, default=0, help="with torchrun: the rank --crash-at kills")
    t.add_argument("--zipf-alpha", type=float, default=1.05, help="skew of synthetic ids (0: uniform)")
    t.add_argument("--kernel", choices=["fused", "reference"], default="fused",
                   help="embedding kernels: fbgemm's fused TBE in place on the pool (default), or the "
                        "reference path (gather, scatter of gradients, batched optimizer)")
    t.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed data lines")
    t.add_argument("--fresh", action="store_true", help="delete the pool first and start over")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--json", action="store_true", help="print the summary as JSON")

    r = sub.add_parser("recover", help="roll a crashed pool back to its newest recovery point")
    r.add_argument("--pool", default=DEFAULT_POOL)
    r.add_argument("--dry-run", action="store_true", help="verify and report; change nothing")
    r.add_argument("--json", action="store_true")
    r.add_argument("--no-digest", action="store_true",
                   help="skip the state digest afterwards (it reads every row: 16 s for `kaggle`'s 8.8 GB)")
    r.add_argument("--crash-at", choices=RECOVERY_PHASES, help=argparse.SUPPRESS)

    i = sub.add_parser("inspect", help="describe a pool: tables, tier, step, state digest")
    i.add_argument("--pool", default=DEFAULT_POOL)
    i.add_argument("--json", action="store_true")
    i.add_argument("--no-digest", action="store_true", help="skip the state digest (reads every row)")

    e = sub.add_parser("eval", help="AUC and log loss of the pool's model on data")
    e.add_argument("--pool", default=DEFAULT_POOL)
    e.add_argument("--data", default=None, help="default: held-out synthetic data, or the training file")
    e.add_argument("--batches", type=int, default=8)
    e.add_argument("--skip-bad-lines", action="store_true", help="skip malformed data lines")
    e.add_argument("--json", action="store_true")

    x = sub.add_parser("export", help="write a TorchRec DLRM state_dict (torch.save)")
    x.add_argument("--pool", default=DEFAULT_POOL)
    x.add_argument("--out", required=True, type=Path)

    m = sub.add_parser("import", help="create a pool from a TorchRec DLRM state_dict")
    m.add_argument("--pool", required=True)
    m.add_argument("--state", required=True, type=Path, help="file written by torch.save(dlrm.state_dict())")
    m.add_argument("--preset", choices=sorted(PRESET_NAMES), default="small")
    m.add_argument("--config", type=Path)
    m.add_argument("--tier", default="auto", choices=list(TIERS) + ["auto"])

    k = sub.add_parser("destroy", help="delete a pool (or a torchrun job directory) and its shm region")
    k.add_argument("--pool", required=True, help="the pool directory, or a job directory (DIR/job.json, DIR/rank-R)")
    k.add_argument("--json", action="store_true")

    g = sub.add_parser("gc", help="list shm regions; remove those whose pool directory is gone (rm -rf)")
    g.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    g.add_argument("--json", action="store_true")

    d = sub.add_parser("data", help="data tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    c = dsub.add_parser("convert", help="Criteo TSV -> preprocessed, chunked, compressed zarr")
    c.add_argument("input", type=Path)
    c.add_argument("output", type=Path)
    c.add_argument("--preset", choices=sorted(PRESET_NAMES), default="small", help="table sizes to hash into")
    c.add_argument("--config", type=Path)
    c.add_argument("--max-rows", type=int)
    c.add_argument("--chunk-rows", type=int, default=65536)
    c.add_argument("--skip-bad-lines", action="store_true")
    c.add_argument("--overwrite", action="store_true",
                   help="replace OUTPUT if it holds a dataset an earlier `data convert` wrote (anything "
                        "else at OUTPUT is never touched)")
    return p


_MODEL_FLAGS = ("config", "batch_size", "embedding_dim", "max_rows", "lr", "dense_lr", "dense_optimizer",
                "embedding_optimizer")


def model_config_from_args(args, *, default_preset: str | None = "small", base=None):
    """The ModelConfig the flags ask for, or None when they ask for nothing (use the pool's).

    ``base``: the config of the existing pool; flags without --preset override it (not the
    default preset), so that e.g. ``--lr`` on a tiny pool is reported as an lr change."""
    from .model import PRESETS, ModelConfig, validate_model_config

    given = [f for f in _MODEL_FLAGS if getattr(args, f, None) is not None]
    if getattr(args, "preset", None) is None and not given:
        if default_preset is None:
            return None
        preset = default_preset
    else:
        preset = getattr(args, "preset", None) or "small"
    cfg = base if base is not None and getattr(args, "preset", None) is None else PRESETS[preset]
    if getattr(args, "config", None) is not None:
        try:
            doc = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--config {args.config}: {exc}") from None
        base = cfg.to_dict()
        base.update(doc)
        cfg = ModelConfig.from_dict(base)
    if getattr(args, "max_rows", None) is not None:
        cfg = replace(cfg, num_embeddings=tuple(min(n, args.max_rows) for n in cfg.num_embeddings))
    if getattr(args, "batch_size", None) is not None:
        cfg = replace(cfg, batch_size=args.batch_size)
    if getattr(args, "embedding_dim", None) is not None:
        cfg = replace(cfg, embedding_dim=args.embedding_dim, bottom_mlp=cfg.bottom_mlp[:-1] + (args.embedding_dim,))
    if getattr(args, "dense_lr", None) is not None:
        cfg = replace(cfg, dense_lr=args.dense_lr)
    if getattr(args, "dense_optimizer", None) is not None:
        cfg = replace(cfg, dense_optimizer=args.dense_optimizer)
    eo = cfg.embedding_optimizer
    if getattr(args, "lr", None) is not None:
        eo = replace(eo, lr=args.lr)
    if getattr(args, "embedding_optimizer", None) is not None:
        eo = replace(eo, kind=args.embedding_optimizer)
    cfg = replace(cfg, embedding_optimizer=eo)
    validate_model_config(cfg)
    return cfg


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=1, sort_keys=True, default=str))
