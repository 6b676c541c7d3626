"""How a pool makes rows durable on its journal, and keeps the journal short.

* :func:`persist_rows`: a journaled tier (emulated pmem, power-sim) appends the rows'
  after-images as ``ROWS`` records and commits them in one group commit; real pmem flushes the
  rows' cache lines; shm and dram have nothing to do (their stores are already where they
  survive).
* :func:`replay_plan` + :func:`replay_rows`: opening a journaled pool reads the ``ROWS`` of every
  complete transaction and writes the newest value of each row into the private working copy,
  straight from the journal (idempotent: the journal keeps them until a compaction has written
  them into the images).
* :func:`absorb_rows` + :class:`Compactor`: compaction writes them back into the table images,
  sorted, newest value per row, durable before the journal drops the segments; one compaction
  at a time, on a background thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from .errors import PoolCorruptError
from .journal import Journal, RecordType, decode_row_set, encode_rows

__all__ = ["persist_rows", "replay_plan", "replay_rows", "newest_mask", "latest", "absorb_rows", "Compactor"]


def persist_rows(journal: Journal | None, pairs) -> int:
    """Make rows ``[(table, ids)]`` (trusted ids) durable: on ``journal`` when the tier is
    journaled (ROWS + one group commit), else by the region's own flush. Returns row bytes."""
    pairs = [(t, ids) for t, ids in pairs if ids.numel()]
    if journal is None:
        return sum(t._region.flush_rows(ids) for t, ids in pairs)
    if not pairs:
        return 0
    n = 0
    for t, ids in pairs:
        rows = t._region.tensor.index_select(0, ids)
        journal.append(RecordType.ROWS, -1, encode_rows(t.name, ids, rows))
        t._region.clear_dirty(ids)
        n += ids.numel() * t.config.row_bytes
    journal.end(-1, {"kind": "persist"})
    return n


def replay_plan(journal: Journal, tables: set[str], where: Path) -> dict[str, list]:
    """ROWS records of every complete transaction, per table, in journal order."""
    plan: dict[str, list] = {}
    refs = [r for txn in journal.txns for r in txn.records if r.type == RecordType.ROWS]
    for ref, payload in journal.read_many(refs):
        # Views of the mapped segment (kept mapped while they live); latest() copies them.
        for name, ids, raw in decode_row_set(payload):
            plan.setdefault(name, []).append((ids, raw))
    unknown = set(plan) - set(tables)
    if unknown:
        raise PoolCorruptError(f"{where}: the journal holds rows of unknown tables {sorted(unknown)}")
    return plan


def newest_mask(ids: torch.Tensor, rows: int) -> torch.Tensor:
    """True at the last occurrence of every id of ``ids`` (ids in ``[0, rows)``)."""
    # One scatter of positions with max, no sort: each row keeps the highest position it appears
    # at (deterministic, unlike a plain scatter of duplicates); rows not in ``ids`` are never
    # read. 3-4x faster than the stable sort of the ids it replaces (2.2-2.9 ms vs 7.6-11 ms
    # for 330k ids here).
    dtype = torch.int32 if ids.numel() < 2**31 else torch.int64
    pos = torch.arange(ids.numel(), dtype=dtype)
    last = torch.empty(rows, dtype=dtype)
    last.scatter_reduce_(0, ids, pos, "amax", include_self=False)
    return last[ids] == pos


def latest(parts: list, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The newest value of every row of (ids, raw) parts in journal order (ids in ``[0,
    rows)``), sorted by row: what compaction writes back. The rows are gathered straight from
    the parts into the result (no concatenated copy of them all: half a GB, and its page
    faults, per compaction on `small`)."""
    if not parts:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, 0, dtype=torch.uint8)
    ids = torch.cat([p[0] for p in parts])
    pos = newest_mask(ids, rows).nonzero().flatten()   # ascending positions: grouped by part
    kept, order = torch.sort(ids[pos])
    dst = torch.empty_like(order)
    dst[order] = torch.arange(order.numel())           # where each kept position goes
    out = torch.empty(pos.numel(), parts[0][1].shape[1], dtype=torch.uint8)
    bounds = torch.tensor([0] + [p[0].numel() for p in parts]).cumsum(0)
    cuts = torch.searchsorted(pos, bounds).tolist()
    for k, (_, raw) in enumerate(parts):
        a, b = cuts[k], cuts[k + 1]
        if a < b:
            out.index_copy_(0, dst[a:b], raw.index_select(0, pos[a:b] - int(bounds[k])))
    return kept, out


def replay_rows(rows: torch.Tensor, parts: list) -> int:
    """Write the newest value of every row of ``parts`` ((ids, raw) in journal order) into
    ``rows`` ([n, row_bytes] uint8, the working copy), part by part: each row is copied once,
    from the journal to its place, with no concatenated copy of them all (on `kaggle` that copy
    was half a GB). Returns the rows written."""
    ids = torch.cat([p[0] for p in parts])
    mask = newest_mask(ids, rows.shape[0])
    at = written = 0
    for pid, raw in parts:
        m = mask[at:at + pid.numel()]
        at += pid.numel()
        if not bool(m.all()):
            sel = m.nonzero().flatten()
            pid, raw = pid[sel], raw[sel]
        rows.index_copy_(0, pid, raw)
        written += pid.numel()
    return written


def absorb_rows(journal: Journal, tables: dict, refs, stats) -> None:
    """Compaction: write the ROWS of journal records back into the table images, newest value
    per row, sorted and coalesced; durable (fdatasync) before the records are dropped."""
    parts: dict[str, list] = {}
    for ref, payload in journal.read_many([r for r in refs if r.type == RecordType.ROWS]):
        for name, ids, raw in decode_row_set(payload):
            # Views of the mapped segments, as in replay_plan (the mappings live while they do,
            # and the segments are reused only after this returns): latest() copies them once.
            parts.setdefault(name, []).append((ids, raw))
    for name, p in parts.items():
        region = tables[name]._region
        stats.bytes_written_back += region.write_back(*latest(p, region.rows))
    for name in parts:
        tables[name]._region.sync()


class Compactor:
    """One compaction at a time, inline or on a background thread."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None

    @property
    def running(self) -> bool:
        return self._job is not None and not self._job.done()

    def run(self, fn: Callable[[], None], *, wait: bool) -> Future | None:
        """Run ``fn`` now (``wait``), or in the background: None if one is still running."""
        if wait:
            fn()
            return None
        if self.running:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="journal-compactor")
        self._job = self._pool.submit(fn)
        return self._job

    def wait(self) -> None:
        """Wait for the background compaction, if one is running (and raise its error)."""
        if self._job is not None:
            self._job.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
