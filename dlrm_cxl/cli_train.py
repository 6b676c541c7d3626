"""The ``train`` and ``recover`` commands of the ``dlrm-cxl`` command line (:mod:`dlrm_cxl.cli`,
whose ``main`` runs them and turns their errors into exit codes).
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
from pathlib import Path

from .cli_args import data_convert_hint, model_config_from_args
from .errors import ConfigMismatchError, DataFormatError, InvalidConfigError, PoolNotWritableError

__all__ = ["cmd_train", "cmd_recover", "with_cli_hint", "check_data_path", "check_pool_writable", "not_writable_error",
           "print_json", "describe_skips"]


def print_json(obj) -> None:
    """What a command prints with ``--json`` (every command of the CLI prints through this)."""
    print(json.dumps(obj, indent=1, sort_keys=True, default=str))


def cmd_train(args) -> int:
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
    if args.data is None:  # resume: the data the pool was trained on, as recorded in it
        args.data = _recorded_data(Path(stored_at)) if pool_exists else "synthetic"
    _check_data_paths(args)
    if pool_exists and (Path(stored_at) / "pool.json").exists():
        _check_pool_flags(args, Path(stored_at))
    opts = TrainOptions(
        pool=args.pool, steps=args.steps, data=args.data, seed=args.seed, tier=args.tier or "auto", device=args.device,
        eval_every=args.eval_every, eval_batches=args.eval_batches, eval_data=args.eval_data,
        checkpoint=args.checkpoint, window=args.window, recovery_budget=args.recovery_budget,
        crash_at=parse_crash_at(args.crash_at) if args.crash_at else None, crash_rank=args.crash_rank,
        threads=args.threads,
        skip_bad_lines=args.skip_bad_lines, capacity_bytes=args.capacity, dram_cache_bytes=args.dram_cache,
        fresh=args.fresh, progress=not args.no_progress and not args.json, zipf_alpha=args.zipf_alpha, kernel=args.kernel,
        writer=args.writer, verbose=args.verbose, prefetch_batches=args.prefetch_batches,
        override=tuple(k.strip().replace("-", "_") for k in args.override.split(",") if k.strip()))
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else None
    if pool_exists and not distributed and not args.json and not args.crash_at:
        from memory_pool.writer_lock import lock_held

        from .options import validate_options
        from .provisioning import probe_training_pool

        validate_options(opts)
        _, status = probe_training_pool(opts, cfg)  # (refuses flags that disagree with the pool)
        c = status["committed_step"]
        if c is not None and c >= args.steps and not (status["needs_recovery"] or status["steps_to_roll_back"]
                                                      or status["torn_bytes"] or lock_held(args.pool)):
            print(f"pool {args.pool} is already at step {c}; nothing to do (--steps is the step to reach in "
                  f"total: --steps {c + 100} trains 100 more)")
            if not args.no_digest:
                print(f"state_digest {_committed_digest(args.pool)}")
            return 0
    elif not pool_exists and not distributed:
        _check_data_fits(opts, cfg)  # before the pool is made: a zarr made for other tables
    if not distributed and (Path(args.pool) / "pool.json").exists():
        check_pool_writable(args.pool, "train")  # (--fresh deletes it: refused whole, not half done)
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
        try:
            trainer = Trainer(opts, cfg, log=log, dist=ctx)
        except DataFormatError as exc:
            raise with_cli_hint(exc, cfg or stored_config(stored_at)) from None
        try:
            summary = trainer.run()
            digest, model_digest = (None, None) if args.no_digest else trainer.digests()
            # what --skip-bad-lines skipped in the data trained on (up to the last step's batch,
            # not the read-ahead): distinct bad lines, times skipped, passes that skipped one
            skips = trainer.source.skip_report(upto=trainer.position_of(trainer.step)) \
                if hasattr(trainer.source, "skip_report") else None
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
    d.setdefault("skipped_lines", skips["lines"] if skips else 0)  # (distinct bad lines)
    d.setdefault("bad_lines", skips)
    if args.json:
        print_json(d)
        return 0
    ck = summary.checkpoint
    if not summary.steps_run and summary.end_step >= args.steps:
        print(f"pool {args.pool} is already at step {summary.end_step}; nothing to do (--steps is the step to "
              f"reach in total: --steps {summary.end_step + 100} trains 100 more)")
        if digest is not None:
            print(f"state_digest {digest}")
        return 0
    print(f"done: step {summary.end_step} ({summary.steps_run} steps this run, {summary.samples} samples "
          f"in {summary.seconds:.1f} s, {summary.samples_per_s:,.0f} samples/s)")
    if summary.final_loss is not None:
        print(f"loss (mean of last 10 steps): {summary.final_loss:.4f}")
    if summary.epochs:
        print(f"data: the file was read {summary.epochs} time(s) from the start (epochs wrapped)")
    if skips and skips["skips"]:
        print(f"data: {describe_skips(skips)} (--skip-bad-lines)")
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
    if ps.get("rows_deferred") and args.verbose:  # (a detail: -v)
        runs = (f" (and {ps['run_rows_deferred']:,} rows of the row overlay's runs, {ps['run_rows_replayed']:,} of them "
                f"applied since)") if ps.get("run_rows_deferred") else ""
        print(f"replay on demand: the pool opened in {ps['open_seconds']:.2f} s with "
              f"{ps['rows_deferred'] - ps.get('run_rows_deferred', 0):,} journal rows "
              f"left to apply; {ps['rows_replayed']:,} applied since, as steps first read them or at a compaction{runs}")
    _print_cache(ps, summary.steps_run)
    for ev in summary.eval:
        print(f"eval at step {ev['step']}: auc {ev['auc']:.4f}, logloss {ev['logloss']:.4f}")
    if digest is not None:   # (--no-digest: `dlrm-cxl inspect` computes it later)
        print(f"state_digest {digest}")
    return 0


def _print_cache(ps: dict, steps: int) -> None:
    """The DRAM cache's line (dlrm_cxl/lookahead.py) and the memory line of a train summary."""
    c = ps.get("cache")
    if c and steps:
        hr = "n/a" if c["hit_rate"] is None else f"{c['hit_rate']:.1%}"
        print(f"dram cache: {c['arena_bytes'] / 1e6:.1f} MB for {c['slots']:,} of {c['rows']:,} rows, hit rate {hr}, "
              f"{c['rows_prefetched']:,} rows prefetched, {c.get('rows_created', 0):,} of the rows missed never trained "
              f"(created, not read); steps waited {c['wait_ms_per_step']:.2f} ms/step for rows "
              f"and spent {c['write_ms_per_step']:.2f} ms/step writing them through; "
              f"{c['bytes_read_home_per_step'] / 1e6:.2f} MB/step read from the home")
    m = ps.get("memory")
    if m and m.get("vm_rss") is not None:
        budget = f" against a DRAM budget of {m['budget_bytes'] / 1e6:.1f} MB" if m.get("budget_bytes") else ""
        dev = f"; the shm region (the device) holds {m['shm_device_bytes'] / 1e6:.1f} MB" if m.get("shm_device_bytes") else ""
        print(f"memory: {m['vm_rss'] / 1e6:.1f} MB resident ({m.get('rss_anon', 0) / 1e6:.1f} MB anonymous), "
              f"{m['pool_page_cache_bytes'] / 1e6:.1f} MB of pool files in the page cache{budget}{dev}")


def cmd_recover(args) -> int:
    from .replay import recover_and_replay

    if not args.dry_run:
        check_pool_writable(args.pool, "recover")
    rep = recover_and_replay(args.pool, dry_run=args.dry_run, digest=not args.no_digest, crash_phase=args.crash_at,
                             no_replay=args.no_replay)
    if args.json:
        print_json(rep.as_dict())
        return 0
    would = args.dry_run and rep.needed
    for a in rep.actions:
        # (the report's actions say "would roll back step k: N rows restored")
        print(re.sub(r"(\d+) rows restored", r"\1 rows would be restored", a) if args.dry_run else a)
    if rep.committed_step is None:
        print("pool holds no training state")
    else:
        n = len(rep.rolled_back_steps)
        steps = f"{n} uncommitted step{'' if n == 1 else 's'}"
        if would:
            print(f"pool would be consistent at step {rep.committed_step}: {rep.rows_restored} rows would be "
                  f"restored from {steps} (checked in {rep.seconds * 1e3:.1f} ms; nothing was changed)")
        else:
            restored = getattr(rep, "restored_step", rep.committed_step)
            replay = getattr(rep, "replay_steps", None) or []
            if replay and getattr(rep, "replayed", 0):
                print(f"pool is consistent at step {rep.committed_step}: restored step {restored} (the recovery "
                      f"window's start; {rep.rows_restored} rows), then replayed {rep.replayed} committed steps, in "
                      f"{rep.seconds * 1e3:.0f} ms ({rep.replay_seconds * 1e3:.0f} ms replaying)")
            else:
                print(f"pool is consistent at step {rep.committed_step}: {rep.rows_restored} rows restored "
                      f"from {steps} in {rep.seconds * 1e3:.1f} ms")
    if rep.state_digest:
        print(f"state_digest {rep.state_digest}")
    return 0


def describe_skips(report: dict) -> str:
    """What --skip-bad-lines skipped, in words (``report``: CriteoTSVReader.skip_report()): a
    bad line is counted once, however many passes over the file read it."""
    n, skips, passes = report["lines"], report["skips"], report["passes"]
    lines = f"{n} malformed line{'' if n == 1 else 's'}"
    if passes <= 1:
        return f"{lines} skipped"
    if skips == n * passes:
        return f"{lines}, skipped on each of {passes} passes over the file"
    return f"{lines}, skipped {skips} times over {passes} passes over the file"


def _recorded_data(pool: Path) -> str:
    """The --data an existing pool was created with (its meta), "synthetic" if it records none."""
    from memory_pool import read_header

    if not (pool / "pool.json").exists():
        return "synthetic"
    return read_header(pool).get("meta", {}).get("data") or "synthetic"


def _committed_digest(pool) -> str:
    """The state digest of the pool's committed step (what `train` prints after its steps), read
    without changing the pool."""
    from checkpointing import committed_state, state_digest
    from memory_pool import MemoryPool

    with MemoryPool.open(pool, read_only=True, consistent=True, replay="on-demand") as p:
        return state_digest(p, committed_state(p)[1])


def check_data_path(flag: str, value) -> None:
    """A data flag names something that exists: a usage error (exit 2), before any pool is made,
    not malformed data (exit 7) after."""
    if value is None or str(value) == "synthetic" or Path(value).exists():
        return
    raise InvalidConfigError(
        f"{flag} {value}: no such file or directory",
        hint=f"pass {flag} synthetic, a Criteo .tsv file, or a .zarr directory made by `dlrm-cxl data convert`")


def _check_data_paths(args) -> None:
    check_data_path("--data", args.data)
    check_data_path("--eval-data", args.eval_data)


def _check_data_fits(opts, cfg) -> None:
    """A zarr dataset (or any data source) for a new pool is opened against the model's tables
    before the pool is made: one converted for other table sizes is refused here, not after a
    pool of hundreds of MB was created for nothing."""
    from .data import make_data_source
    from .options import data_spec

    for data in (opts.data, opts.eval_data):
        if data is None or str(data) == "synthetic" or not Path(data).is_dir():
            continue  # (a TSV is checked line by line as it is read)
        try:
            make_data_source(data, data_spec(cfg), seed=opts.seed, skip_bad_lines=opts.skip_bad_lines)
        except DataFormatError as exc:
            raise with_cli_hint(exc, cfg) from None


def with_cli_hint(exc: DataFormatError, cfg) -> DataFormatError:
    """The error with a hint that names the CLI command (the data layer's names its Python call)."""
    if "convert_tsv_to_zarr" not in (exc.hint or "") or cfg is None:
        return exc
    what = ("create it for this model" if "create it" in exc.hint else "convert the TSV again for this model "
            "(a zarr dataset is hashed for one model's table sizes)")
    return type(exc)(exc.message, hint=data_convert_hint(cfg, what) + ", or pass --data FILE.tsv")


def _check_pool_flags(args, pool: Path) -> None:
    """Flags that only shape a new pool (--tier, --capacity) are refused, not ignored, on an
    existing one when they ask for something else than it has."""
    from memory_pool import read_header

    header = read_header(pool)
    tier, capacity = header.get("tier"), header.get("capacity_bytes")
    if args.tier not in (None, "auto") and args.tier != tier:
        raise ConfigMismatchError(
            f"{args.pool} is a {tier} pool; --tier {args.tier} applies to a new pool only",
            hint=f"drop --tier to continue the {tier} pool, pass --fresh to start over on {args.tier}, or "
                 f"`dlrm-cxl export` it and `dlrm-cxl import --tier {args.tier}` into a new --pool")
    if args.capacity is not None and args.capacity != capacity:
        has = "no capacity limit" if capacity is None else f"a capacity of {capacity:,} bytes"
        raise ConfigMismatchError(
            f"{args.pool} was created with {has}; --capacity {args.capacity:,} bytes applies to a new pool only",
            hint="drop --capacity to continue the pool as created, or pass --fresh to start over with it")


_WHY = {errno.EROFS: "read-only file system", errno.EPERM: "operation not permitted (immutable: chattr +i?)",
        errno.EACCES: "permission denied"}


def not_writable_error(pool, command: str, err: int, name) -> PoolNotWritableError:
    """The typed error of a command that changes the pool and cannot write ``name`` in it."""
    return PoolNotWritableError(f"{pool}: `dlrm-cxl {command}` changes the pool but cannot write to it: "
                                f"{name}: {_WHY.get(err, os.strerror(err))}; nothing was changed")


def check_pool_writable(pool, command: str, extra=()) -> None:
    """Before a command that changes the pool (or deletes it) writes anything: each directory and
    file of the pool (and of ``extra``, e.g. its shm region) can be written. A read-only mount,
    ``chattr +i`` or missing permissions refuse the command whole (PoolNotWritableError), not
    half done (a deletion that removed what it could, a step whose journal could not be
    written)."""
    for top in [Path(pool), *map(Path, extra)]:
        if not top.is_dir():
            continue
        for d, _, files in os.walk(top):
            for name in [d, *(os.path.join(d, f) for f in files)]:
                if os.path.islink(name) or os.access(name, os.W_OK):
                    continue
                try:
                    ro = bool(os.statvfs(name).f_flag & os.ST_RDONLY)
                except OSError:
                    ro = False
                err = errno.EROFS if ro else errno.EPERM if os.geteuid() == 0 else errno.EACCES
                raise not_writable_error(pool, command, err, name)
