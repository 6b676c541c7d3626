"""Training progress on stderr: a tqdm bar on a terminal, plain lines elsewhere.

A tqdm bar redraws itself with ``\\r``: in a log file (``train ... 2> train.log``, a CI job, a
torchrun rank's log) that leaves hundreds of updates on one line. :func:`progress_bar` gives the
bar only when its file is a terminal; otherwise a :class:`ProgressLines`, which writes one plain
line every ``interval`` seconds (10 by default) and nothing in between::

    step 1200/5000 (24%): loss 0.4512, 18,734 samples/s, 64 s elapsed, ~3 min left

Both take the calls the trainer makes (tqdm's): ``set_postfix(**values)``, ``update(n)``,
``close()``. ``DLRM_CXL_PROGRESS=bar`` in the environment gives the tqdm bar on any file (the
crash tools read its per-step counts from a pipe: tools/torture.py).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, TextIO

__all__ = ["ProgressLines", "progress_bar", "DEFAULT_INTERVAL"]

DEFAULT_INTERVAL = 10.0  # seconds between two lines off a terminal


def progress_bar(total: int, initial: int = 0, file: TextIO | None = None, interval: float = DEFAULT_INTERVAL):
    """A tqdm bar when ``file`` (default stderr) is a terminal, else :class:`ProgressLines`."""
    file = sys.stderr if file is None else file
    try:
        tty = file.isatty()
    except (AttributeError, ValueError):  # (a closed or unusual stream)
        tty = False
    if tty or os.environ.get("DLRM_CXL_PROGRESS") == "bar":
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, unit="step", file=file, dynamic_ncols=True)
    return ProgressLines(total, initial, file, interval)


class ProgressLines:
    """Progress as a plain line every ``interval`` seconds (for a file that is not a terminal).

    ``update(n)`` advances by ``n`` steps and writes a line when ``interval`` seconds have passed
    since the last one (or since the start); ``close()`` writes a last line if any was written
    and steps were made since (a run shorter than ``interval`` writes nothing). ``clock``: the
    time source (tests pass a fake one)."""

    def __init__(self, total: int, initial: int = 0, file: TextIO | None = None,
                 interval: float = DEFAULT_INTERVAL, clock: Callable[[], float] = time.monotonic):
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        self.total, self.n, self.start_n = total, initial, initial
        self.file = sys.stderr if file is None else file
        self.interval = interval
        self._clock = clock
        self._t0 = self._last = clock()
        self._printed_n: int | None = None
        self._postfix: dict = {}
        self.lines = 0  # lines written so far

    def set_postfix(self, **values) -> None:
        """Values shown at the end of the next line (``loss=...``, ``samples_s=...``)."""
        self._postfix = values

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self._clock()
        if now - self._last >= self.interval:
            self._write(now)

    def close(self) -> None:
        if self._printed_n is not None and self._printed_n != self.n:
            self._write(self._clock())

    def _write(self, now: float) -> None:
        self._last = now
        self._printed_n = self.n
        elapsed = now - self._t0
        done = self.n - self.start_n
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        parts = [f"{_label(k)} {v}" for k, v in self._postfix.items()]
        parts.append(f"{elapsed:.0f} s elapsed")
        if done > 0 and self.total and self.n < self.total:
            parts.append(f"~{_duration(elapsed / done * (self.total - self.n))} left")
        try:
            self.file.write(f"step {self.n}/{self.total}{pct}: {', '.join(parts)}\n")
            self.file.flush()
        except (OSError, ValueError):  # (stderr closed: progress is not worth an error)
            pass
        self.lines += 1


def _label(key: str) -> str:
    return {"samples_s": "samples/s"}.get(key, key)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
