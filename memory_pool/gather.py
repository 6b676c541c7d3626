"""Row gathering for the checkpointer: copies of the rows ``[(table, ids)]`` a step touches,
grouped so that the tables of one row size in the pool's arena are copied with one
``index_select`` (the undo log and the journal gather ~50 (table, rows) pairs a step). The pool's
methods of the same names (``MemoryPool.row_gathers``, ``gather_row_groups``,
``copy_row_gathers``, ``rows_per_pair``) apply the rows an on-demand replay has not applied yet
first, then call these.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch

from .arena import Arena
from .tiers import torch_dtype

__all__ = ["RowGather", "RowGathering", "TouchedRows", "row_gathers", "copy_row_gathers", "rows_per_pair"]


class TouchedRows(list):
    """The rows a step changes, ``[(Table, sorted distinct ids)]`` (a list, as everywhere), plus
    the same rows in one numbering over a group of tables when the caller found them with one
    sort over all of them (``dlrm_cxl.model``'s plan): ``global_rows`` (sorted, int64; table
    group member ``f``'s row ``r`` is ``base[f] + r``), ``base`` (``[F + 1]``) and, per pair, its
    member ``f`` (``member``). Consumers that handle the whole step at once (the recovery
    window's first-touch bitmap, ``checkpointing.window``) then make one array operation
    instead of one per pair; the others read it as the list it is."""

    def __init__(self, pairs=(), *, global_rows: torch.Tensor | None = None, base=None, member=None):
        super().__init__(pairs)
        self.global_rows = global_rows
        self.base = base
        self.member = member
        if global_rows is not None and (base is None or member is None or len(member) != len(self)):
            raise ValueError("TouchedRows: global_rows needs base and one member index per pair")


class RowGather(NamedTuple):
    """One group of :meth:`MemoryPool.row_gathers`: rows ``ids`` of ``src`` (a 2-D view of the
    arena or of one table), which are the rows of the pairs at indexes ``idx``, in that order.
    ``read``: for a table behind a write-back DRAM cache, whose cached rows may be newer than
    ``src`` (its home), how to read the rows' current values (``Table.current_rows``)."""

    idx: list[int]
    src: torch.Tensor
    ids: torch.Tensor
    grouped: bool  # a view of the arena shared by several pairs (else one table's own view)
    read: Callable[..., torch.Tensor] | None = None   # (ids, out=None) -> rows

    @property
    def rows(self) -> int:
        return int(self.ids.numel())

    @property
    def dtype(self) -> torch.dtype:
        return self.src.dtype

    @property
    def row_bytes(self) -> int:
        return self.src.shape[1] * self.src.element_size()

    def into(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the rows into ``out`` (``[rows, src columns]``, ``src``'s dtype); returns it."""
        if self.read is not None:
            return self.read(self.ids, out=out)
        if self.src.shape[1] == 1 and self.src.is_contiguous() and out.is_contiguous():
            # (one-element rows, row-wise Adagrad's state: a 1-D gather is ~5x faster than
            # index_select's row loop over [N, 1])
            torch.index_select(self.src.view(-1), 0, self.ids, out=out.view(-1))
            return out
        return torch.index_select(self.src, 0, self.ids, out=out)


def rows_per_pair(pairs, groups) -> list[torch.Tensor]:
    """:meth:`MemoryPool.gather_row_groups`' groups split back into one tensor (a view) per pair."""
    out: list = [None] * len(pairs)
    for idx, rows in groups:
        for i, part in zip(idx, rows.split([pairs[i][1].numel() for i in idx])):
            out[i] = part
    return out


def copy_row_gathers(gathers: list[RowGather], buffers: dict | None = None) -> list[tuple[list[int], torch.Tensor]]:
    """The rows of :func:`row_gathers`' groups, copied: ``[(indexes into pairs, rows)]``.
    ``buffers``: a dict the caller keeps, holding reusable buffers (the results are views of
    them, valid until the next call with the same dict)."""
    out: list = []
    for g in gathers:
        if buffers is not None and g.grouped:
            # A caller's reusable buffer per row size: no fresh allocation (and page faults)
            # for a few MB every step. (Only arena groups: one per row size, so one buffer.)
            key = (g.row_bytes, g.dtype)
            buf = buffers.get(key)
            if buf is None or buf.shape[0] < g.rows:
                buf = buffers[key] = torch.empty(max(g.rows * 5 // 4, 1024), g.src.shape[1], dtype=g.dtype)
            out.append((g.idx, g.into(buf[:g.rows])))
        else:
            out.append((g.idx, g.read(g.ids) if g.read is not None else g.src.index_select(0, g.ids)))
    return out


def reads_home(t, before_images: bool = False) -> bool:
    """Whether a gather of table ``t``'s rows reads its home (else through its cache:
    ``Table.current_rows``). ``before_images``: of rows the current recovery window has not
    touched yet (the undo log's), which the home holds behind a cache flushed at every recovery
    point too (``Table.home_holds_untouched_rows``)."""
    return t.home_holds_untouched_rows if before_images else not t.cache_holds_newer


def row_gathers(arena: Arena, pairs, *, before_images: bool = False) -> list[RowGather]:
    """How to copy rows ``[(table, ids)]`` (trusted ids, already applied to the working copy),
    grouped: tables of the same row size in ``arena`` are one :class:`RowGather`, copied with
    ONE ``index_select`` over the arena (the undo log and the journal gather ~50 (table, rows)
    pairs a step: one kernel instead of 50, and one journal record per group); other tables
    (behind a write-back cache, read through it; outside the arena; at an unaligned offset) one
    each. Nothing is copied yet: a caller may copy straight to where the rows go
    (:meth:`RowGather.into`). ``before_images``: the rows are ones the current recovery window
    has not touched yet (the undo log's), which a table's home holds behind a write-through
    cache and behind one flushed at every recovery point (``Table.home_holds_untouched_rows``)."""
    out: list = []
    groups: dict = {}
    for i, (t, ids) in enumerate(pairs):
        off, rb = t.arena_offset, t.config.row_bytes
        # A table behind a write-through cache (real pmem's cache arena, the reference path's
        # row cache) is read from its home like any other: the home holds every row's current
        # value where a checkpointer reads it (the before-images at the write-ahead barrier,
        # before the update changes the slots), so it joins its row size's group; so does one
        # behind a direct home's write-back cache for the before-images (a window's untouched
        # rows are clean: memory_pool/cache_writeback.py). On `kaggle` behind a quarter cache on
        # shm, ~40 gathers a step became 2 and the undo log's time on the trainer's thread fell
        # from 7-8 to ~4.7 ms a step.
        if not reads_home(t, before_images):
            out.append(RowGather([i], t.region.tensor, ids, False, t.current_rows))
        elif off is None or off % rb:
            out.append(RowGather([i], t.view(), ids, False))
        else:
            groups.setdefault((rb, t.config.dtype), []).append(i)
    for (rb, dt), idx in groups.items():
        dtype = torch_dtype(dt)
        flat = arena.tensor(0, arena.used - arena.used % rb, dtype).view(-1, rb // dtype.itemsize)
        out.append(RowGather(idx, flat, _arena_rows(pairs, idx, rb), True))
    return out


def _arena_rows(pairs, idx: list[int], rb: int) -> torch.Tensor:
    """The rows of pairs ``idx`` (in that order) as rows of the arena viewed with ``rb``-byte
    rows. When ``pairs`` holds them in one numbering and ``idx`` is one pair per member in
    member order (the fused path's plan: weights, or their optimizer states), that numbering
    shifted member by member: three array operations instead of one add per pair and a cat
    (~50 small tensor ops a step on `small`)."""
    g = getattr(pairs, "global_rows", None)
    if g is not None and [pairs.member[i] for i in idx] == list(range(len(pairs.base) - 1)):
        # (NumPy: a call costs a few us against torch's ~15 us dispatch; ~0.2 ms a step on `small`)
        a, base = g.numpy(), pairs.base.numpy()
        shift = np.fromiter((pairs[i][0].arena_offset // rb for i in idx), dtype=np.int64, count=len(idx)) - base[:-1]
        return torch.from_numpy(a + np.repeat(shift, np.diff(np.searchsorted(a, base))))
    return torch.cat([pairs[i][1] + pairs[i][0].arena_offset // rb for i in idx])


class RowGathering:
    """:class:`~memory_pool.pool.MemoryPool`'s row gathering for the checkpointer (uses the
    pool's ``_arena``, ``ready`` and ``_check_open``)."""

    rows_per_pair = staticmethod(rows_per_pair)
    copy_row_gathers = staticmethod(copy_row_gathers)

    def gather_row_groups(self, pairs, buffers: dict | None = None) -> list[tuple[list[int], torch.Tensor]]:
        """Copies of rows ``[(table, ids)]`` (trusted ids), grouped: ``[(indexes into pairs,
        their rows concatenated in that order)]`` (see :meth:`row_gathers`)."""
        return self.copy_row_gathers(self.row_gathers(pairs), buffers)

    def row_gathers(self, pairs, *, before_images: bool = False) -> list[RowGather]:
        """How to copy rows ``[(table, ids)]`` (trusted ids), grouped (:func:`row_gathers`):
        nothing is copied yet. ``before_images``: rows the current recovery window has not
        touched yet (the undo log's)."""
        self._check_open()
        self.ready([(t, ids) for t, ids in pairs if reads_home(t, before_images)])  # (the others: Table.current_rows)
        return row_gathers(self._arena, pairs, before_images=before_images)
