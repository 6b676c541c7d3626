"""The ``train`` and ``recover`` commands of the ``dlrm-cxl`` command line (:mod:`dlrm_cxl.cli`,
whose ``main`` runs them and turns their errors into exit codes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .cli_args import _print_json, model_config_from_args

__all__ = ["_cmd_train", "_cmd_recover"]


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
