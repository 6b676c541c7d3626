"""A compaction's newest rows, read from its journal records direct (:func:`newest_rows`).

What a compaction writes is, per table, the newest value of every row its records hold, sorted
by row (:func:`memory_pool.persistence.latest` computes the same from records it is given). It
used to map the records' segments side by side and gather from the mapping, after a pre-read
that touched every page. On this VM the CPU's first touch of a page the disk has just filled
costs ~2 us: ~0.55-0.64 s of the compactor's CPU for each GiB of journal, through a mapping or
a copy out of the page cache alike, while the trainer's two threads ran beside it on 2 cores;
and the pre-read held the whole GiB in the page cache, which the DRAM budget counts. A direct
read into memory already touched costs ~0.04 s a GiB (``JournalReader.read_payloads``).

Two passes over the records, in journal order:

1. Each record's header and ids only (~3 % of its bytes, not yet verified; in ``reading``, the
   compaction's device-wait phase; not read at all for the records whose heads the journal kept
   as it wrote them, memory_pool/record_heads.py): which of its rows count (``select``: a bulk load or a
   refresh since may have made them stale), and, per table, which record holds the newest value
   of each row and where that value goes in the sorted result (:func:`newest_mask`, as
   ``latest`` does).
2. Every record, read whole and verified against its checksum, its ids compared with those the
   first pass read, its newest rows copied to their places. A record that fails either is
   corrupt: nothing has been written anywhere yet when that is found.

Measured on `kaggle` behind a 2.2 GB cache (a compaction of ~1 GiB, ~2,700 records): pass 1
0.21 s of CPU (0.6 s wall), the plan 0.25 s, pass 2 0.48 s (0.75-0.8 s wall, the next span read
on a thread of its own); the peak DRAM of the benchmark 3,162 -> 2,280-2,460 MB.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Sequence

import numpy as np
import torch

from ._native import newest_places as _c_newest_places
from .arena import populated
from .records import copy_rows_at, decode_row_set, decode_row_set_ids
from .segment_format import JournalCorruptError, RecordRef

__all__ = ["newest_rows", "newest_mask", "newest_places"]


def newest_rows(journal, refs: Sequence[RecordRef], sizes: dict[str, int],
                select: Callable[[RecordRef, str, torch.Tensor], torch.Tensor | bool | None], *,
                reading: Callable[[], ContextManager] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{table: (ids, raw)}``: the newest value of every row that the ROWS records ``refs`` (in
    journal order) hold, ``ids`` sorted and distinct, ``raw`` their rows (``[n, row_bytes]``
    uint8), read with ``journal.read_payloads`` (see the module). ``sizes``: each table's rows
    (an id outside is a corrupt record). ``select(ref, table, ids)``: which of a record's rows of
    a table count -- None for none, True for all, else a bool mask over ``ids``. A table whose
    rows all fail ``select`` in every record is not in the result. ``reading``: a context manager
    the first pass runs in (the compaction's :attr:`~memory_pool.compaction.Compaction.reading`).
    Two tables with the same newest rows may share one ``ids`` tensor: read it, never change it."""
    # Pass 1: the ids. parts[table]: [(record index, section index, kept positions or None, ids)]
    parts: dict[str, list] = {}
    row_bytes: dict[str, int] = {}
    heads: list[torch.Tensor] = []
    with (reading or contextlib.nullcontext)():
        _first_pass(journal, refs, sizes, select, parts, row_bytes, heads)

    # Where each newest value comes from and goes, per table.
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    ids_of: dict[str, torch.Tensor] = {}
    copies: dict[int, list] = {}   # record index -> [(section, table, rows of the section, places)]
    scratch = torch.empty(max(sizes[n] for n in parts), dtype=torch.int32) if parts else None
    # (A table's places follow from its ids alone: a table whose records hold the very ids of
    # another's -- an embedding table and its optimizer state, written together -- takes them
    # from it: half of the plan's time on `kaggle`, whose 26 tables each have a state table.)
    done: dict[tuple, list] = {}
    for name, ps in parts.items():
        ids = torch.cat([p[3] for p in ps])  # (journal order)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= sizes[name]):
            bad = next(p[0] for p in ps if p[3].numel() and (int(p[3].min()) < 0 or int(p[3].max()) >= sizes[name]))
            raise JournalCorruptError(f"journal record {refs[bad].seq} holds rows of {name!r} outside its "
                                      f"{sizes[name]:,} rows")
        counts = [p[3].numel() for p in ps]
        same = done.setdefault(tuple(counts), [])
        got = next((r for other, r in same if torch.equal(other, ids)), None)
        if got is None:
            got = newest_places(ids, counts, sizes[name], scratch)
            same.append((ids, got))
        kept, places = got
        ids_of[name] = kept
        for j, local, dst in places:
            k, i, sel, _ = ps[j]
            copies.setdefault(k, []).append((i, name, local if sel is None else sel.index_select(0, local), dst))
    # Every table's newest rows in one buffer, populated at once (arena.populated: ~270 MB on
    # `kaggle`, ~15 % less CPU than faulting its pages in one by one as pass 2 copies).
    # (each table's rows from a multiple of 64 bytes: row_words' views of them)
    ends = [-(-kept.numel() * row_bytes[n] // 64) * 64 for n, kept in ids_of.items()]
    at, room = 0, populated(sum(ends))
    for (name, kept), n in zip(ids_of.items(), ends):
        out[name] = (kept, room[at:at + kept.numel() * row_bytes[name]].view(kept.numel(), row_bytes[name]))
        at += n

    # Pass 2: every record, whole and verified (a record is read though none of its values is
    # the newest: its ids, which pass 1 took unverified, decided that), its ids those pass 1
    # read; each newest value to its place.
    for k, (ref, payload) in enumerate(journal.read_payloads(refs)):
        try:
            sections = decode_row_set(payload)
        except ValueError as exc:
            raise JournalCorruptError(f"journal record {ref.seq} in {ref.segment.name}: {exc}") from None
        # (its ids, every table's: the sections' are consecutive views of them -- one table in
        # each of `kaggle`'s records -- not decoded a second time)
        ids = sections[0][1] if len(sections) == 1 else torch.cat([sec[1] for sec in sections] or [heads[k][:0]])
        if not torch.equal(ids, heads[k]):
            raise JournalCorruptError(f"journal record {ref.seq} in {ref.segment.name} changed between two reads "
                                      f"(or was not written as it was kept in memory)")
        for i, name, rows, places in copies.get(k, ()):
            copy_rows_at(out[name][1], places, sections[i][2], rows)
    return out


def newest_mask(ids: torch.Tensor, rows: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """True at the last occurrence of every id of ``ids`` (ids in ``[0, rows)``). ``scratch``:
    a reusable int32 buffer of at least ``rows`` elements (its contents do not matter)."""
    # One scatter of positions with max, no sort: each row keeps the highest position it appears
    # at (deterministic, unlike a plain scatter of duplicates); rows not in ``ids`` are never
    # read -- which is also why a scratch buffer left dirty by another table will do (it spares
    # the page faults of a fresh table-sized buffer: half of the time on `kaggle`'s 52 tables).
    # 3-4x faster than the stable sort of the ids it replaces (2.2-2.9 ms vs 7.6-11 ms for 330k
    # ids here).
    dtype = torch.int32 if ids.numel() < 2**31 else torch.int64
    pos = torch.arange(ids.numel(), dtype=dtype)
    use = scratch is not None and scratch.dtype == dtype and scratch.numel() >= rows
    last = scratch[:rows] if use else torch.empty(rows, dtype=dtype)
    last.scatter_reduce_(0, ids, pos, "amax", include_self=False)
    return last[ids] == pos


def newest_places(ids: torch.Tensor, counts: Sequence[int], rows: int, scratch: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor, torch.Tensor]]]:
    """``ids``: the ids of parts of ``counts[j]`` ids each, concatenated in journal order (in
    ``[0, rows)``). Returns (every id once, sorted; ``[(part j, positions in it, places)]``):
    the newest value of the id at position ``positions[m]`` of part ``j`` goes to row
    ``places[m]`` of the sorted result (parts holding no newest value left out). ``scratch``:
    :func:`newest_mask`'s. Computed by ``memory_pool/_newest.c`` when it was built (the torch
    code below is the definition; tests/test_newest_native.py compares both)."""
    fn = _c_newest_places()
    if fn is not None and 0 < ids.numel() < 2**31:
        pos, kept, dst = _places_native(fn, ids, rows, scratch)
    else:
        pos = newest_mask(ids, rows, scratch).nonzero().flatten()  # ascending: grouped by part
        kept, order = torch.sort(ids.index_select(0, pos))
        dst = torch.empty_like(order)
        dst[order] = torch.arange(order.numel())                   # where each kept position goes
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    cuts = torch.searchsorted(pos, torch.tensor(bounds)).tolist()
    return kept, [(j, pos[cuts[j]:cuts[j + 1]] - bounds[j], dst[cuts[j]:cuts[j + 1]])
                  for j in range(len(counts)) if cuts[j] < cuts[j + 1]]


def _places_native(fn, ids: torch.Tensor, rows: int, scratch: torch.Tensor | None):
    """(pos, kept, dst) of :func:`newest_places` by ``dlrm_newest_places`` (see there)."""
    ids = ids.to(torch.int64).contiguous()
    n = ids.numel()
    last = scratch[:rows] if (scratch is not None and scratch.dtype == torch.int32 and scratch.numel() >= rows
                              and scratch.is_contiguous()) else torch.empty(rows, dtype=torch.int32)
    words = (rows + 63) // 64
    bits, summary = np.zeros(words, dtype=np.uint64), np.zeros((words + 63) // 64, dtype=np.uint64)
    kept, pos, dst = (torch.empty(n, dtype=torch.int64) for _ in range(3))
    m = fn(ids.data_ptr(), n, rows, last.data_ptr(), bits.ctypes.data, summary.ctypes.data, kept.data_ptr(),
           pos.data_ptr(), dst.data_ptr())
    if m < 0:
        raise ValueError(f"newest_places: id {int(ids[-m - 1])} outside the table's {rows:,} rows")
    return pos[:m], kept[:m], dst[:m]


def _first_pass(journal, refs, sizes, select, parts: dict, row_bytes: dict, heads: list) -> None:
    """(newest_rows' pass 1.) ``parts`` and ``row_bytes`` filled, ``heads[k]``: record ``k``'s
    ids as read (one tensor, every table's), which pass 2 checks."""
    for k, (ref, head) in enumerate(journal.read_payloads(refs, ids_only=True)):
        try:
            ids, entries, rb = decode_row_set_ids(head)
        except ValueError as exc:
            raise JournalCorruptError(f"journal record {ref.seq} in {ref.segment.name}: {exc}") from None
        ids = ids.clone()  # (the buffer is reused; one copy a record, its tables' parts views of it)
        heads.append(ids)
        at = 0
        for i, (name, count) in enumerate(entries):
            mine, at = ids[at:at + count], at + count
            if name not in sizes:
                raise JournalCorruptError(f"journal record {ref.seq} holds rows of an unknown table {name!r}")
            # (here, not in the plan: the C plan and the torch one would each fail their own way)
            if count and (int(mine.min()) < 0 or int(mine.max()) >= sizes[name]):
                bad = int(mine[(mine < 0) | (mine >= sizes[name])][0])
                raise JournalCorruptError(f"journal record {ref.seq} holds row {bad} of {name!r}, which has "
                                          f"{sizes[name]:,} rows")
            keep = select(ref, name, mine)
            if keep is None:
                continue
            if row_bytes.setdefault(name, rb) != rb:
                raise JournalCorruptError(f"journal record {ref.seq} holds rows of {name!r} of {rb} bytes, "
                                          f"an earlier one of {row_bytes[name]}")
            sel = None if keep is True else keep.nonzero().flatten()
            parts.setdefault(name, []).append((k, i, sel, mine if sel is None else mine.index_select(0, sel)))
