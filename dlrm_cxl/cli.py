"""The ``dlrm-cxl`` command line. ``main(argv) -> int``; never calls sys.exit itself.

Exit codes (``cli_args.EXIT_CODES``, the README's list and ``--help``'s are the same): 0 ok (also:
`train` with nothing to do, and output cut short by a closed pipe: ``inspect | head`` ends
quietly); 1 unexpected error; 2 bad arguments or input (also: eval/export of a pool that needs
`recover` first, on every tier alike; a pool directory that train/recover/destroy/import cannot
write; `plot` of a pool without metrics); 3 not a pool
(also: a file given as --pool) / wrong version / volatile pool gone; 4 damage that recovery cannot
repair (nothing was changed); 5 pool locked by another writer; 6 pool or disk full; 7 malformed
data; 8 training diverged (NaN/inf loss); 9 the device failed a write (EIO); 10 a background
compaction failed; 130 interrupted. Every error class and its exit code: :mod:`dlrm_cxl.errors`.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

from .cli_args import PRESET_NAMES, build_parser, model_config_from_args
from .cli_train import check_data_path, check_pool_writable, cmd_recover, cmd_train, not_writable_error, print_json, \
    with_cli_hint
from .errors import (
    DataFormatError,
    DlrmCxlError,
    InvalidConfigError,
    PoolExistsError,
    PoolFormatError,
    PoolLockedError,
    PoolNotWritableError,
)
from .footprint import group_tables, pool_footprint
from .pool_status import needs_recovery

__all__ = ["main", "build_parser", "model_config_from_args", "PRESET_NAMES"]


def _inspect_pool(path, digest: bool) -> dict:
    from checkpointing import checkpoint_status, committed_state, state_digest
    from memory_pool import MemoryPool

    # (On demand: describing the pool reads no row; the digest applies what it reads.)
    with MemoryPool.open(path, read_only=True, consistent=digest, replay="on-demand") as pool:
        info = pool.describe()
        status = checkpoint_status(pool)
        info["checkpoint"] = status
        info["step"] = status["committed_step"]
        info["needs_recovery"] = needs_recovery(status)  # (the rule eval, export and train apply)
        info["embedding_tables"] = group_tables(info["tables"], info["meta"])["embedding"]
        info["footprint"] = pool_footprint(path, info)
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
    needs = any(r["needs_recovery"] for r in ranks) or len(set(steps)) > 1
    digests = [r["state_digest"] for r in ranks]
    info = {"path": str(args.pool), "world_size": len(ranks), "step": committed, "needs_recovery": needs,
            "state_digest": combine_digests(digests) if all(digests) and not needs else None, "ranks": ranks}
    if args.json:
        print_json(info)
        return 0
    print(f"job {info['path']}: {len(ranks)} ranks, step reached (committed by every rank): {committed}")
    for i, r in enumerate(ranks):
        print(f"  rank {i}: tier {r['tier']}, {len(r['tables'])} tables, {r['used_bytes'] / 1e6:.1f} MB, "
              f"committed step {r['step']}" + ("  (needs recovery)" if r["needs_recovery"] else ""))
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
        print_json(info)
        return 0
    print(f"pool {info['path']}  (id {info['pool_id']}, format v{info['format_version']})")
    print(f"tier {info['tier']}: {info['durability']}")
    _print_tables(info)
    _print_footprint(info["footprint"])
    ov = info.get("overlay")
    if ov:
        print(f"row overlay: {ov['runs']} runs, {ov['bytes'] / 1e6:.1f} MB, {ov['rows']:,} rows kept out of the "
              f"images (memory_pool/overlay.py)")
    # (over the embedding tables: an optimizer state's rows share their table's bits)
    fresh, tables = info.get("fresh_rows") or {}, info["embedding_tables"] or info["tables"]
    if any(t["name"] in fresh for t in tables):
        print(f"rows known never trained: {sum(fresh.get(t['name'], 0) for t in tables):,} of "
              f"{sum(t['num_embeddings'] for t in tables):,} (a DRAM cache creates them from the initializer on first "
              f"use, no read: memory_pool/fresh.py)")
    print(f"step reached (committed): {status['committed_step']}")
    if status.get("replay_steps"):
        r = status["replay_steps"]
        print(f"committed steps {r[0]}..{r[-1]} after it are replayed from their records by `dlrm-cxl recover` "
              f"(or the next `train`): the recovery window's steps")
    if info["needs_recovery"]:
        steps = status["steps_to_roll_back"]
        why = ([f"uncommitted step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"] if steps else []) \
            + ([f"{status['torn_bytes']} bytes of unfinished journal records"] if status["torn_bytes"] else []) \
            + ([f"damage: {'; '.join(status['damaged'])}"] if status["damaged"] else []) \
            + (["trained with --checkpoint none and interrupted"] if status["trained_without_undo"] else [])
        print(f"needs recovery: {'; '.join(why)} (`dlrm-cxl recover --pool {info['path']}`; eval and export refuse "
              f"it until then)")
    if info["state_digest"]:
        print(f"state_digest {info['state_digest']}")
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _print_tables(info: dict) -> None:
    """The tables, each embedding table on one line with its optimizer state."""
    groups = group_tables(info["tables"], info["meta"])
    emb, other = groups["embedding"], groups["other"]
    n_state = sum(len(t["optimizer_state"]) for t in emb)
    cap = f" of {_mb(info['capacity_bytes'])} capacity" if info["capacity_bytes"] else ""
    state = ("each with its optimizer state" if n_state and all(t["optimizer_state"] for t in emb) else
             f"{n_state} with optimizer state" if n_state else "no optimizer state (SGD)")
    print(f"tables: {len(emb)} embedding tables, {state}"
          + (f", and {len(other)} other tables" if other else "")
          + f" ({len(info['tables'])} tables in the pool), {_mb(info['used_bytes'])}{cap}")
    for t in emb:
        st = "".join(f"  + {s['name']} {s['num_embeddings']} x {s['embedding_dim']}" for s in t["optimizer_state"])
        print(f"  {t['name']:<24} {t['num_embeddings']:>10} x {t['embedding_dim']:<4} {t['dtype']}{st}"
              + ("  (row cache)" if t["cached"] else ""))
    for t in other:
        print(f"  {t['name']:<24} {t['num_embeddings']:>10} x {t['embedding_dim']:<4} {t['dtype']}  (other table)"
              + ("  (row cache)" if t["cached"] else ""))


def _print_footprint(fp: dict) -> None:
    """What the pool takes, by part, on disk and in memory (files on tmpfs: /dev/shm)."""
    print(f"size: {_mb(fp['disk'])} on disk, {_mb(fp['memory'])} in memory (files on tmpfs, e.g. /dev/shm)")
    names = {"tables": "tables", "optimizer_state": "optimizer state", "journal": "journal",
             "runs": "runs (row overlay)", "other": "other"}
    for part, b in fp["parts"].items():
        where = ([f"{_mb(b['disk'])} on disk"] if b["disk"] else []) + \
            ([f"{_mb(b['memory'])} in memory"] if b["memory"] else [])
        print(f"  {names[part]:<20} {' + '.join(where) or _mb(0)}")


def _cmd_eval(args) -> int:
    from checkpointing import checkpoint_status

    from .evaluation import eval_source, evaluate
    from .model_io import open_model
    from .options import data_spec

    if args.batches < 1:
        raise ValueError(f"--batches must be >= 1, got {args.batches}")
    check_data_path("--data", args.data)
    pool, cfg, model = open_model(args.pool)
    try:
        meta = pool.meta
        step = checkpoint_status(pool)["committed_step"]
        data = args.data or meta.get("data", "synthetic")
        try:
            source = eval_source(data, data_spec(cfg), seed=meta.get("seed", 0),
                                 zipf_alpha=meta.get("zipf_alpha", 1.05), skip_bad_lines=args.skip_bad_lines)
            res = evaluate(model, source, args.batches)
        except DataFormatError as exc:
            raise with_cli_hint(exc, cfg) from None
    finally:
        pool.close()
    res = {"step": step, "data": str(data), **res}
    if args.json:
        print_json(res)
        return 0
    what = "held-out synthetic data" if str(data) == "synthetic" else str(data)
    if res["whole_data"]:
        how = "the whole file, each sample once" if Path(data).is_file() else "the whole dataset, each sample once"
    elif str(data) == "synthetic":
        how = f"{args.batches} batches"
    else:
        how = f"the first {args.batches} batches; --batches N reads more"
    print(f"eval of step {step} on {what}: auc {res['auc']:.4f}, logloss {res['logloss']:.4f} over "
          f"{res['samples']} samples ({how})")
    return 0


def _cmd_export(args) -> int:
    from .export import write_torchrec_state
    from .model_io import open_model

    # (on demand: the journal's and the runs' rows are read where they are, by Table.snapshot,
    # not applied into the working copy first -- on `kaggle` up to a GB of journal rows over
    # hundreds of thousands of image pages)
    pool, cfg, model = open_model(args.pool, replay="on-demand")
    try:
        write_torchrec_state(model, args.out)  # (the tables streamed, not held: see there)
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
    _check_new_pool_dir(Path(args.pool))
    state = load_torchrec_state(args.state, cfg)
    # The metadata of a pool that `train` made with the default --seed, --data and --zipf-alpha.
    try:
        pool = create_trainer_pool(TrainOptions(pool=args.pool, steps=0, tier=args.tier), cfg)
    except PoolExistsError as exc:  # (made meanwhile) its hint would name train's --fresh
        raise PoolExistsError(exc.message, hint=_IMPORT_EXISTS_HINT.format(pool=args.pool)) from None
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


_IMPORT_EXISTS_HINT = ("import makes a new pool: pass a new --pool directory, or delete the existing pool first "
                       "with `dlrm-cxl destroy --pool {pool}`")


def _check_new_pool_dir(path: Path) -> None:
    """``import`` makes a new pool: refuse (before the state file is read) a --pool that holds one."""
    from memory_pool.pool import HEADER

    if (path / HEADER).exists():
        raise PoolExistsError(f"{path} already holds a pool", hint=_IMPORT_EXISTS_HINT.format(pool=path))
    if path.is_dir() and any(path.iterdir()):
        raise PoolExistsError(f"{path} is not an empty directory",
                              hint="import makes a new pool: pass a new (or empty) --pool directory")


def _rank_pools(job: Path) -> list[Path]:
    """The rank pools of a job directory, refusing (before anything is deleted) a rank directory
    that is not a pool or whose pool a writer holds. Lenient about gaps in the rank numbers, so
    that a job whose destroy was interrupted can still be destroyed."""
    from checkpointing.jobdir import numbered_rank_dirs
    from memory_pool.pool import HEADER
    from memory_pool.writer_lock import lock_held, lock_holder

    from .errors import PoolFormatError, PoolLockedError

    ranks = [p for p in numbered_rank_dirs(job) if p.is_dir()]
    for p in ranks:
        if not (p / HEADER).exists() and any(p.iterdir()):
            raise PoolFormatError(f"{p} is not a pool (no {HEADER}); refusing to delete job {job}",
                                  hint="check --pool; only pool directories are deleted")
    for p in ranks:  # every lock before any deletion: a locked rank must not leave half a job
        if lock_held(p):
            raise PoolLockedError(f"{p} is locked by another writer (pid {lock_holder(p) or '?'})",
                                  hint=_WRITER_LOCKED_HINT)
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
    # Every file deletable before any is deleted: a read-only pool is refused whole.
    check_pool_writable(path, "destroy", extra=list(regions))
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
        print_json({"path": str(path), "kind": "job" if job else "pool", "pools": [str(p) for p in pools],
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
        print_json({"root": str(shm_root()), "dry_run": args.dry_run,
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
    if not args.input.is_file():
        what = "is a directory" if args.input.is_dir() else "no such file" if not args.input.exists() else \
            "is not a regular file"
        raise InvalidConfigError(f"data convert: INPUT {args.input}: {what}",
                                 hint="the first argument of `dlrm-cxl data convert INPUT.tsv OUTPUT.zarr` is the "
                                      "Criteo TSV file to convert")
    stats = convert_tsv_to_zarr(args.input, args.output, data_spec(cfg), chunk_rows=args.chunk_rows,
                                skip_bad_lines=args.skip_bad_lines, overwrite=args.overwrite)
    print(json.dumps(stats, default=str))
    return 0


def _cmd_plot(args) -> int:
    from checkpointing.job import is_job
    from memory_pool.pool import HEADER

    from .metrics import read_metrics
    from .plot import plot_metrics

    path = Path(args.pool)
    if not (path / HEADER).exists() and not is_job(path):
        what = "no such directory" if not path.exists() else f"no {HEADER}"
        raise PoolFormatError(f"{path} is not a pool ({what})", hint="check --pool: the directory `dlrm-cxl train` "
                                                                    "trained")
    drawn = plot_metrics(read_metrics(path), args.out, title=str(path))
    if args.json:
        print_json(drawn)
        return 0
    print(f"wrote {drawn['out']}: loss, samples/s and eval AUC over steps {drawn['first_step']}..{drawn['last_step']} "
          f"({drawn['steps']} steps, {drawn['evals']} evaluations)")
    return 0


# Commands that change the pool, and so write to its directory (its LOCK first of all).
_WRITERS = ("train", "recover", "destroy", "import")
_WRITER_LOCKED_HINT = ("wait until the other process ends (a trainer, or an inspect/eval/export reading the pool), "
                       "or stop it; while a trainer runs, `dlrm-cxl inspect --no-digest` can still read the pool")


def _check_pool_arg(args) -> None:
    """A regular file (or anything but a directory) given as --pool: say so, whatever the command."""
    pool = getattr(args, "pool", None)
    if pool is None:
        return
    p = Path(pool)
    if p.exists() and not p.is_dir():
        hint = (f"pass the directory that holds it: --pool {p.parent}" if p.name == "pool.json" else
                "--pool takes a directory: the pool's (it holds pool.json), or a new one for train/import")
        raise PoolFormatError(f"{p} is a file, not a pool directory", hint=hint)


def _not_writable(exc: OSError, args) -> PoolNotWritableError | None:
    """A command that changes the pool could not write to its directory (EROFS, EPERM of
    `chattr +i`, EACCES): the typed error, or None for any other OSError."""
    pool = getattr(args, "pool", None)
    if args.command not in _WRITERS or pool is None or exc.errno not in (errno.EROFS, errno.EPERM, errno.EACCES):
        return None
    where = Path(os.path.abspath(pool))
    name = Path(os.path.abspath(exc.filename)) if exc.filename else None
    if name is not None and name != where and where not in name.parents and name not in where.parents:
        return None  # (another path: a data file, a temporary directory)
    return not_writable_error(pool, args.command, exc.errno, exc.filename or pool)


def _output_closed() -> int:
    """The reader of stdout went away (``dlrm-cxl inspect | head -5``): end quietly, as Unix
    tools do, with exit 0 (not 141, the status of a tool killed by SIGPIPE: a ``set -o pipefail``
    script would stop there, and the command did what was asked of it). In a real process stdout
    is pointed at /dev/null, so that the interpreter's last flush does not complain either."""
    if sys.stdout is sys.__stdout__ and sys.stdout is not None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
    return 0


def _report(command: str, exc: DlrmCxlError) -> int:
    print(f"dlrm-cxl {command}: error: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {exc.hint}", file=sys.stderr)
    return exc.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse reports usage errors by exiting; keep main() a function
        return int(exc.code or 0)
    handlers = {"train": cmd_train, "recover": cmd_recover, "inspect": _cmd_inspect, "eval": _cmd_eval,
                "export": _cmd_export, "import": _cmd_import, "data": _cmd_data, "destroy": _cmd_destroy,
                "gc": _cmd_gc, "plot": _cmd_plot}
    try:
        _check_pool_arg(args)
        code = handlers[args.command](args)
        sys.stdout.flush()  # (here, where a closed pipe is still ours to report)
        return code
    except BrokenPipeError:
        return _output_closed()
    except PoolLockedError as exc:
        if args.command in _WRITERS and exc.hint == PoolLockedError.default_hint:
            # (its default hint sends the user to inspect/eval, which a trainer's lock refuses too)
            exc = PoolLockedError(exc.message, hint=_WRITER_LOCKED_HINT)
        return _report(args.command, exc)
    except DlrmCxlError as exc:
        return _report(args.command, exc)
    except ValueError as exc:
        print(f"dlrm-cxl {args.command}: error: {exc}", file=sys.stderr)
        print(f"hint: see `dlrm-cxl {args.command} --help` for the options and their values", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave that cannot be read or written
        from memory_pool.durable import FULL_ERRNOS

        not_writable = _not_writable(exc, args)
        if not_writable is not None:
            return _report(args.command, not_writable)
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
