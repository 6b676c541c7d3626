"""Recovery: bring a pool back to its newest recovery point after a crash.

The pool's journal (``memory_pool.journal``) holds the checkpointer's transactions; the newest
committed one names the recovery point ``C`` and holds its dense state. Opening a pool already
replays the rows of every committed transaction on a journaled tier (emulated pmem, power-sim),
so there the rows are at ``C`` before recovery starts; what recovery does:

1. Verify everything it will use first, change nothing: the dense state of the target step and
   every ``UNDO`` record it will apply (checksums, table names, row ranges), and that no record
   of the unfinished tail is damaged where it matters (direct tiers: :func:`tail_damage`, by the
   steps' logged marks). Any damage raises :class:`RecoveryError` (exit 4) and the pool is left
   as it was.
2. Apply the ``UNDO`` records of every step after the target, newest first (direct tiers: the
   unfinished steps changed rows in place; with several ranks, also committed steps after the
   step every rank committed). Persist the restored rows where that means something.
3. Drop the unfinished tail of the journal (durably), and, when the target is older than the
   newest commit, append a transaction that makes the target the newest recovery point again.

Idempotent: a crash anywhere in 2-3 leaves records that, applied again, give the same rows (they
are absolute before-images, and the target state is their fixed point). Time is proportional to
the rolled-back rows, not to the model.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from memory_pool import (MemoryPool, PoolCorruptError, PoolFormatError, RecoveryError, decode_logged_mark,
                         decode_row_set, fileio, record_kind, undo_group_of)

from .crash import CrashPlan
from .digest import state_digest
from .jobdir import is_job, job_of_rank
from .store import RUNNING_MARKER, ckpt_dir, commit_doc, is_commit, unpack_dense

__all__ = ["recover", "RecoveryReport", "checkpoint_status", "committed_state", "recover_pool", "tail_damage",
           "replay_witnesses", "WITNESS_KEYS"]

# What a step's commit record holds for its replay (checkpointing.undo): the loss's exact bits and
# the data position of its batch.
WITNESS_KEYS = ("loss", "position")


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
    # Recovery windows: the committed steps after the recovery point restored (``committed_step``,
    # the window's start) that a replay re-runs (dlrm_cxl.replay), how many it re-ran, where it
    # stopped and why (None: it reached them all), and its time.
    replay_steps: list[int] = field(default_factory=list)
    replayed: int = 0
    replay_stopped: str | None = None
    replay_seconds: float = 0.0
    restored_step: int | None = None   # the recovery point restored (the window's start)

    def as_dict(self) -> dict:
        return asdict(self)


def _commits(pool: MemoryPool):
    return [t for t in pool.journal.txns if is_commit(t)] if pool.journal is not None else []


def committed_state(pool: MemoryPool, step: int | None = None) -> tuple[int | None, dict | None]:
    """(step, dense state) of the newest recovery point (or of ``step``); (None, None) if none.
    Raises RecoveryError when the dense state is damaged."""
    commits = _commits(pool)
    if step is not None:
        commits = [t for t in commits if t.tag == step]
    if not commits:
        return None, None
    txn = commits[-1]
    dense = [r for r in txn.records if record_kind(r) == "dense"]
    if not dense:
        raise RecoveryError(f"the commit of step {txn.tag} holds no dense state")
    try:
        return txn.tag, unpack_dense(pool.journal.read(dense[-1]))
    except PoolCorruptError as exc:
        raise RecoveryError(f"{exc.message} (dense state of step {txn.tag})") from None


def _witness(doc: dict) -> dict | None:
    if not isinstance(doc, dict) or "loss" not in doc:
        return None
    return {k: doc.get(k) for k in WITNESS_KEYS}


def _witnesses_after(pool: MemoryPool, txn) -> dict[int, dict]:
    """``{step: witness}`` of the committed steps after the recovery point ``txn``: those its own
    commit record carries (a replay that had not finished) and those of the transactions after
    it (each step's commit record), the newer winning."""
    out: dict[int, dict] = {}
    for k, w in txn.doc.get("replay") or []:
        if isinstance(k, int) and k > txn.tag and isinstance(w, dict):
            out[k] = w
    for t in pool.journal.txns:
        if t.end.seq > txn.end.seq and t.tag > txn.tag and (w := _witness(t.doc)) is not None:
            out[t.tag] = w
    return out


def replay_witnesses(pool: MemoryPool) -> dict[int, dict]:
    """``{step: {"loss": bits, "position": ...}}``: the committed steps after the pool's newest
    recovery point, which a replay re-runs and checks (recovery windows: checkpointing.policy).
    Empty when the pool is at its newest committed step."""
    commits = _commits(pool)
    return _witnesses_after(pool, commits[-1]) if commits else {}


def _span(steps: list[int]) -> str:
    steps = sorted(steps)
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])


def tail_damage(j) -> str | None:
    """Direct tiers: what is damaged in the journal's unfinished tail (after the newest END), as
    a message, or None when it is at most torn.

    The checkpointer's logged mark (``LOGGED``, checkpointing.undo) says which side of a step's
    write-ahead barrier a crash came: it is durable after the step's ``UNDO`` records and before
    any row of the step changes. So:

    * a valid mark vouches for the ``UNDO`` records right before it (its undo group): each must
      be in the valid tail. A bad one was durable when the rows it covers began to change:
      **damage**. Applying the others and dropping it would leave those rows changed and say
      the pool is consistent (the defect this fixes);
    * a bad record followed only by valid ``UNDO`` records of one undo group that began at or
      before it (no mark, no record of a later step) lies before its step's mark, which never
      became durable: the step never changed a row, and the tail is **torn** (dropped). The
      valid records before the bad one are applied all the same: at worst they put back what is
      there;
    * a bad record followed by nothing valid is torn, as it always was (a bad mark among them:
      its step's ``UNDO`` records are all whole, and applied);
    * anything else after a bad record (the old rule; what a writer without marks, whose records
      carry no undo group, always gets): damage.
    """
    held = {r.seq: r for r in j.tail}
    for m in j.tail:
        if record_kind(m) != "logged":
            continue
        try:
            first, n = decode_logged_mark(j.read(m))
        except (PoolCorruptError, ValueError) as exc:
            return f"undo log damaged: the logged mark of step {m.tag} (journal record {m.seq}): {exc}"
        undo = [held.get(s) for s in range(first, first + n)]
        if m.seq != first + n or any(r is None or record_kind(r) != "undo" or r.tag != m.tag for r in undo):
            return (f"undo log damaged: the logged mark of step {m.tag} (journal record {m.seq}) vouches for "
                    f"undo records {first}..{first + n - 1}, which the journal does not hold")
    if not j.tail_damage:
        return None  # no bad record with records after it: torn at most
    marks = [r for r in j.tail_beyond if record_kind(r) == "logged"]
    if marks:
        return (f"undo log damaged: {j.tail_damage}; it lies before the logged mark of step {marks[0].tag} "
                f"(journal record {marks[0].seq}): that step's rows had begun to change, and its undo records "
                f"are what restores them")
    # (the sequence number of the first record that is not in the valid tail: the bad one)
    bad = j.tail[-1].seq + 1 if j.tail else (j.last.end.seq + 1 if j.last is not None else j.start_seq)
    groups = set()
    for r in j.tail_beyond:
        try:
            groups.add(undo_group_of(j.read(r)) if record_kind(r) == "undo" else None)
        except PoolCorruptError:
            groups.add(None)
    if len(groups) == 1 and None not in groups and min(groups) <= bad:
        return None  # before its step's logged mark: the step never changed a row
    return f"undo log damaged: {j.tail_damage}"


def checkpoint_status(pool: MemoryPool) -> dict:
    """What the journal says, without changing anything (for ``inspect``)."""
    j = pool.journal
    commits = _commits(pool)
    c = commits[-1].tag if commits else None
    # (direct tiers: with the records past a bad one, whose step recovery rolls back too)
    tail_steps = sorted({r.tag for r in j.tail + ([] if pool.journaled else j.tail_beyond) if r.tag >= 0}) \
        if j is not None else []
    damage = tail_damage(j) if j is not None and not pool.journaled else None
    damaged = [damage] if damage else []
    marker = (ckpt_dir(pool.storage_dir) / RUNNING_MARKER).exists()
    # Journaled tiers: the rows of unfinished steps never reached durable media; opening the
    # pool already shows the newest commit, so readers need no recovery (the next writer drops
    # the unfinished records). Direct tiers: those steps changed rows in place.
    undo_in_tail = any(record_kind(r) == "undo" for r in j.tail) if j is not None else False
    # Recovery windows: steps committed after the recovery point (their records are the replay's
    # witnesses; on a direct tier their rows changed in place since it).
    later = [t for t in j.txns if commits and t.end.seq > commits[-1].end.seq] if j is not None else []
    replay = sorted(replay_witnesses(pool)) if j is not None else []
    return {
        "committed_step": c,
        "replay_steps": replay,
        "newest_step": replay[-1] if replay else c,
        "journal_bytes": j.live_bytes if j is not None else 0,
        "steps_to_roll_back": tail_steps,
        "torn_bytes": j.torn_bytes if j is not None else 0,
        "damaged": damaged,
        "trained_without_undo": marker,
        # (records after the recovery point: rolled back, or kept only as the witnesses of a
        # replay, by recovery; a replay left to do alone changes nothing of the state on media)
        "needs_recovery": bool((undo_in_tail and not pool.journaled) or damaged or marker or later),
        "needs_replay": bool(replay),
    }


def _plan(pool: MemoryPool, target: int | None):
    """Verify; return (target txn, dense state, undo records newest first, steps rolled back)."""
    j = pool.journal
    if (ckpt_dir(pool.storage_dir) / RUNNING_MARKER).exists():
        commits = _commits(pool)
        raise RecoveryError(
            f"{pool.path} was being trained with --checkpoint none and did not finish: rows changed in "
            f"place after step {commits[-1].tag if commits else 0} cannot be rolled back",
            hint="start over with `dlrm-cxl train --fresh`, or restore the pool from a copy")
    commits = _commits(pool)
    if not commits:
        if any(record_kind(r) == "undo" for r in j.tail):
            # Step 0 is committed before any step runs, so logged steps without a commit mean
            # the commit was lost: their rows cannot be brought back to a known state.
            raise RecoveryError(f"{pool.path}: the journal holds undo records of steps "
                                f"{sorted({r.tag for r in j.tail})} but no commit: the commit record was lost")
        return None, None, [], []
    newest = commits[-1]
    if target is None or target == newest.tag:
        txn = newest
    else:
        if target > newest.tag:
            raise RecoveryError(f"cannot roll forward to step {target}: the newest commit is step {newest.tag}")
        older = [t for t in commits if t.tag == target]
        if not older:
            raise RecoveryError(f"cannot roll back to step {target}: its records are gone "
                                f"(the journal keeps commits {[t.tag for t in commits[-5:]]})")
        txn = older[-1]
    if not pool.journaled and (damage := tail_damage(j)):
        raise RecoveryError(damage)
    _, dense = committed_state(pool, txn.tag)
    later = [t for t in j.txns if t.end.seq > txn.end.seq]
    refs = [r for t in later for r in t.records] + list(j.tail)
    undo = [r for r in refs if record_kind(r) == "undo"]
    # (direct tiers: with the records past a torn spot before a step's logged mark, which are
    # dropped with it: that step is rolled back too, its rows never having changed)
    dropped = [] if pool.journaled else j.tail_beyond
    steps = sorted({r.tag for r in refs + dropped if r.tag > txn.tag} | {t.tag for t in later if is_commit(t)},
                   reverse=True)
    undo_plan = []
    for ref in reversed(undo):  # newest first
        try:
            parts = decode_row_set(j.read(ref))
        except (PoolCorruptError, ValueError) as exc:
            raise RecoveryError(f"undo record of step {ref.tag}: {exc}") from None
        for name, ids, raw in reversed(parts):  # (a row set's tables are disjoint: any order)
            if name not in pool:
                raise RecoveryError(f"undo record of step {ref.tag} names unknown table {name!r}")
            t = pool.table(name)
            if raw.shape[1] != t.config.row_bytes or (ids.numel() and (int(ids.max()) >= t.num_embeddings
                                                                         or int(ids.min()) < 0)):
                raise RecoveryError(f"undo record of step {ref.tag}: record for {name!r} does not fit the table")
            undo_plan.append((ref.tag, t, ids, raw))
    if target is not None and target < newest.tag and pool.journaled and not any(
            record_kind(r) == "undo" for t in later for r in t.records):
        raise RecoveryError(f"cannot roll back committed steps after {target}: no undo records were kept")
    return txn, dense, undo_plan, steps


def recover_pool(pool: MemoryPool, *, dry_run: bool = False, digest: bool = True, crash_phase: str | None = None,
                 target_step: int | None = None, no_replay: bool = False) -> RecoveryReport:
    """Recover an open pool (writable unless ``dry_run``). See the module docstring.

    ``crash_phase``: kill the process at that moment of recovery (one of
    :data:`checkpointing.crash.RECOVERY_PHASES`; for tests)."""
    crash = CrashPlan.recovery(crash_phase) if crash_phase else None
    t0 = time.perf_counter()
    txn, dense, undo_plan, steps = _plan(pool, target_step)
    rep = RecoveryReport(str(pool.path), txn.tag if txn else None, bool(steps or pool.journal.tail), dry_run)
    rep.restored_step = rep.committed_step
    if txn is not None:
        rep.replay_steps = sorted(_witnesses_after(pool, txn))
    if txn is None:
        rep.actions.append("no commit record: the pool holds no training state; nothing to do")
    if pool.journal.tail_damage and not pool.journaled:  # (and not damage: _plan said so)
        rep.actions.append(f"{pool.journal.tail_damage}: before its step's logged mark (the step changed no row), "
                           f"{'would be' if dry_run else 'is'} dropped as a torn tail")
    rep.rolled_back_steps = steps
    rep.rows_restored = sum(ids.numel() for _, _, ids, _ in undo_plan)
    for k in steps:
        n = sum(ids.numel() for tag, _, ids, _ in undo_plan if tag == k)
        rep.actions.append(f"{'would roll' if dry_run else 'rolled'} back step {k}: {n} rows restored"
                           + ("" if n or not pool.journaled else " (its rows never reached durable media)"))
    if not dry_run:
        restored: dict[str, tuple] = {}
        for i, (tag, t, ids, raw) in enumerate(undo_plan):
            t.restore_raw(ids, raw)
            restored.setdefault(t.name, (t, []))[1].append(ids)
            if crash is not None and i == 0:
                crash.hit_recovery("mid-rollback")
        pairs = [(t, torch.unique(torch.cat(ids))) for t, ids in restored.values()]
        if pool.real_pmem:
            pool.persist_rows(pairs)
        if crash is not None:
            crash.hit_recovery("before-invalidate")
        # The rows are at the target now (in place on direct tiers); the unfinished records
        # must go before anything new is appended, or a later END would seal them.
        j = pool.journal
        # (nothing after the newest END: the journal is left as it is -- a direct-written
        # segment's block padding after it is no record, and a second recovery changes nothing)
        dropped = j.truncate_tail() if (j.tail or j.torn_bytes or j.tail_beyond or j.tail_damage) else 0
        if dropped:
            rep.actions.append(f"dropped {dropped} bytes of unfinished journal records")
        witnesses = _witnesses_after(pool, txn) if txn is not None else {}
        was_newest = txn is not None and txn is _commits(pool)[-1]
        after = txn is not None and any(t.end.seq > txn.end.seq for t in pool.journal.txns)
        if txn is not None and (not was_newest or after or (witnesses and no_replay)):
            # Make the target the newest recovery point again, its journal records after it now
            # history: the restored rows (journaled tiers, several ranks: they exist durably only
            # through the journal), a copy of the target's dense state, and a commit record that
            # carries the witnesses of the committed steps after it (recovery windows), for the
            # replay that re-runs them (dlrm_cxl.replay): a crash during the replay loses none.
            rec = pool.begin(txn.tag)
            if pool.journaled:
                for t, ids in pairs:
                    rec.rows([(t, ids)])
            rec.dense([rec.dense_of(txn)])
            doc = commit_doc(txn.tag)
            if witnesses and not no_replay:
                doc["replay"] = [[k, w] for k, w in sorted(witnesses.items())]
            elif witnesses:
                rep.actions.append(f"dropped the records of committed steps {_span(list(witnesses))} (--no-replay): "
                                   f"the pool stays at step {txn.tag}")
            rec.commit(doc)
            if not was_newest:
                rep.actions.append(f"step {txn.tag} is the newest recovery point again")
        for p in ckpt_dir(pool.storage_dir).glob(".*.tmp"):
            fileio.unlink(p)
            rep.actions.append(f"removed unfinished {p.name}")
    rep.seconds = time.perf_counter() - t0  # recovery itself; the digest below reads every row
    if digest and txn is not None:
        rep.state_digest = state_digest(pool, dense) if not dry_run or not undo_plan else None
    return rep


def recover(path, *, dry_run: bool = False, digest: bool = True, crash_phase: str | None = None,
            pool: MemoryPool | None = None, target_step: int | None = None,
            rank_of_job: bool = False, no_replay: bool = False) -> RecoveryReport:
    """Recover the one pool at ``path`` (see the module docstring). Returns what it found and did.

    ``pool``: an already open writable pool to use instead of opening ``path``.
    ``target_step``: roll back to this committed step instead of the newest (several ranks:
    the newest step that every rank committed).

    A job of several ranks (``DIR/job.json``) is not one pool: :func:`checkpointing.job.recover_path`
    recovers whatever a path holds (a pool or a job; ``dlrm-cxl recover`` uses it). A single rank
    of a job is only recovered as part of it (``rank_of_job=True``, which the job and the trainer's
    ranks pass); alone it is refused (RecoveryError).
    """
    job = job_of_rank(path)
    if not rank_of_job and job is not None:
        raise RecoveryError(f"{path} is one rank of the job at {job}: recovering it alone could "
                            f"leave it at another step than the other ranks",
                            hint=f"recover the whole job: dlrm-cxl recover --pool {job}")
    if pool is None and is_job(path):
        raise PoolFormatError(f"{path} is a job of several ranks, not one pool",
                              hint=f"recover the whole job: dlrm-cxl recover --pool {path} "
                                   f"(API: checkpointing.job.recover_path)")
    if pool is not None:
        return recover_pool(pool, dry_run=dry_run, digest=digest, crash_phase=crash_phase, target_step=target_step,
                            no_replay=no_replay)
    t0 = time.perf_counter()
    # On demand: recovery reads only the rows it rolls back (the trainer's own recovery does the
    # same); the digest, when asked for, applies the rest as it reads them.
    with MemoryPool.open(path, read_only=dry_run, replay="on-demand") as p:
        t_open = time.perf_counter() - t0
        rep = recover_pool(p, dry_run=dry_run, digest=digest, crash_phase=crash_phase, target_step=target_step,
                           no_replay=no_replay)
    rep.seconds += t_open  # including opening the pool (and its journal replay), not the digest
    return rep
