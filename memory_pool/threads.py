"""Torch settings of the pool's and the trainer's background threads."""

from __future__ import annotations

import threading

import torch

__all__ = ["one_intra_op_thread"]

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
