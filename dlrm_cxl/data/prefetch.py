"""Background prefetching: :class:`Prefetcher` produces an iterator's next items in a thread."""

from __future__ import annotations

import queue
import threading
from typing import Iterable

from memory_pool.threads import lower_priority, one_intra_op_thread

from memory_pool.validation import env_int, is_int

_ITEM, _END, _ERR = 0, 1, 2
# The producing thread runs at this nice value (``$DLRM_CXL_PREFETCH_NICE`` overrides; 0: the
# process's). Why: on a machine whose cores the step's own threads keep busy (the trainer's and
# its OpenMP worker, here 2 of 2), the plans made beside the step -- a DRAM cache's admissions,
# ~10 ms a batch on `kaggle` -- took a core from the step's two-thread ops, whose other thread
# then waited at their barriers: a cached `kaggle` step's dense forward spent 5.5 ms a step
# off the CPU. At nice 19 it runs when a step's thread is not runnable (a GIL wait, a serial
# stretch), and the step's median time fell by ~3 ms (docs/tiering-measurements.md).
# It cannot starve the steps: a step waiting for its plan leaves a core to it.
NICE_ENV = "DLRM_CXL_PREFETCH_NICE"
DEFAULT_NICE = 19


def prefetch_nice() -> int:
    """The producing thread's nice value: ``$DLRM_CXL_PREFETCH_NICE`` (0-19; unset or empty:
    :data:`DEFAULT_NICE`). Raises InvalidConfigError for anything else (before a thread starts)."""
    nice = env_int(NICE_ENV, lo=0, hi=19, hint=f"unset {NICE_ENV} (the default is {DEFAULT_NICE}), or 0 to "
                                               f"leave the prefetch thread at the process's priority")
    return DEFAULT_NICE if nice is None else nice


class Prefetcher:
    """Produce the next items of an iterator in a background thread (queue depth ``depth``).

    Order and content are unchanged; an exception raised by the underlying iterator is re-raised
    by ``next()`` after the items produced before it. The Prefetcher owns the iterator: ``close()``
    (or leaving the ``with`` block) stops the thread and closes a generator.
    """

    def __init__(self, iterable: Iterable, depth: int = 2):
        if not is_int(depth, numpy=True) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        self._nice = prefetch_nice()
        self._it = iter(iterable)
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="dlrm-cxl-prefetch", daemon=True)
        self._thread.start()

    def _put(self, msg) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(msg, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        one_intra_op_thread()  # (its sorts and checks: off the trainer's cores' OpenMP team)
        lower_priority(self._nice)
        try:
            for item in self._it:
                if not self._put((_ITEM, item)):
                    return
            self._put((_END, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put((_ERR, e))
        finally:
            close = getattr(self._it, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    pass

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        kind, val = self._q.get()
        if kind == _ITEM:
            return val
        self._done = True
        self._thread.join()
        if kind == _ERR:
            raise val
        raise StopIteration

    def close(self) -> None:
        self._done = True
        self._stop.set()
        while self._thread.is_alive():
            try:
                while True:
                    self._q.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
