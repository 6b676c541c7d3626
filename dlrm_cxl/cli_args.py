"""The arguments of the ``dlrm-cxl`` command line (:mod:`dlrm_cxl.cli`): the parser, the flags
that make a ModelConfig, and what ``--json`` prints.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from dataclasses import replace
from pathlib import Path

__all__ = ["build_parser", "model_config_from_args", "PRESET_NAMES", "DEFAULT_POOL", "EXIT_CODES",
           "data_convert_hint"]

DEFAULT_POOL = "runs/pool"

# What `dlrm-cxl` exits with (README "Exit codes"; a test keeps the three lists equal). Each error
# class and its code: dlrm_cxl.errors.
EXIT_CODES = {
    0: "ok (also: `train` with nothing to do; output cut short by a closed pipe, e.g. `| head`)",
    1: "unexpected error (a bug: please report it)",
    2: "bad arguments or input: a flag, a --config, a --data/--state/INPUT path that does not exist, a flag "
       "that would change an existing pool; `eval`/`export` of a pool that needs `recover` first (every tier "
       "alike); a pool directory that train/recover/destroy/import cannot write (read-only file system, chattr +i, "
       "permissions); `plot` of a pool that holds no metrics",
    3: "not a pool (also: a file given as --pool) / other format version / volatile pool gone",
    4: "damage that recovery cannot repair (nothing was changed)",
    5: "locked by another writer, or a reader (inspect, eval, export) while a trainer changes the pool",
    6: "pool or disk full",
    7: "malformed data (the message names file:line)",
    8: "training diverged (NaN/inf loss or gradient; the step was not applied)",
    9: "the device reported an I/O error (nothing committed is lost)",
    10: "the pool's background compaction failed (nothing committed is lost: fix the cause, then `recover`)",
    11: "a replayed step did not reproduce its record (not deterministic here: other --threads, kernel, device "
        "or library versions); the pool stays at the last step that agreed",
    12: "the data a replay needs is gone or changed: recovery stopped at the recovery window's start",
    130: "interrupted (Ctrl-C)",
}
EXIT_CODES_EPILOG = "exit codes:\n" + "\n".join(
    textwrap.fill(v, 100, initial_indent=f"  {k:>3}  ", subsequent_indent=" " * 7) for k, v in EXIT_CODES.items())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dlrm-cxl")
    except PackageNotFoundError:  # (run from a source tree that was never installed)
        return "unknown (not installed)"


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
        "Fault-tolerant DLRM training with embedding tables in a tiered, persistent memory pool."),
        epilog=EXIT_CODES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train (or continue training) a model in a pool")
    t.add_argument("--pool", default=DEFAULT_POOL,
                   help=f"pool directory: made if missing, continued if it holds a pool (default {DEFAULT_POOL})")
    t.add_argument("--preset", choices=sorted(PRESET_NAMES), help="model size for a new pool (default small)")
    t.add_argument("--config", type=Path, metavar="FILE.json",
                   help="JSON object of ModelConfig fields overriding the preset, e.g. {\"embedding_dim\": 16, "
                        "\"bottom_mlp\": [32, 16]}")
    t.add_argument("--data", default=None,
                   help="synthetic | FILE.tsv (Criteo) | DIR.zarr (default: synthetic for a new pool; an existing "
                        "pool continues on the data it was trained on)")
    t.add_argument("--eval-data", help="data for --eval-every (default: held-out synthetic, or --data)")
    t.add_argument("--steps", type=int, default=100, help="step to reach in total (default 100)")
    t.add_argument("--batch-size", type=int, help="samples per step (default: the preset's; tiny 64, small and "
                                                   "kaggle 2048)")
    t.add_argument("--embedding-dim", type=int, help="embedding dim (also the bottom MLP's last layer)")
    t.add_argument("--max-rows", type=int, help="cap every table at this many rows")
    t.add_argument("--lr", type=float, help="embedding learning rate")
    t.add_argument("--dense-lr", type=float, help="dense (MLP) learning rate")
    t.add_argument("--dense-optimizer", choices=["sgd", "adagrad", "adam"],
                   help="optimizer of the dense (MLP) part (default adagrad)")
    t.add_argument("--embedding-optimizer", choices=["sgd", "rowwise_adagrad"],
                   help="optimizer of the embedding rows (default rowwise_adagrad, fbgemm's)")
    t.add_argument("--tier", default=None, choices=list(TIERS) + ["auto"],
                   help="tier of a new pool (default auto: pmem, real on a DAX mount, else emulated by a journal on "
                        "the disk). An existing pool keeps its tier: a different --tier is refused")
    t.add_argument("--capacity", type=_size, metavar="SIZE",
                   help="most bytes of tables (and optimizer state) the new pool may hold: bytes, or with a suffix "
                        "K, M, G, T (powers of 1024), e.g. 512M, 8G (default: no limit but the disk's). An existing "
                        "pool keeps its capacity: a different --capacity is refused")
    t.add_argument("--dram-cache", type=_size, metavar="SIZE",
                   help="DRAM budget (bytes, or 512M, 8G: powers of 1024); larger tables get a row cache")
    t.add_argument("--seed", type=int, default=0,
                   help="seed of the initial tables, the synthetic data and every RNG (default 0; a pool keeps its "
                        "own)")
    t.add_argument("--threads", type=int, help="torch intra-op threads (fix it for bit-exact runs)")
    t.add_argument("--device", default="cpu", help="cpu | cuda (dense part on the GPU)")
    t.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="evaluate AUC and log loss every N steps on --eval-data (default 0: never)")
    t.add_argument("--eval-batches", type=int, default=4, metavar="N",
                   help="batches each --eval-every evaluation reads (default 4)")
    t.add_argument("--checkpoint", choices=["undo", "none"], default="undo",
                   help="undo: every step recoverable, a crash resumes bit-exact (default); none: no recovery "
                        "points (a crashed pool must start over with --fresh)")
    t.add_argument("--recovery-budget", type=float, default=1.0, metavar="SECONDS",
                   help="most seconds a recovery after a crash may take (default 1.0): the recovery window is the "
                        "steps a replay re-runs in it, chosen from the measured step time. A longer window makes "
                        "fewer bytes durable per step")
    t.add_argument("--window", type=int, default=None, metavar="W",
                   help="a fixed recovery window of W steps instead of --recovery-budget: the full state is made "
                        "durable once per window, each step in between only a commit record, and a crash replays "
                        "at most W-1 committed steps. 1: a full recovery point every step")
    t.add_argument("--prefetch-batches", type=int, default=2, metavar="K",
                   help="batches planned ahead on the prefetch thread; with --dram-cache their rows are read into "
                        "the cache before their step (default 2)")
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
    t.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed data lines and count them (a bad line once, however many passes read it)")
    t.add_argument("--fresh", action="store_true", help="delete the pool first and start over")
    t.add_argument("--override", default="", metavar="KEYS",
                   help="change these on an existing pool on purpose, from its current step on (comma-separated: "
                        "lr, dense_lr, data; e.g. --override lr --lr 0.01 after a diverged run). Recorded in the "
                        "pool's history (inspect --json: meta.history)")
    t.add_argument("--no-digest", action="store_true",
                   help="skip the state and model digests at the end (they read every row once: "
                        "`kaggle`'s 8.8 GB, from the device where the tables live beyond DRAM)")
    t.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (by default a bar on a terminal; elsewhere, e.g. a log file, a "
                        "line every 10 s)")
    t.add_argument("-v", "--verbose", action="store_true",
                   help="also print the details: how the pool's journal is replayed on demand")
    t.add_argument("--json", action="store_true",
                   help="print the summary as JSON on stdout (the banner and log lines go to stderr)")

    r = sub.add_parser("recover", help="bring a crashed pool back to its newest committed step: restore the "
                                       "recovery window's start, then replay the committed steps after it")
    r.add_argument("--pool", default=DEFAULT_POOL,
                   help=f"pool directory, or a torchrun job directory (default {DEFAULT_POOL})")
    r.add_argument("--dry-run", action="store_true", help="verify and report; change nothing")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.add_argument("--no-digest", action="store_true",
                   help="skip the state digest afterwards (it reads every row: 16 s for `kaggle`'s 8.8 GB)")
    r.add_argument("--no-replay", action="store_true",
                   help="stop at the recovery window's start and drop the records of the committed steps after it "
                        "(they are not replayed; the pool continues from its window's start)")
    r.add_argument("--crash-at", choices=RECOVERY_PHASES + ("mid-replay",), help=argparse.SUPPRESS)

    i = sub.add_parser("inspect", help="describe a pool: tables, tier, step, state digest")
    i.add_argument("--pool", default=DEFAULT_POOL,
                   help=f"pool directory, or a torchrun job directory (default {DEFAULT_POOL})")
    i.add_argument("--json", action="store_true", help="print the description as JSON")
    i.add_argument("--no-digest", action="store_true", help="skip the state digest (reads every row)")

    e = sub.add_parser("eval", help="AUC and log loss of the pool's model on data")
    e.add_argument("--pool", default=DEFAULT_POOL, help=f"pool directory (default {DEFAULT_POOL})")
    e.add_argument("--data", default=None, help="synthetic | FILE.tsv | DIR.zarr (default: held-out synthetic "
                                                "data, or the file the pool was trained on)")
    e.add_argument("--batches", type=int, default=8, metavar="N",
                   help="batches to evaluate at most (default 8); a file or zarr dataset is read once from its "
                        "start, never cycled: a smaller one is evaluated whole, each sample once")
    e.add_argument("--skip-bad-lines", action="store_true", help="skip malformed data lines")
    e.add_argument("--json", action="store_true", help="print the result as JSON")

    x = sub.add_parser("export", help="write a TorchRec DLRM state_dict (torch.save)")
    x.add_argument("--pool", default=DEFAULT_POOL, help=f"pool directory (default {DEFAULT_POOL})")
    x.add_argument("--out", required=True, type=Path, metavar="FILE.pt",
                   help="file to write the state_dict to (replaced atomically)")

    m = sub.add_parser("import", help="create a pool from a TorchRec DLRM state_dict")
    m.add_argument("--pool", required=True, help="the new pool's directory (missing or empty)")
    m.add_argument("--state", required=True, type=Path, metavar="FILE.pt",
                   help="file written by `dlrm-cxl export` or torch.save(dlrm.state_dict()) of a TorchRec DLRM")
    m.add_argument("--preset", choices=sorted(PRESET_NAMES), default="small",
                   help="model the state_dict was exported from (default small)")
    m.add_argument("--config", type=Path, metavar="FILE.json", help="JSON object of ModelConfig fields "
                                                                    "overriding the preset")
    m.add_argument("--tier", default="auto", choices=list(TIERS) + ["auto"],
                   help="tier of the new pool (default auto: pmem, real on a DAX mount, else emulated)")

    k = sub.add_parser("destroy", help="delete a pool (or a torchrun job directory) and its shm region")
    k.add_argument("--pool", required=True, help="the pool directory, or a job directory (DIR/job.json, DIR/rank-R)")
    k.add_argument("--json", action="store_true", help="print what was deleted as JSON")

    g = sub.add_parser("gc", help="list shm regions; remove those whose pool directory is gone (rm -rf)")
    g.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    g.add_argument("--json", action="store_true", help="print the regions as JSON")

    pl = sub.add_parser("plot", help="draw a pool's training metrics (loss, samples/s, eval AUC over the steps) "
                                     "into a PNG")
    pl.add_argument("--pool", default=DEFAULT_POOL,
                    help=f"pool (or torchrun job) directory whose metrics.jsonl `train` wrote (default {DEFAULT_POOL})")
    pl.add_argument("--out", type=Path, default=Path("loss.png"), metavar="FILE.png",
                    help="the PNG file to write (replaced; default loss.png)")
    pl.add_argument("--json", action="store_true", help="print what was drawn as JSON")

    d = sub.add_parser("data", help="data tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    c = dsub.add_parser("convert", help="Criteo TSV -> preprocessed, chunked, compressed zarr")
    c.add_argument("input", type=Path, metavar="INPUT.tsv", help="the Criteo TSV file to convert")
    c.add_argument("output", type=Path, metavar="OUTPUT.zarr",
                   help="the zarr directory to write (must not exist, or hold an earlier conversion: --overwrite)")
    c.add_argument("--preset", choices=sorted(PRESET_NAMES), default="small",
                   help="table sizes to hash into: the preset of the pools that will train on it (default small)")
    c.add_argument("--config", type=Path, metavar="FILE.json",
                   help="JSON object of ModelConfig fields overriding the preset")
    c.add_argument("--max-rows", type=int, help="cap every table at this many rows (as `train --max-rows`)")
    c.add_argument("--chunk-rows", type=int, default=65536, metavar="N", help="rows per zarr chunk (default 65536)")
    c.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed lines")
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
    from .model import PRESETS, validate_model_config

    given = [f for f in _MODEL_FLAGS if getattr(args, f, None) is not None]
    if getattr(args, "preset", None) is None and not given:
        if default_preset is None:
            return None
        preset = default_preset
    else:
        preset = getattr(args, "preset", None) or "small"
    cfg = base if base is not None and getattr(args, "preset", None) is None else PRESETS[preset]
    if getattr(args, "config", None) is not None:
        cfg = _config_file(Path(args.config), cfg)
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


def _config_file(path: Path, cfg):
    """``cfg`` with the fields of the JSON object in ``path`` (``--config``), each checked for its
    name and type first: a typed error naming the key, never a TypeError from the dataclass."""
    from dataclasses import fields

    from .errors import InvalidConfigError
    from .model import EmbeddingOptimizerConfig, ModelConfig, validate_model_config

    keys = [f.name for f in fields(ModelConfig)]
    example = 'e.g. {"embedding_dim": 16, "bottom_mlp": [32, 16], "embedding_optimizer": {"lr": 0.1}}'
    hint = f"--config takes a JSON object of ModelConfig fields, {example}; its keys: {', '.join(keys)}"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InvalidConfigError(f"--config {path}: no such file", hint="check the --config path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfigError(f"--config {path}: cannot be read ({exc})", hint="check the --config path") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise InvalidConfigError(f"--config {path}: not valid JSON ({exc})", hint=hint) from None
    if not isinstance(doc, dict):
        raise InvalidConfigError(f"--config {path}: a JSON object of ModelConfig fields is expected, "
                                 f"not a {_json_type(doc)}", hint=hint)
    current = cfg.to_dict()
    for key, value in doc.items():
        if key not in current:
            raise InvalidConfigError(f"--config {path}: unknown key {key!r}", hint=hint)
        if key == "embedding_optimizer":
            if not isinstance(value, dict):
                raise InvalidConfigError(f"--config {path}: key 'embedding_optimizer' must be a JSON object, "
                                         f"not a {_json_type(value)}",
                                         hint='e.g. "embedding_optimizer": {"kind": "sgd", "lr": 0.1}; its keys: '
                                              + ", ".join(f.name for f in fields(EmbeddingOptimizerConfig)))
            for k, v in value.items():
                if k not in current[key]:
                    raise InvalidConfigError(
                        f"--config {path}: unknown key 'embedding_optimizer.{k}'",
                        hint="the keys of embedding_optimizer: " + ", ".join(current[key]))
                _check_config_value(path, f"embedding_optimizer.{k}", v, current[key][k])
        else:
            _check_config_value(path, key, value, current[key])
    merged = {**current, **doc}
    if "embedding_optimizer" in doc:
        merged["embedding_optimizer"] = {**current["embedding_optimizer"], **doc["embedding_optimizer"]}
    try:
        new = ModelConfig.from_dict(merged)
        validate_model_config(new)
    except (TypeError, ValueError) as exc:
        raise InvalidConfigError(f"--config {path}: {exc}", hint=hint) from None
    return new


def _json_type(v) -> str:
    return {dict: "JSON object", list: "JSON list", str: "string", bool: "boolean", type(None): "null",
            int: "number", float: "number"}.get(type(v), type(v).__name__)


def _check_config_value(path: Path, key: str, value, like) -> None:
    """``value`` (from the JSON) has the type of ``like`` (the field's current value)."""
    from .errors import InvalidConfigError

    def bad(want: str):
        example = json.dumps(like) if not isinstance(like, (list, tuple)) or len(like) <= 4 else \
            json.dumps(list(like[:3]))[:-1] + ", ...]"
        raise InvalidConfigError(f"--config {path}: key {key!r} must be {want}, not {_json_type(value)} {value!r}",
                                 hint=f"e.g. \"{key.split('.')[-1]}\": {example} (this model's value)")

    if isinstance(like, bool):
        if not isinstance(value, bool):
            bad("true or false")
    elif isinstance(like, int):
        if isinstance(value, bool) or not isinstance(value, int):
            bad("an integer")
    elif isinstance(like, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad("a number")
    elif isinstance(like, str):
        if not isinstance(value, str):
            bad("a string")
    elif isinstance(like, (list, tuple)):
        item = str if like and isinstance(like[0], str) else int
        ok = isinstance(value, list) and all(isinstance(v, item) and not isinstance(v, bool) for v in value)
        if not ok:
            bad("a list of " + ("strings" if item is str else "integers"))


def data_convert_hint(cfg, what: str = "convert the TSV again for this model") -> str:
    """A hint naming the `dlrm-cxl data convert` command that makes a zarr for ``cfg``'s tables."""
    from .model import PRESETS

    same = [(name, p) for name, p in sorted(PRESETS.items())
            if (tuple(p.feature_names), p.num_dense) == (tuple(cfg.feature_names), cfg.num_dense)]
    cap = max(cfg.num_embeddings)
    flags = next((f"--preset {name}" for name, p in same if tuple(p.num_embeddings) == tuple(cfg.num_embeddings)),
                 None) or next((f"--preset {name} --max-rows {cap}" for name, p in same
                                if tuple(min(n, cap) for n in p.num_embeddings) == tuple(cfg.num_embeddings)), None)
    if flags is None:
        flags = "--config MODEL.json  (the pool's model: `dlrm-cxl inspect --json`)"
    return f"{what}: `dlrm-cxl data convert FILE.tsv DIR.zarr {flags}`"

