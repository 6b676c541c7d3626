"""The ``dlrm-cxl`` command line. ``main(argv) -> int``; never calls sys.exit itself.

Exit codes: 0 ok; 1 unexpected error; 2 bad arguments or input (also: eval/export of a pool
that needs `recover` first); 3 not a pool / wrong version / volatile pool gone; 4 damage that
recovery cannot repair (nothing was changed); 5 pool locked by another writer; 6 pool or disk
full; 7 malformed data; 8 training diverged (NaN/inf loss); 9 the device failed a write (EIO).
Every error class and its exit code: :mod:`dlrm_cxl.errors`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from .errors import DlrmCxlError

__all__ = ["main", "build_parser", "model_config_from_args"]

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


def _cmd_train(args) -> int:
    from checkpointing import parse_crash_at
    from checkpointing.jobdir import rank_dir
    from memory_pool.validation import validate_journal_env

    from .distributed import init_distributed, is_distributed_env, job_file
    from .model_io import stored_config
    from .options import TrainOptions
    from .trainer import Trainer

    validate_journal_env()  # before a pool (and its tables) is made for nothing
    distributed = is_distributed_env()
    marker = job_file(args.pool) if distributed else Path(args.pool) / "pool.json"
    pool_exists = marker.exists() and not args.fresh
    stored_at = rank_dir(args.pool, 0) if distributed else args.pool
    cfg = model_config_from_args(args, default_preset=None if pool_exists else "small",
                                 base=stored_config(stored_at) if pool_exists else None)
    opts = TrainOptions(
        pool=args.pool, steps=args.steps, data=args.data, seed=args.seed, tier=args.tier, device=args.device,
        eval_every=args.eval_every, eval_batches=args.eval_batches, eval_data=args.eval_data,
        checkpoint=args.checkpoint, dense_every=args.dense_every,
        crash_at=parse_crash_at(args.crash_at) if args.crash_at else None, crash_rank=args.crash_rank,
        threads=args.threads,
        skip_bad_lines=args.skip_bad_lines, capacity_bytes=args.capacity, dram_cache_bytes=args.dram_cache,
        fresh=args.fresh, progress=not args.no_progress and not args.json, zipf_alpha=args.zipf_alpha, kernel=args.kernel,
        writer=args.writer)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else None
    ctx = None
    if distributed:
        if cfg is not None:
            n_features = len(cfg.feature_names)
        else:
            try:
                n_features = len(json.loads(marker.read_text())["model"]["feature_names"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{marker}: cannot read the job's model ({exc}); pass --preset") from None
        ctx = init_distributed(args.device, n_features)
    try:
        trainer = Trainer(opts, cfg, log=log, dist=ctx)
        try:
            summary = trainer.run()
            digest = trainer.digest()
            model_digest = trainer.digest(resume=False)
            # lines --skip-bad-lines skipped while reading (read-ahead included; a line is counted
            # each epoch it is read)
            skipped = int(getattr(trainer.source, "skipped", 0) or 0)
        finally:
            trainer.close()
    finally:
        if ctx is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
    if ctx is not None and ctx.rank != 0:
        return 0
    d = summary.as_dict()
    d["state_digest"] = digest
    d["model_digest"] = model_digest
    d.setdefault("skipped_lines", skipped)
    if args.json:
        _print_json(d)
        return 0
    ck = summary.checkpoint
    print(f"done: step {summary.end_step} ({summary.steps_run} steps this run, {summary.samples} samples "
          f"in {summary.seconds:.1f} s, {summary.samples_per_s:,.0f} samples/s)")
    if summary.final_loss is not None:
        print(f"loss (mean of last 10 steps): {summary.final_loss:.4f}")
    if summary.epochs:
        print(f"data: the file was read {summary.epochs} time(s) from the start (epochs wrapped)")
    if d["skipped_lines"]:
        print(f"data: {d['skipped_lines']} malformed line(s) skipped (--skip-bad-lines)")
    # The writer's CPU too: on its own thread, but on a machine with no core to spare it is taken
    # from the step about one for one (measured on 2 cores), which the critical path does not show.
    where = "inline on the trainer's thread (in the critical path)" if ck.get("writer") == "inline" else \
        "on the journal writer's thread"
    writer = (f"{ck['writer_cpu_ms_per_step']:.2f} ms/step of CPU {where}, "
              if ck.get("writer_cpu_ms_per_step") else "")
    print(f"checkpoint {args.checkpoint}: {ck['critical_ms_per_step']:.2f} ms/step on the critical path "
          f"({1e3 * ck['commit_wait_seconds'] / max(ck['steps'], 1):.2f} waiting for the previous step to be durable), "
          f"{writer}{ck['checkpoints']} recovery points, newest at step {ck['last_commit_step']}")
    if ck.get("device_write_bytes_per_step") is not None and summary.steps_run:
        wa = ck["write_amplification"]
        print(f"per step: {ck['touched_row_bytes_per_step'] / 1e6:.2f} MB of touched rows + "
              f"{ck['dense_bytes_per_step'] / 1e6:.2f} MB of dense state made durable; "
              f"{ck['device_write_bytes_per_step'] / 1e6:.2f} MB written to the device"
              + (f" (write amplification {wa:.2f}x)" if wa else ""))
    ps = d.get("pool_stats") or {}
    if (ps.get("compactions") or ps.get("applies")) and ps.get("bytes_written_back") and summary.steps_run:
        # On a journaled tier, the write-back is the checkpointer's largest cost after the journal
        # itself: on its own thread, but taken from the step's cores.
        print(f"compaction: {ps['compactions']} in the background, {ps['applies']} write-back passes between "
              f"them, {ps['compact_cpu_seconds']:.2f} s of CPU "
              f"({1e3 * ps['compact_cpu_seconds'] / summary.steps_run:.2f} ms/step amortised); "
              f"{ps['bytes_written_back'] / 1e6:.1f} MB of rows written back into the tables")
    if ps.get("rows_deferred"):
        runs = (f" (and {ps['run_rows_deferred']:,} rows of the row overlay's runs, {ps['run_rows_replayed']:,} of them "
                f"applied since)") if ps.get("run_rows_deferred") else ""
        print(f"replay on demand: the pool opened in {ps['open_seconds']:.2f} s with "
              f"{ps['rows_deferred'] - ps.get('run_rows_deferred', 0):,} journal rows "
              f"left to apply; {ps['rows_replayed']:,} applied since, as steps first read them or at a compaction{runs}")
    for ev in summary.eval:
        print(f"eval at step {ev['step']}: auc {ev['auc']:.4f}, logloss {ev['logloss']:.4f}")
    print(f"state_digest {digest}")
    return 0


def _cmd_recover(args) -> int:
    from checkpointing.job import recover_path

    rep = recover_path(args.pool, dry_run=args.dry_run, digest=not args.no_digest, crash_phase=args.crash_at)
    if args.json:
        _print_json(rep.as_dict())
        return 0
    for a in rep.actions:
        print(a)
    if rep.committed_step is None:
        print("pool holds no training state")
    else:
        verb = "would be" if args.dry_run and rep.needed else "is"
        print(f"pool {verb} consistent at step {rep.committed_step}: {rep.rows_restored} rows restored "
              f"from {len(rep.rolled_back_steps)} uncommitted steps in {rep.seconds * 1e3:.1f} ms")
    if rep.state_digest:
        print(f"state_digest {rep.state_digest}")
    return 0


def _inspect_pool(path, digest: bool) -> dict:
    from checkpointing import checkpoint_status, committed_state, state_digest
    from memory_pool import MemoryPool

    # (On demand: describing the pool reads no row; the digest applies what it reads.)
    with MemoryPool.open(path, read_only=True, consistent=digest, replay="on-demand") as pool:
        info = pool.describe()
        status = checkpoint_status(pool)
        info["checkpoint"] = status
        info["step"] = status["committed_step"]
        info["state_digest"] = None
        if digest and status["committed_step"] is not None and not status["needs_recovery"]:
            info["state_digest"] = state_digest(pool, committed_state(pool)[1])
    return info


def _inspect_job(args) -> int:
    """A job of several ranks: each rank's pool, and the job's committed step and digest."""
    from checkpointing.digest import combine_digests
    from checkpointing.job import rank_dirs

    ranks = [_inspect_pool(d, not args.no_digest) for d in rank_dirs(args.pool)]
    steps = [r["step"] for r in ranks]
    committed = None if any(s is None for s in steps) else min(steps)
    # A rank ahead of the others is rolled back at the next start: the job needs recovery.
    needs = any(r["checkpoint"]["needs_recovery"] for r in ranks) or len(set(steps)) > 1
    digests = [r["state_digest"] for r in ranks]
    info = {"path": str(args.pool), "world_size": len(ranks), "step": committed, "needs_recovery": needs,
            "state_digest": combine_digests(digests) if all(digests) and not needs else None, "ranks": ranks}
    if args.json:
        _print_json(info)
        return 0
    print(f"job {info['path']}: {len(ranks)} ranks, step reached (committed by every rank): {committed}")
    for i, r in enumerate(ranks):
        print(f"  rank {i}: tier {r['tier']}, {len(r['tables'])} tables, {r['used_bytes'] / 1e6:.1f} MB, "
              f"committed step {r['step']}" + ("  (needs recovery)" if r["checkpoint"]["needs_recovery"] else ""))
    if needs:
        print(f"needs recovery: run dlrm-cxl recover --pool {info['path']}")
    if info["state_digest"]:
        print(f"state_digest {info['state_digest']}")
    return 0


def _cmd_inspect(args) -> int:
    from checkpointing.job import is_job

    if is_job(args.pool):
        return _inspect_job(args)
    info = _inspect_pool(args.pool, not args.no_digest)
    status = info["checkpoint"]
    if args.json:
        _print_json(info)
        return 0
    print(f"pool {info['path']}  (id {info['pool_id']}, format v{info['format_version']})")
    print(f"tier {info['tier']}: {info['durability']}")
    print(f"tables: {len(info['tables'])}, {info['used_bytes'] / 1e6:.1f} MB"
          + (f" of {info['capacity_bytes'] / 1e6:.1f} MB capacity" if info["capacity_bytes"] else ""))
    for t in info["tables"]:
        print(f"  {t['name']:<24} {t['num_embeddings']:>10} x {t['embedding_dim']:<4} {t['dtype']}"
              + ("  (row cache)" if t["cached"] else ""))
    ov = info.get("overlay")
    if ov:
        print(f"row overlay: {ov['runs']} runs, {ov['bytes'] / 1e6:.1f} MB, {ov['rows']:,} rows kept out of the "
              f"images (memory_pool/overlay.py)")
    print(f"step reached (committed): {status['committed_step']}")
    if status["needs_recovery"]:
        print(f"needs recovery: uncommitted steps {status['steps_to_roll_back']}"
              + (f"; damage: {status['damaged']}" if status["damaged"] else "")
              + ("; trained with --checkpoint none and interrupted" if status["trained_without_undo"] else ""))
    if info["state_digest"]:
        print(f"state_digest {info['state_digest']}")
    return 0


def _cmd_eval(args) -> int:
    from .evaluation import eval_source, evaluate
    from .model_io import open_model
    from .options import data_spec

    if args.batches < 1:
        raise ValueError(f"--batches must be >= 1, got {args.batches}")
    pool, cfg, model = open_model(args.pool)
    try:
        meta = pool.meta
        data = args.data or meta.get("data", "synthetic")
        source = eval_source(data, data_spec(cfg), seed=meta.get("seed", 0), zipf_alpha=meta.get("zipf_alpha", 1.05),
                             skip_bad_lines=args.skip_bad_lines)
        res = evaluate(model, source, args.batches)
    finally:
        pool.close()
    if args.json:
        _print_json(res)
    else:
        print(f"eval on {data}: auc {res['auc']:.4f}, logloss {res['logloss']:.4f} over {res['samples']} samples")
    return 0


def _cmd_export(args) -> int:
    import torch

    from memory_pool.durable import atomic_write

    from .model_io import open_model

    pool, cfg, model = open_model(args.pool)
    try:
        import io

        buf = io.BytesIO()
        torch.save(model.export_torchrec(), buf)
        atomic_write(args.out, buf.getvalue())
    finally:
        pool.close()
    print(f"wrote TorchRec DLRM state_dict ({len(cfg.feature_names)} tables) to {args.out}")
    return 0


def _cmd_import(args) -> int:
    from checkpointing import UndoLogCheckpointer
    from memory_pool import destroy_pool

    from .model import PoolDLRM
    from .model_io import load_torchrec_state
    from .options import TrainOptions
    from .provisioning import build_dense_optimizer, capture_dense_state, create_trainer_pool

    cfg = model_config_from_args(args)
    state = load_torchrec_state(args.state, cfg)
    # The metadata of a pool that `train` made with the default --seed, --data and --zipf-alpha.
    pool = create_trainer_pool(TrainOptions(pool=args.pool, steps=0, tier=args.tier), cfg)
    try:
        model = PoolDLRM(cfg, pool)
        try:
            model.import_torchrec(state)
        except (RuntimeError, KeyError) as exc:  # load_state_dict: keys or shapes of the dense part
            raise ValueError(f"{args.state} does not fit --preset {args.preset}: "
                             f"{str(exc).strip().splitlines()[0]}") from None
        opt = build_dense_optimizer(cfg, model.parameters())
        ck = UndoLogCheckpointer(pool, lambda step: capture_dense_state(step, model, opt, None))
        ck.checkpoint_now(0)  # step 0 of the imported model is its first recovery point
        ck.close()
    except BaseException:
        pool.close()
        destroy_pool(args.pool)
        raise
    pool.close()
    print(f"imported {args.state} into a new pool at {args.pool} (step 0)")
    return 0


def _rank_pools(job: Path) -> list[Path]:
    """The rank pools of a job directory, refusing (before anything is deleted) a rank directory
    that is not a pool or whose pool a writer holds. Lenient about gaps in the rank numbers, so
    that a job whose destroy was interrupted can still be destroyed."""
    import os

    from checkpointing.jobdir import numbered_rank_dirs
    from memory_pool.pool import HEADER
    from memory_pool.writer_lock import LOCK_FILE, lock_holder, try_lock

    from .errors import PoolFormatError, PoolLockedError

    ranks = [p for p in numbered_rank_dirs(job) if p.is_dir()]
    for p in ranks:
        if not (p / HEADER).exists() and any(p.iterdir()):
            raise PoolFormatError(f"{p} is not a pool (no {HEADER}); refusing to delete job {job}",
                                  hint="check --pool; only pool directories are deleted")
    for p in ranks:  # every lock before any deletion: a locked rank must not leave half a job
        try:
            fd = os.open(p / LOCK_FILE, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            if not try_lock(fd):
                raise PoolLockedError(f"{p} is locked by another writer (pid {lock_holder(p) or '?'})")
        finally:
            os.close(fd)
    return ranks


def _cmd_destroy(args) -> int:
    import shutil

    from checkpointing.job import is_job
    from memory_pool import destroy_pool, read_header
    from memory_pool.lifecycle import gc, owns_region, region_bytes
    from memory_pool.pool import HEADER

    from .errors import PoolFormatError

    path = Path(args.pool)
    if not path.is_dir():
        raise PoolFormatError(f"{path} is not a pool: no such directory", hint="check --pool")
    job = is_job(path)
    if job:
        pools = _rank_pools(path)
    elif (path / HEADER).exists():
        pools = [path]
    else:
        raise PoolFormatError(f"{path} is not a pool (no {HEADER}) or a job of several ranks (no job.json); "
                              f"refusing to delete it", hint="check --pool; only pool directories are deleted")
    regions: dict[str, int] = {}  # shm regions the pools name, and their sizes
    for p in pools:
        try:
            header = read_header(p)
        except PoolFormatError:  # damaged: destroy_pool still deletes it; gc below finds its region
            continue
        storage = Path(header.get("storage_dir", p))
        if owns_region(header, storage):
            regions[str(storage)] = region_bytes(storage)
    for p in pools:
        destroy_pool(p)  # takes the writer lock (exit 5 when a writer holds it)
    if job:
        shutil.rmtree(path, ignore_errors=True)
    # Regions owned by the deleted directories that destroy_pool could not name (a damaged
    # header; an earlier pool at the same path that was deleted by hand): orphans now.
    for r in gc(under=path):
        regions[str(r.path)] = r.size_bytes
    removed = {r: b for r, b in regions.items() if not Path(r).exists()}
    freed = sum(removed.values())
    if args.json:
        _print_json({"path": str(path), "kind": "job" if job else "pool", "pools": [str(p) for p in pools],
                     "regions_removed": [{"path": r, "size_bytes": b} for r, b in removed.items()],
                     "bytes_freed": freed})
        return 0
    what = f"job {path} ({len(pools)} rank pools)" if job else f"pool {path}"
    print(f"destroyed {what}" + (f"; removed {len(removed)} shm region(s), {freed / 1e6:.1f} MB" if removed else ""))
    return 0


def _cmd_gc(args) -> int:
    from memory_pool.lifecycle import ORPHAN, UNKNOWN, find_regions, gc
    from memory_pool.tiers import shm_root

    regions = find_regions()
    removed = gc(dry_run=args.dry_run)
    gone = {r.path for r in removed}
    n, freed = len(removed), sum(r.size_bytes for r in removed)
    summary = (f"{'would remove' if args.dry_run else 'removed'} {n} orphaned region{'' if n == 1 else 's'}, "
               f"{freed / 1e6:.1f} MB")
    if args.json:
        _print_json({"root": str(shm_root()), "dry_run": args.dry_run,
                     "regions": [{**r.as_dict(), "removed": r.path in gone and not args.dry_run} for r in regions],
                     "removed": [r.as_dict() for r in removed], "removed_count": n, "removed_bytes": freed})
        return 0
    if not regions:
        print(f"no dlrm-cxl regions under {shm_root()}")
    for r in regions:
        mark = ("  -> would remove" if args.dry_run else "  -> removed") if r.path in gone else ""
        print(f"{r.status:<8} {r.size_bytes / 1e6:>10.1f} MB  {r.path}  ({r.reason}){mark}")
    kept = [r for r in regions if r.status == ORPHAN and r.path not in gone]
    if kept:
        print(f"kept {len(kept)} orphan(s) that changed status or could not be removed (permissions?)")
    unknown = [r for r in regions if r.status == UNKNOWN]
    if unknown:
        print(f"kept {len(unknown)} region(s) of unknown owner (e.g. made before owners were recorded): "
              f"remove such a region by hand once no pool uses it")
    print(summary)
    return 0


def _cmd_data(args) -> int:
    from .data import convert_tsv_to_zarr
    from .options import data_spec

    cfg = model_config_from_args(args)
    stats = convert_tsv_to_zarr(args.input, args.output, data_spec(cfg), chunk_rows=args.chunk_rows,
                                skip_bad_lines=args.skip_bad_lines, overwrite=args.overwrite)
    print(json.dumps(stats, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse reports usage errors by exiting; keep main() a function
        return int(exc.code or 0)
    handlers = {"train": _cmd_train, "recover": _cmd_recover, "inspect": _cmd_inspect, "eval": _cmd_eval,
                "export": _cmd_export, "import": _cmd_import, "data": _cmd_data, "destroy": _cmd_destroy,
                "gc": _cmd_gc}
    try:
        return handlers[args.command](args)
    except DlrmCxlError as exc:
        print(f"dlrm-cxl {args.command}: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except ValueError as exc:
        print(f"dlrm-cxl {args.command}: error: {exc}", file=sys.stderr)
        print(f"hint: see `dlrm-cxl {args.command} --help` for the options and their values", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave that cannot be read or written
        from memory_pool.durable import FULL_ERRNOS

        print(f"dlrm-cxl {args.command}: error: {exc}", file=sys.stderr)
        if exc.errno in FULL_ERRNOS:
            print("hint: free disk space, or pass a smaller --capacity", file=sys.stderr)
            return 6
        if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)):
            print("hint: check the paths given on the command line", file=sys.stderr)
            return 2
        return 1
    except KeyboardInterrupt:
        print(f"dlrm-cxl {args.command}: interrupted", file=sys.stderr)
        return 130
