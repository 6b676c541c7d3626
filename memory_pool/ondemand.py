"""On-demand replay: a journaled pool's committed rows reach the working copy when first needed.

Opening a journaled pool replays the journal's committed rows into the private working copy
(:mod:`memory_pool.persistence`). Every row lands in a page of the table image that has to be
read first; after a power loss or a reboot, when the images are not in the page cache, that is
one random read per page: on `kaggle` 438k pages, 4.6-5.9 s on this disk, against 0.7 s to read
and verify the 981 MB of journal itself. With ``MemoryPool.open(..., replay="on-demand")`` (what
the trainer uses) the pool reads and verifies the journal exactly as before -- damage is refused
before anything changes -- but only indexes its rows: :class:`PendingRows` keeps the newest
journal value of every row, by its address in a window over the journal's segments
(``Journal.read_many(window=...)``). A row is copied into the working copy when something first
needs it:

* the rows a step reads or writes, before it touches them: every row path of :class:`Table` and
  of the pool (``read``, ``write``, ``lookup``, the trusted gathers and scatters,
  ``row_gathers``, ``persist_rows``), and the fused kernels, which read the arena directly,
  through :meth:`MemoryPool.ready`;
* a table's remaining rows when the whole table is asked for (``Table.view``: the digest,
  export), every table's for :meth:`MemoryPool.arena_tensor` (unless its caller promises to call
  ``ready`` first, as the fused trainer does);
* whatever is left at the next compaction, on the compactor's thread, right after it has written
  the same rows into the images (their pages are in the page cache then) and before it drops the
  journal segments the index points into -- except behind a row overlay's trim (a DRAM cache's
  first one after the open), which has just put every one of them in a run or home and maps the
  working copy afresh next: there they are handed over unapplied, pending from the run or the
  image (:meth:`PendingRows.hand_over`, ``Overlay.pend``).

Nothing else changes: the journal keeps the rows until that compaction, so a crash before it
replays them again (the index is rebuilt from the journal; replay is idempotent). The cost moves
from the open to the first steps that read those rows -- which, after a power loss, read their
pages from the disk anyway -- and to the compaction, which reads them to write them back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from .arena import Arena
from .newest import newest_mask
from .records import copy_rows
from .tiers import Region

__all__ = ["PendingRows"]


@dataclass
class _Pending:
    region: Region
    ids: torch.Tensor     # rows still to apply or applied since the open, sorted, distinct
    src: torch.Tensor     # byte offset in the window of each row's newest journal value
    mask: torch.Tensor    # [rows] bool: still to apply
    left: int


class PendingRows:
    """The committed journal rows a pool's working copy does not hold yet (see the module).

    ``plan``: :func:`replay_plan`'s ``{table: [(ids, raw)]}`` in journal order, read through
    ``window`` (its ``raw`` rows lie in it); ``regions``: each table's region; ``on_apply(n)``:
    called, under the lock, with the rows each call applied. Thread-safe: the trainer, the
    checkpointer's writer and the compactor may apply rows at the same time; a row is applied
    once, and its mark cleared only after it is in place."""

    def __init__(self, plan: dict[str, list], regions: dict[str, Region], window: Arena,
                 on_apply: Callable[[int], None] = lambda n: None):
        self._window = window
        self._on_apply = on_apply
        self._lock = threading.Lock()
        self._sources: dict[int, torch.Tensor] = {}
        self._tables: dict[str, _Pending] = {}
        scratch = torch.empty(max((regions[n].rows for n in plan), default=0), dtype=torch.int32)
        for name, parts in plan.items():
            region = regions[name]
            parts = [(ids, raw) for ids, raw in parts if ids.numel()]
            if not parts or not region.nbytes:
                continue
            rb = region.row_bytes
            ids = torch.cat([p[0] for p in parts])
            bounds = torch.tensor([0] + [p[0].numel() for p in parts]).cumsum(0)
            base = torch.tensor([raw.data_ptr() - window.base for _, raw in parts], dtype=torch.int64)
            keep = newest_mask(ids, region.rows, scratch).nonzero().flatten()
            part = torch.searchsorted(bounds, keep, right=True) - 1
            src = base[part] + (keep - bounds[part]) * rb
            rows, order = torch.sort(ids[keep])
            mask = torch.zeros(region.rows, dtype=torch.bool)
            mask[rows] = True
            self._tables[name] = _Pending(region, rows, src[order], mask, rows.numel())
        self._left = sum(p.left for p in self._tables.values())

    @property
    def remaining(self) -> int:
        """Rows still to apply, over every table."""
        return self._left

    def take(self, name: str, ids: torch.Tensor | None = None, *, limit: int | None = None) -> int:
        """Apply the pending rows of table ``name`` among ``ids`` (valid int64 ids, duplicates
        allowed; None: every pending row of the table, at most ``limit`` of them). Returns the
        rows applied."""
        p = self._tables.get(name)
        if p is None:
            return 0
        if ids is not None:
            # A first look without the lock: a row is only ever cleared, and cleared after it is
            # in place, so a row seen as done here is done.
            ids = ids[p.mask[ids]]
            if not ids.numel():
                return 0
        with self._lock:
            if self._tables.get(name) is not p:
                return 0
            if ids is None:
                hit = p.ids[p.mask[p.ids]]
                if limit is not None:
                    hit = hit[:limit]
            else:
                hit = torch.unique(ids[p.mask[ids]])
            if hit.numel():
                src = self._source(p.region.row_bytes).index_select(0, p.src[torch.searchsorted(p.ids, hit)])
                copy_rows(p.region.tensor.view(torch.uint8).view(p.region.rows, p.region.row_bytes), hit, src)
                p.mask[hit] = False
                p.left -= hit.numel()
                self._left -= hit.numel()
                self._on_apply(hit.numel())
            if p.left == 0:
                del self._tables[name]
            return hit.numel()

    def peek(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Which of ``ids`` (valid, distinct) are pending in table ``name``, and their values
        (``[hits, row_bytes]`` uint8, a copy): read, not applied (a DRAM cache's miss takes
        them into its slot: ``Replayer.peek``). None when none is."""
        p = self._tables.get(name)
        if p is None:
            return None
        with self._lock:
            if self._tables.get(name) is not p:
                return None
            mask = p.mask[ids]
            if not bool(mask.any()):
                return None
            hit = ids[mask]
            src = self._source(p.region.row_bytes).index_select(0, p.src[torch.searchsorted(p.ids, hit)])
            return mask, src

    def take_all(self, *, chunk: int | None = None) -> int:
        """Apply every pending row (``chunk``: at most that many per hold of the lock, so that a
        step on another thread waits for one chunk, not for all of them)."""
        n = 0
        for name in list(self._tables):
            while name in self._tables:
                n += self.take(name, limit=chunk)
        return n

    def hand_over(self, pend: Callable[[str, torch.Tensor], int]) -> int:
        """Drop every pending row unapplied, each table's (sorted) given to ``pend(name, rows)``
        first: a row overlay that now holds their newest values (``Overlay.pend``). Returns the
        rows handed over. Call order: only where nothing reads rows meanwhile (a trim: the
        cache paused, no step running), as a reader looks at the overlay before this index
        (``Replayer.peek``) and could miss a row moving from one to the other."""
        n = 0
        with self._lock:
            for name, p in list(self._tables.items()):
                pend(name, p.ids.masked_select(p.mask.index_select(0, p.ids)))
                del self._tables[name]   # (after: the row is pending in one or the other throughout)
                self._left -= p.left
                n += p.left
        return n

    def forget(self, name: str) -> None:
        """Drop table ``name``'s pending rows unapplied (its rows were all replaced)."""
        with self._lock:
            p = self._tables.pop(name, None)
            if p is not None:
                self._left -= p.left

    def _source(self, row_bytes: int) -> torch.Tensor:
        # (the window's rows at every byte offset: Arena.rows_at_every_offset, kept per row size)
        src = self._sources.get(row_bytes)
        if src is None:
            src = self._sources[row_bytes] = self._window.rows_at_every_offset(row_bytes)
        return src
