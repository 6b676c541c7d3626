"""Per-step training metrics: ``metrics.jsonl`` in the pool directory, and reading it back.

``dlrm-cxl train`` appends one JSON object per line to ``<pool>/metrics.jsonl`` (the ``--pool``
directory on every tier: an shm pool's directory holds it too, its tables live in /dev/shm; a
torchrun job's directory, written by rank 0):

* ``{"run": {"start_step": S, "steps": N, "time": ISO-8601, "pid": P, "batch_size": B, "tier": T}}``
  when a run starts (it trains steps S+1..N);
* ``{"step": k, "loss": L, "samples_per_s": X, "checkpoint_ms": C, "time": UNIX}`` after step k:
  its loss, its throughput (its batch over the time since the previous step was done: the wait
  for the batch and the step itself), and the milliseconds the checkpointer spent on the trainer's
  thread (the critical path) in that step;
* ``{"step": k, "eval": {"auc": A, "logloss": G, "samples": n, ...}}`` when ``--eval-every`` ran
  an evaluation after step k.

**No step twice.** A resumed run appends. A run after a crash trains again the steps after the
pool's newest recovery point, which the crashed run may have recorded already: when a run starts
at step S, the lines of steps after S (and the headers of runs that started at S or later) are
dropped first (the file is rewritten, tmp + rename; only when it holds such lines). A reader
(:func:`read_metrics`) also keeps the last line per step, so a file cut short by a crash (a
half-written last line is skipped) or edited by hand still reads as one value per step.

The lines are written unbuffered (one ``write`` each, ~10 µs a step) and never synced: a power
loss may take the last lines, a kill never does. A file that cannot be written (a full disk)
stops the recording with one warning; training goes on. :func:`open_metrics` is the trainer's
hook; :func:`read_metrics` the reader (``dlrm-cxl plot``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import NoMetricsError

__all__ = ["METRICS_FILE", "MetricsLog", "Metrics", "open_metrics", "read_metrics", "trim_metrics"]

METRICS_FILE = "metrics.jsonl"


def _step_of(line: bytes) -> tuple[str, int | None] | None:
    """("step"|"run", step or start step) of a line, None if it is not a valid record."""
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    if isinstance(doc.get("step"), int):
        return "step", doc["step"]
    if isinstance(doc.get("run"), dict) and isinstance(doc["run"].get("start_step"), int):
        return "run", doc["run"]["start_step"]
    return None


def trim_metrics(path: Path, start_step: int) -> int:
    """Drop from the metrics file ``path`` the lines a run starting at ``start_step`` records
    again: steps after it, headers of runs that started at it or later, and a last line that is
    not a valid record (torn by a crash). Returns the number of lines dropped (0: the file is
    left as it is).

    Only a tail is ever dropped: every run trims before it appends, so the lines before the
    last one it keeps are in order. So the file is read from its end and cut there
    (``truncate``), the lines before never parsed: O(lines dropped), not O(lines) -- the whole
    file parsed and rewritten cost every resume and every ``recover`` ~25 us a step trained,
    0.07 s at 2,800 steps and seconds for a long run. A bad line further up (not one this
    writes) stays; :func:`read_metrics` skips it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    cut, dropped = len(data), 0
    while cut > 0:
        start = data.rfind(b"\n", 0, cut - 1) + 1
        line = data[start:cut]
        rec = _step_of(line)
        if rec is not None and line.endswith(b"\n") and not (rec[0] == "step" and rec[1] > start_step) \
                and not (rec[0] == "run" and rec[1] >= start_step):
            break
        dropped += 1
        cut = start
    if dropped:
        os.truncate(path, cut)
    return dropped


class MetricsLog:
    """Appends a run's records to ``<directory>/metrics.jsonl`` (see the module docstring).

    ``start_step``: the step the run starts from (lines after it are dropped first);
    ``critical_seconds``: a function giving the checkpointer's cumulative critical-path seconds
    (``ckpt.stats.critical_seconds``), whose difference per step is its ``checkpoint_ms``;
    ``warn``: where the one warning of a failed write goes."""

    def __init__(self, directory, *, start_step: int, steps: int, batch_size: int, tier: str,
                 critical_seconds: Callable[[], float] | None = None, warn: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.path = Path(directory) / METRICS_FILE
        self.batch_size = batch_size
        self._critical = critical_seconds
        self._warn = warn or (lambda s: None)
        self._clock = clock
        self._fd: int | None = None
        try:
            trim_metrics(self.path, start_step)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            self._fail(exc)
        self._write({"run": {"start_step": start_step, "steps": steps, "batch_size": batch_size, "tier": tier,
                             "pid": os.getpid(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}})
        self._last = clock()
        self._crit = critical_seconds() if critical_seconds else 0.0

    def step(self, k: int, loss: float) -> None:
        """Step ``k`` is done with ``loss``: its line."""
        now = self._clock()
        rec = {"step": k, "loss": loss, "samples_per_s": self.batch_size / max(now - self._last, 1e-9),
               "time": round(time.time(), 3)}
        if self._critical is not None:
            crit = self._critical()
            rec["checkpoint_ms"] = 1e3 * (crit - self._crit)
            self._crit = crit
        self._last = now
        self._write(rec)

    def evaluation(self, k: int, result: dict) -> None:
        """An evaluation ran after step ``k``: its line (its time does not count in the next
        step's throughput)."""
        self._write({"step": k, "eval": {key: v for key, v in result.items() if key != "step"}})
        self._last = self._clock()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write(self, rec: dict) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, (json.dumps(rec, allow_nan=True) + "\n").encode())
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self._warn(f"warning: metrics are no longer recorded in {self.path}: {exc.strerror or exc} "
                   f"(training goes on)")
        self.close()


class _NoMetrics:
    """What a rank other than 0 records: nothing."""

    def step(self, k: int, loss: float) -> None:
        pass

    def evaluation(self, k: int, result: dict) -> None:
        pass

    def close(self) -> None:
        pass


def open_metrics(trainer):
    """The trainer loop's hook: a :class:`MetricsLog` in the ``--pool`` directory for a run of
    ``trainer`` (a :class:`~dlrm_cxl.trainer.Trainer` before its first step), or an object that
    records nothing (on a rank other than 0; a run with no step to train)."""
    dist, o = trainer.dist, trainer.o
    if (dist is not None and dist.rank != 0) or trainer.step >= o.steps:
        return _NoMetrics()
    return MetricsLog(o.pool, start_step=trainer.step, steps=o.steps, batch_size=trainer.cfg.batch_size,
                      tier=trainer.pool.tier, critical_seconds=lambda: trainer.ckpt.stats.critical_seconds,
                      warn=lambda s: print(s, file=sys.stderr, flush=True))


@dataclass
class Metrics:
    """A pool's metrics, one value per step (the last line of each): ``steps``/``loss``/
    ``samples_per_s``/``checkpoint_ms`` side by side (``checkpoint_ms`` None where not
    recorded), ``evals`` as ``(step, result)``, ``runs`` the run headers."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    checkpoint_ms: list[float | None] = field(default_factory=list)
    evals: list[tuple[int, dict]] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)


def read_metrics(pool) -> Metrics:
    """The metrics ``train`` recorded in ``pool`` (a pool or torchrun job directory).

    Raises NoMetricsError (exit 2) when it holds none: no ``metrics.jsonl`` (a pool trained
    before metrics were recorded, made by ``import``, or never trained) or no step in it."""
    path = Path(pool) / METRICS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise NoMetricsError(f"{pool} holds no training metrics (no {METRICS_FILE})") from None
    except IsADirectoryError:
        raise NoMetricsError(f"{path} is a directory, not the metrics file") from None
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    runs = []
    for line in data.splitlines():
        rec = _step_of(line)
        if rec is None:
            continue  # (a line cut short by a crash, or not ours)
        doc = json.loads(line)
        if rec[0] == "run":
            runs.append(doc["run"])
        elif isinstance(doc.get("eval"), dict):
            evals[rec[1]] = doc["eval"]
        elif isinstance(doc.get("loss"), (int, float)):
            steps[rec[1]] = doc
    if not steps:
        raise NoMetricsError(f"{path} records no training step")
    m = Metrics(evals=sorted(evals.items()), runs=runs)
    for k in sorted(steps):
        d = steps[k]
        m.steps.append(k)
        m.loss.append(float(d["loss"]))
        m.samples_per_s.append(float(d.get("samples_per_s") or 0.0))
        m.checkpoint_ms.append(d.get("checkpoint_ms"))
    return m
