"""Torch settings of the pool's and the trainer's background threads."""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

__all__ = ["one_intra_op_thread", "intra_op_threads", "lower_priority", "InOrder"]

_lock = threading.Lock()


def one_intra_op_thread() -> None:
    """The calling (background) thread runs its torch ops on itself alone.

    Each thread that starts a parallel torch op gets its own OpenMP team. Once a process holds
    more OpenMP threads than cores, libgomp lets an idle worker spin only ~100 times (300,000
    otherwise) before it sleeps, and the trainer's parallel ops then mostly start by waking one:
    a single background team (the prefetch thread's id checks and sorts, the journal writer's
    gathers, the compactor's scatters) made the whole step ~10 % slower on this 2-core machine.
    ``torch.set_num_threads`` sets the calling thread's count, and also the default that a
    thread adopts at its first torch op; the default is put back (by a short-lived thread:
    setting it is what sets it), so a thread started later, or a main thread that has not run a
    torch op yet, keeps the count it would have had."""
    with _lock:
        default = torch.get_num_threads()  # (a new thread's first call adopts the default)
        torch.set_num_threads(1)
        reset = threading.Thread(target=torch.set_num_threads, args=(default,), name="dlrm-cxl-thread-default")
        reset.start()
        reset.join()


def lower_priority(nice: int) -> int:
    """The calling thread's nice value raised to at least ``nice`` (at most 19; 0: left alone);
    returns the thread's nice value now. Linux keeps a nice value per thread: the other threads
    of the process keep theirs. A value is never lowered back (that needs a privilege). Where the
    system refuses (not Linux), nothing changes."""
    want = min(nice, 19)
    try:
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        if want > now:
            os.setpriority(os.PRIO_PROCESS, tid, want)
            now = want
        return now
    except (AttributeError, OSError):
        return 0


@contextlib.contextmanager
def intra_op_threads(n: int):
    """The calling thread's torch ops run on ``n`` threads inside the block (its own count is
    put back after it; 0.2 us a switch).

    For short, memory-bound work done on the trainer's thread between the step's ops (the
    inline journal writer's gathers and copies, ``checkpointing.undo``): measured on this 2-core
    machine, gathering a step's 8.6k first-touched rows of `small` took 1.45 ms as a parallel
    op of two threads and 0.64 ms on one. A two-thread team waits at its barrier for a member
    that another thread of the process (the prefetch thread) has preempted, and the other
    member spins meanwhile; one thread copies at about the same memory bandwidth alone."""
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class InOrder:
    """``fn(*args)`` for each call fed, in the order fed, on one background thread, while the
    feeder makes the next one: a hash or checksum over a stream of large pieces (hashlib and
    zlib let go of the GIL for them) beside the reads that make the pieces. At most one call
    waits, so at most two pieces are alive. ``drain()`` waits for every call fed and raises the
    first one's exception. A context manager: leaving it drains (unless an exception is
    already on its way) and ends the thread."""

    def __init__(self, name: str):
        self._ex = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._last: Future | None = None

    def feed(self, fn: Callable, *args) -> None:
        self.drain()
        self._last = self._ex.submit(fn, *args)

    def drain(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            last.result()

    def __enter__(self) -> "InOrder":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                self.drain()
        finally:
            self._ex.shutdown(wait=True)
        return False
