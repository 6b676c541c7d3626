"""``--checkpoint none``: no undo log, a recovery point only at a clean end of the run (see
:class:`NoCheckpointer`). Beside the undo log (checkpointing/undo.py), with which it shares the
compaction threshold."""

from __future__ import annotations

from memory_pool import MemoryPool, atomic_write, fileio, fsync_dir

from .base import Checkpointer, CheckpointStats, Step
from .crash import CrashPlan
from .store import RUNNING_MARKER, DensePacker, ckpt_dir, commit_doc
from .policy import default_compact_bytes
from .undo import DenseStateFn

__all__ = ["NoCheckpointer"]


class NoCheckpointer(Checkpointer):
    """``--checkpoint none``: no undo log. The state is a recovery point only at a clean end.

    While it trains, a marker file says so; recovery of a pool with that marker refuses
    (rows changed in place cannot be rolled back), instead of silently resuming a mix.
    """

    name = "none"

    def __init__(self, pool: MemoryPool, dense_state: DenseStateFn, *, crash: CrashPlan | None = None, **_):
        self.pool = pool
        self.dense_state = dense_state
        self.crash = crash
        self.dir = ckpt_dir(pool.storage_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = CheckpointStats()
        self._marked = False
        self._cur: Step | None = None
        self._packer = DensePacker()
        self._touched: dict[str, tuple] = {}

    def hit(self, phase: str) -> None:
        if self.crash is not None and self._cur is not None:
            self.crash.hit(self._cur.k, phase)

    def begin_step(self, step):
        self._cur = Step(step)
        if not self._marked:
            atomic_write(self.dir / RUNNING_MARKER, f"{step}\n".encode())
            self._marked = True
        if self.crash is not None:
            self.crash.arm_random(step)

    @property
    def needs_touched(self) -> bool:
        # Only to mark rows dirty on a journaled tier, for the persist at the clean end.
        return self.pool.journaled

    # No log is written; the crash phases fire at the same points of the step as with undo.
    def log_before_image(self, touched):
        self.hit("before-log")
        for t, rows in touched:
            t.mark_dirty(rows)  # persisted at the clean end (journaled tiers)
        self.hit("mid-log")

    def persist(self):
        self.hit("after-log")

    def update(self, fn):
        fn()
        self.hit("after-update")

    def mark_updated(self) -> None:
        pass

    def commit(self, step, *, final=False, witness=None):
        self.stats.steps += 1
        for phase in ("mid-dense", "before-commit"):
            self.hit(phase)
        if final:
            self.checkpoint_now(step)
        self.hit("after-commit")
        self._cur = None

    def checkpoint_now(self, step: int) -> None:
        pool, j = self.pool, self.pool.journal
        pool.flush_caches()  # (a direct home's write-back DRAM cache: its dirty rows go home)
        if j is not None:
            t_bytes = 0
            taken = []
            try:
                txn = pool.begin(step)
                for name in pool.tables():
                    t = pool.table(name)
                    ids = t.take_dirty()
                    taken.append((t, ids))
                    if ids.numel() and pool.journaled:
                        t_bytes += txn.rows([(t, ids)])
                    elif ids.numel():
                        pool.persist_rows([(t, ids)])
                parts, d_bytes = self._packer.pack(self.dense_state(step))
                txn.dense(parts)
                info = txn.commit(commit_doc(step))
            except BaseException:
                for t, ids in taken:  # not durable (a full disk): dirty again, for the retry
                    t.mark_dirty(ids)
                raise
            if j.live_bytes >= default_compact_bytes(pool.journaled):
                # Bounded as the undo log's: what precedes this transaction (the recovery point,
                # kept) is written back and dropped. Without it every run of a journaled pool
                # added its changed rows to the journal, and every open replayed them all (27 s
                # for a `kaggle` pool after a few runs).
                j.rotate()
                pool.compact(info.first_seq, wait=True)
            self.stats.table_bytes_persisted += t_bytes
            self.stats.dense_bytes += d_bytes
        try:
            fileio.unlink(self.dir / RUNNING_MARKER)
            fsync_dir(self.dir)
        except FileNotFoundError:
            pass
        self._marked = False
        self.stats.checkpoints += 1
        self.stats.last_commit_step = step
