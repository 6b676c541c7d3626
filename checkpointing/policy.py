"""Checkpoint policy: when a recovery window closes, the journal's thresholds, when to compact.

The undo log (:mod:`checkpointing.undo`) only executes what this module decides.

**Recovery windows.** Training is deterministic (every RNG, the data position and every row
are in the state digest), so the state at step k follows from the state at an earlier step s
and the batches in between. A window of W steps makes the full state durable once, at its start
s (the dense state; the rows each once: before-images at their first touch on direct tiers,
after-images at the window's end on journaled ones), and every step inside it writes only a
small commit record (its step, data position and the exact bits of its loss): the replay's
witness. Recovery restores s and re-runs s+1..k, checking each loss against its record. W = 1
is a full recovery point every step.

W is fixed (``--window W``) or chosen from a **recovery-time budget** (``--recovery-budget``
seconds, default 1.0): the steps whose replay fits in the budget at the measured step time,
after the fixed part of a recovery (opening the pool, restoring the window start, building the
model), re-measured at every window's end. With several ranks each window's length is the
smallest any rank chose (every rank closes its windows at the same steps).
"""

from __future__ import annotations

from dataclasses import dataclass

from memory_pool import env_mib

__all__ = ["WindowConfig", "WindowPolicy", "default_compact_bytes", "default_apply_bytes", "DEFAULT_RECOVERY_BUDGET"]

DEFAULT_RECOVERY_BUDGET = 1.0   # seconds
MAX_WINDOW = 64                 # steps: past it the bytes saved per step are small (BRIEF: 0.34 at 32)
# The fixed part of a recovery, before any step is replayed, measured through `dlrm-cxl recover`
# on `small` after a SIGKILL (open the pool and its journal, restore the window start, build the
# model and the data source; imports excluded): 0.2-0.3 s here. As a share of the budget, so
# that a smaller budget still leaves room for a step.
FIXED_SHARE = 0.35
# A replayed step costs more than a step in steady state: the first ones fault in pages and
# warm fbgemm's caches (measured: the first step after an open took 1.3-1.6x).
REPLAY_FACTOR = 1.3


@dataclass(frozen=True)
class WindowConfig:
    """How recovery windows are chosen. ``window``: a fixed length in steps (1: a recovery
    point every step); None: chosen from ``recovery_budget`` (seconds)."""

    window: int | None = None
    recovery_budget: float = DEFAULT_RECOVERY_BUDGET
    max_window: int = MAX_WINDOW

    def __post_init__(self):
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")
        if not self.recovery_budget > 0:
            raise ValueError(f"recovery_budget must be > 0 seconds, got {self.recovery_budget!r}")
        if self.max_window < 1:
            raise ValueError(f"max_window must be >= 1, got {self.max_window!r}")

    def describe(self) -> str:
        return f"window {self.window}" if self.window is not None else \
            f"recovery budget {self.recovery_budget:g} s"


class WindowPolicy:
    """The current window's length and when it ends. ``coordinator`` (several ranks): has
    ``global_min(int) -> int``; the length of each window is the smallest any rank chose."""

    def __init__(self, cfg: WindowConfig, *, coordinator=None):
        self.cfg = cfg
        self.coordinator = coordinator
        self.step_seconds: float | None = None   # moving average of a step's time
        # The first window is one step when the budget decides: no step time is known yet.
        self.length = cfg.window if cfg.window is not None else 1

    def observe(self, seconds: float) -> None:
        """A step took ``seconds`` (wall time, the trainer's view)."""
        if seconds <= 0:
            return
        s = self.step_seconds
        self.step_seconds = seconds if s is None else 0.8 * s + 0.2 * seconds

    def ends(self, step: int, start: int) -> bool:
        """Whether ``step`` closes the window that began after recovery point ``start``."""
        return step - start >= self.length

    def next_window(self) -> int:
        """Choose the next window's length (at a window's end; a collective with several ranks)."""
        w = self.cfg.window
        if w is None:
            w = self.from_budget()
            if self.coordinator is not None:  # (a fixed window is the same on every rank already)
                w = self.coordinator.global_min(w)
        self.length = max(1, w)
        return self.length

    def from_budget(self) -> int:
        if self.step_seconds is None:
            return 1
        left = self.cfg.recovery_budget * (1 - FIXED_SHARE)
        return max(1, min(self.cfg.max_window, int(left / (self.step_seconds * REPLAY_FACTOR))))

    def crash_cost(self, steps_since_start: int) -> tuple[int, float | None]:
        """(steps a crash now would replay, their estimated seconds)."""
        n = max(steps_since_start, 0)
        return n, (None if self.step_seconds is None else n * self.step_seconds * REPLAY_FACTOR)

    def describe(self) -> str:
        cost = f"; a crash replays at most {max(self.length - 1, 0)} steps" if self.length > 1 else ""
        est = f" (~{self.length * self.step_seconds * REPLAY_FACTOR:.2f} s)" if self.step_seconds and self.length > 1 else ""
        return f"{self.cfg.describe()}: window {self.length}{cost}{est}"


def default_compact_bytes(journaled: bool) -> int:
    """Journal size that triggers a compaction. Journaled tiers: large enough that the write-back
    of scattered rows (page-granular in the image) is amortised over many steps, small enough
    that replaying it at open stays around a second. Direct tiers hold only undo records and
    dense states (in RAM on shm): small. ``DLRM_CXL_COMPACT_MB`` overrides."""
    env = env_mib("DLRM_CXL_COMPACT_MB")
    if env is not None:
        return env
    if not journaled:
        return 128 << 20
    # Measured on `small` (tools/bench_cli.py, 300 steps, 8.1 MB durable per step): compacting
    # every 256 MiB wrote 7.3 MB of image pages per step (write amplification 1.9); every 1 GiB
    # amortises the page-granular write-back of the rows over ~125 steps (WA ~1.2). Replay at open
    # reads at most this much journal (about half of it rows).
    return 1 << 30


def default_apply_bytes(compact_bytes: int, table_bytes: int) -> int | None:
    """Sealed journal bytes written back into the images' page cache at a time, between
    compactions (journaled tiers; see ``MemoryPool.apply``): with the segment being written, what
    a crash of the trainer leaves to replay. A quarter of a compaction: on `kaggle` that bounds
    the replay to ~0.3 GiB of journal (0.5-0.8 s to recover, against 1.2 s for 1 GiB). Fewer,
    larger passes cost less: each pass copies every row version it holds (no coalescing across
    passes) and faults in the pages it touches (`kaggle`: WA 2.85 -> 3.06 with passes every
    256 MiB, the write-back debt counted).

    None (no pass between compactions) when the tables are no larger than twice the compaction
    threshold: a replay then faults in at most every page of the tables (`small`: 650 MB, 160k
    pages, ~0.3 s), whatever the journal holds, and passes would only cost CPU (measured on
    `small`: pmem undo 0.90x -> 0.78x of none with passes every 256 MiB). ``DLRM_CXL_APPLY_MB``
    overrides."""
    env = env_mib("DLRM_CXL_APPLY_MB")
    if env is not None:
        return env
    if table_bytes <= 2 * compact_bytes:
        return None
    return max(1, compact_bytes // 4)
