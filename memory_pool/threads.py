"""Torch settings of the pool's and the trainer's background threads."""

from __future__ import annotations

import threading

import torch

__all__ = ["one_intra_op_thread"]

_lock = threading.Lock()


def one_intra_op_thread() -> None:
    """The calling (background) thread runs its torch ops on itself alone.

    Each thread that starts a parallel torch op gets its own OpenMP team, whose workers spin
    between ops: a background thread's team (the journal writer's gathers, the prefetch thread's
    sorts, the compactor's scatters) takes the two cores of this machine from the trainer's own
    team while its GEMMs run. ``torch.set_num_threads`` sets the calling thread's count, and
    also the default that a thread adopts at its first torch op; the default is put back (by a
    short-lived thread: setting it is what sets it), so a thread started later, or a main thread
    that has not run a torch op yet, keeps the count it would have had."""
    with _lock:
        default = torch.get_num_threads()  # (a new thread's first call adopts the default)
        torch.set_num_threads(1)
        reset = threading.Thread(target=torch.set_num_threads, args=(default,), name="dlrm-cxl-thread-default")
        reset.start()
        reset.join()
