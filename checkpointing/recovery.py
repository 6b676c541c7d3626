"""Recovery: bring a pool back to its newest recovery point after a crash.

1. Verify everything first, change nothing: the header, the ``COMMIT`` record, the dense
   snapshot it names, and every undo record of a step after it (checksums, table names,
   row ranges). Any damage raises :class:`RecoveryError` and the pool is left as it was.
2. Apply the undo records of every step after ``COMMIT``, newest first (after that each
   row holds its value at the committed step, whichever later steps touched it).
3. Persist exactly the restored rows.
4. Zero the seals of the rolled-back steps, durably, so their records are never applied to
   a future that re-executes those steps.

Idempotent: a crash anywhere in 2–4 leaves records that, applied again, give the same rows
(they are absolute before-images, and the committed state is their fixed point).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from memory_pool import MemoryPool
from memory_pool.errors import PoolCorruptError, RecoveryError

from .crash import die
from .digest import state_digest
from .store import DENSE, ckpt_dir, invalidate_slot, read_commit, read_dense, read_slot, scan_slots, write_commit
from .undo import RUNNING_MARKER

__all__ = ["recover", "RecoveryReport", "checkpoint_status"]


@dataclass
class RecoveryReport:
    path: str
    committed_step: int | None
    needed: bool
    dry_run: bool
    rolled_back_steps: list[int] = field(default_factory=list)
    rows_restored: int = 0
    seconds: float = 0.0
    actions: list[str] = field(default_factory=list)
    state_digest: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def checkpoint_status(pool: MemoryPool) -> dict:
    """What the checkpoint files say, without changing anything (for ``inspect``)."""
    d = ckpt_dir(pool.storage_dir)
    commit = read_commit(d) if d.is_dir() else None
    slots = scan_slots(d / "undo")
    c = commit["step"] if commit else None
    later = sorted(s.step for s in slots if s.state == "sealed" and (c is None or s.step > c))
    damaged = [s.problem for s in slots if s.state == "damaged"]
    return {
        "committed_step": c,
        "dense_file": commit["dense_file"] if commit else None,
        "undo_slots": len(slots),
        "steps_to_roll_back": later,
        "damaged": damaged,
        "trained_without_undo": (d / RUNNING_MARKER).exists(),
        "needs_recovery": bool(later or damaged or (d / RUNNING_MARKER).exists()),
    }


def _load_verified(pool: MemoryPool, target: int | None = None):
    d = ckpt_dir(pool.storage_dir)
    try:
        commit = read_commit(d)
    except PoolCorruptError as exc:
        raise RecoveryError(str(exc.message)) from None
    if (d / RUNNING_MARKER).exists():
        raise RecoveryError(
            f"{pool.path} was being trained with --checkpoint none and did not finish: rows changed in "
            f"place after step {commit['step'] if commit else 0} cannot be rolled back",
            hint="start over with `dlrm-cxl train --fresh`, or restore the pool from a copy")
    if commit is None:
        sealed = sorted(s.step for s in scan_slots(d / "undo") if s.state == "sealed")
        if sealed:
            # Step 0 is committed before any step runs, so logged steps without a commit record
            # mean the record was lost: their rows cannot be brought back to a known state.
            raise RecoveryError(f"commit record {d / 'COMMIT'} is missing, but the undo log holds steps "
                                f"{sealed}: the commit record was lost")
        return None, None, []
    if target is not None and target > commit["step"]:
        raise RecoveryError(f"cannot recover to step {target}: this pool committed only step {commit['step']}")
    if target is not None and target < commit["step"]:
        # Several ranks: this rank is ahead of the newest step every rank committed. Roll back
        # to it: its dense snapshot and every undo record after it were kept for exactly this.
        name = f"dense-{target:012d}.pt"
        try:
            dense = read_dense(d / name)
        except PoolCorruptError as exc:
            raise RecoveryError(f"{exc.message} (needed to roll back to step {target})") from None
        commit = {"step": target, "dense_file": name, "dense_crc32": None, "rewrite_from": commit["step"]}
    else:
        try:
            dense = read_dense(d / commit["dense_file"], commit["dense_crc32"])
        except PoolCorruptError as exc:
            raise RecoveryError(f"{exc.message} (named by COMMIT, step {commit['step']})") from None
    slots = scan_slots(d / "undo")
    bad = [s for s in slots if s.state == "damaged"]
    if bad:
        raise RecoveryError(f"undo log damaged: {bad[0].problem}")
    todo = []
    for s in sorted((s for s in slots if s.state == "sealed" and s.step > commit["step"]),
                    key=lambda s: s.step, reverse=True):
        try:
            records = read_slot(s)
        except PoolCorruptError as exc:
            raise RecoveryError(exc.message) from None
        for r in records:
            if r.table not in pool:
                raise RecoveryError(f"undo log of step {s.step} names unknown table {r.table!r}")
            t = pool.table(r.table)
            if r.before.shape[1] != t.config.row_bytes or (
                    r.ids.numel() and (int(r.ids.max()) >= t.num_embeddings or int(r.ids.min()) < 0)):
                raise RecoveryError(f"undo log of step {s.step}: record for {r.table!r} does not fit the table")
        todo.append((s, records))
    if "rewrite_from" in commit:
        have = {s.step for s, _ in todo}
        missing = [k for k in range(commit["step"] + 1, commit["rewrite_from"] + 1) if k not in have]
        if missing:
            raise RecoveryError(f"cannot roll back to step {commit['step']}: undo records of committed "
                                f"steps {missing[:5]} are gone")
    return commit, dense, todo


def recover(path, *, dry_run: bool = False, digest: bool = True, crash_phase: str | None = None,
            pool: MemoryPool | None = None, target_step: int | None = None, rank_of_job: bool = False):
    """Recover the pool at ``path`` (see the module docstring). Returns what it found and did.

    ``pool``: an already open writable pool to use instead of opening ``path``.
    ``target_step``: roll back to this committed step instead of the newest (several ranks:
    the newest step that every rank committed).

    ``path`` may be a job of several ranks (``DIR/job.json``): every rank is brought to the
    newest step all ranks committed (a JobRecoveryReport). A single rank of a job is only
    recovered as part of it (``rank_of_job=True``, which the job and the trainer pass).
    """
    from .job import JOB_FILE, is_job, recover_job

    if pool is None and is_job(path):
        return recover_job(path, dry_run=dry_run, digest=digest)
    if not rank_of_job and (Path(path).parent / JOB_FILE).exists() and Path(path).name.startswith("rank-"):
        raise RecoveryError(f"{path} is one rank of the job at {Path(path).parent}: recovering it alone could "
                            f"leave it at another step than the other ranks",
                            hint=f"recover the whole job: dlrm-cxl recover --pool {Path(path).parent}")
    t0 = time.perf_counter()
    own = pool is None
    if own:
        pool = MemoryPool.open(path, read_only=dry_run)
    try:
        commit, dense, todo = _load_verified(pool, target_step)
        rep = RecoveryReport(str(path), commit["step"] if commit else None, bool(todo), dry_run)
        if commit is None:
            rep.actions.append("no commit record: the pool holds no training state; nothing to do")
        for s, records in todo:
            n = sum(r.ids.numel() for r in records)
            rep.rolled_back_steps.append(s.step)
            rep.rows_restored += n
            rep.actions.append(f"{'would roll' if dry_run else 'rolled'} back step {s.step}: "
                               f"{n} rows in {len(records)} tables")
        if not dry_run and todo:
            restored: dict[str, list[torch.Tensor]] = {}
            for i, (s, records) in enumerate(todo):  # newest first
                for r in records:
                    t = pool.table(r.table)
                    t._region.restore_rows(r.ids, r.before)
                    restored.setdefault(r.table, []).append(r.ids)
                if crash_phase == "mid-rollback" and i == 0:
                    die("recovery mid-rollback")
            for name in restored:
                # Every row this process changed is a restored row: persisting the table's dirty
                # rows persists exactly them, with page-coalesced writes (not one per row).
                pool.table(name).persist()
            if crash_phase == "before-invalidate":
                die("recovery before-invalidate")
        if not dry_run and commit is not None and "rewrite_from" in commit:
            # The rows are at the target now; say so durably *before* dropping the records of
            # the later steps (the other order would leave a COMMIT that no records can reach).
            name = commit["dense_file"]
            raw = (ckpt_dir(pool.storage_dir) / name).read_bytes()
            write_commit(ckpt_dir(pool.storage_dir), commit["step"], name, DENSE.unpack_from(raw)[3])
            rep.actions.append(f"rolled back committed steps {commit['step'] + 1}..{commit['rewrite_from']} "
                               f"to match the other ranks")
        if not dry_run and todo:
            for s, _ in todo:
                invalidate_slot(s.path)
        if not dry_run:
            d = ckpt_dir(pool.storage_dir)
            for p in d.glob(".*.tmp"):
                p.unlink()
                rep.actions.append(f"removed unfinished {p.name}")
            for p in d.glob("dense-*.pt"):
                if commit and p.name != commit["dense_file"]:
                    p.unlink()
        rep.seconds = time.perf_counter() - t0
        if digest and commit is not None:
            rep.state_digest = state_digest(pool, dense) if not dry_run or not todo else None
        return rep
    finally:
        if own:
            pool.close()
