"""Replay: re-run the committed steps after a recovery point, checked against their records.

Recovery windows (:mod:`checkpointing.policy`) make the full state durable once per window;
each step in between leaves only a commit record: the step, its batch's data position and the
exact bits of its loss. After a crash, recovery (:mod:`checkpointing.recovery`) restores the
window's start s; this module brings the pool on to the newest committed step k by training
s+1..k again, which is deterministic (every RNG, the data position and every row are part of
the state). Each replayed step's loss and position must equal its record bit for bit, checked
before the step changes a row: the first difference stops the replay with
:class:`ReplayMismatchError` (exit 11) and leaves the pool at the last step that agreed.

Replay needs the same data: each run records what identifies its data source in the pool
(:func:`dlrm_cxl.replay_source.data_identity`: path, size and mtime of a file; of every file of a zarr directory;
the seed of synthetic data), and the settings that make a step bit-exact (torch's threads, the
kernel, the device). A source that is gone or changed stops recovery at the window's start
(:class:`ReplaySourceError`, exit 12): it never replays different data.

``dlrm-cxl recover`` calls :func:`recover_and_replay`; ``train`` replays as it resumes (the
trainer checks each step it re-runs, see ``Trainer.check_replay``).
"""

from __future__ import annotations

import time
from typing import Callable

from .errors import ReplaySourceError
from .replay_source import check_replay_settings, check_replay_source

__all__ = ["recover_and_replay", "REPLAY_PHASE"]

# `dlrm-cxl recover --crash-at mid-replay`: SIGKILL once half of the steps were replayed (tests:
# a crash during the replay, then recovery again).
REPLAY_PHASE = "mid-replay"


def recover_and_replay(path, *, dry_run: bool = False, digest: bool = True, crash_phase: str | None = None,
                       no_replay: bool = False, log: Callable[[str], None] | None = None):
    """Recover ``path`` (a pool or a job) to its newest recovery point, then replay the committed
    steps after it (a single pool; a job's ranks replay together when ``train`` resumes them).
    Returns the recovery report with the replay filled in (``committed_step``: where the pool is
    now). ``seconds``: the whole of it, opening the pool included, imports not."""
    from checkpointing import RecoveryReport, checkpoint_status, committed_state, recover_path, state_digest
    from checkpointing.crash import die
    from checkpointing.jobdir import is_job
    from memory_pool import MemoryPool

    from .options import TrainOptions
    from .trainer import Trainer

    t0 = time.perf_counter()
    phase = crash_phase if crash_phase != REPLAY_PHASE else None
    if dry_run or no_replay or phase is not None or is_job(path):
        return recover_path(path, dry_run=dry_run, digest=digest, crash_phase=phase, no_replay=no_replay)
    # What is there to replay (read-only, the journal scanned, no row read)?
    with MemoryPool.open(path, read_only=True, rows=False) as probe:
        status, meta = checkpoint_status(probe), probe.meta
    todo = status["replay_steps"]
    if not todo or "model" not in meta:
        return recover_path(path, digest=digest)
    try:
        check_replay_source(meta.get("data_identity"), meta.get("data"), first=todo[0], last=todo[-1],
                            step=status["committed_step"])
        check_replay_settings(meta.get("run"), first=todo[0], last=todo[-1], step=status["committed_step"])
    except ReplaySourceError:
        # (the rollback to the window's start happens all the same: the pool is left consistent,
        # with the records of the steps after it kept for a retry)
        recover_path(path, digest=False)
        raise
    # One open: the trainer recovers the pool to the window's start as it opens it (the same
    # recover_pool as above), then trains the recorded steps again, checking each.
    run = meta.get("run") or {}
    opts = TrainOptions(pool=str(path), steps=todo[-1], data=meta.get("data") or "synthetic",
                        seed=meta.get("seed", 0), zipf_alpha=meta.get("zipf_alpha", 1.05), threads=run.get("threads"),
                        kernel=run.get("kernel", "fused"), device=run.get("device", "cpu"), progress=False,
                        dram_cache_bytes=run.get("dram_cache_bytes"), crash_at=None,
                        # One window over the steps replayed: each writes its commit record only, the
                        # last one a recovery point (a crash during the replay keeps the witnesses).
                        window=max(1, todo[-1] - status["committed_step"]))
    trainer = Trainer(opts, None, log=log or (lambda s: None))
    rep = trainer.recovery or RecoveryReport(str(path), status["committed_step"], False, False)
    rep.restored_step = trainer.step
    rep.replay_steps = todo
    if crash_phase == REPLAY_PHASE:
        trainer.after_step = lambda k: die(f"{REPLAY_PHASE} (replayed to step {k})") \
            if k >= rep.restored_step + max(1, len(todo) // 2) else None
    t1 = time.perf_counter()
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    rep.replayed = summary.replayed_steps
    rep.replay_seconds = time.perf_counter() - t1
    rep.committed_step = summary.end_step
    rep.needed = True
    rep.actions.append(f"replayed steps {todo[0]}..{todo[-1]} from their commit records: every loss "
                       f"reproduced bit for bit")
    rep.seconds = time.perf_counter() - t0
    if digest and rep.committed_step is not None:
        with MemoryPool.open(path, read_only=True, consistent=True, replay="on-demand") as p:
            rep.state_digest = state_digest(p, committed_state(p)[1])
    return rep
