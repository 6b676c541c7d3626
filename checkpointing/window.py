"""The rows a recovery window has touched (:mod:`checkpointing.policy`): each row's bytes are
made durable once per window, not once per step.

* Direct tiers: :meth:`WindowRows.first_touch` keeps, of a step's rows, those the window has not
  touched yet (their before-images are the values at the window's start: the only ones a
  rollback to it needs).
* Journaled tiers: :meth:`WindowRows.touched_rows` gives every row the window changed, once, for
  the after-images written at the window's end.

A per-table bitmap (one byte per row of the tables touched), cleared row by row at the window's
end: about 100 us a step on `small`. The look-up and marking of a step's rows is one pass in C
(:func:`memory_pool.first_touch`; NumPy's three fancy-indexing passes took ~0.45 ms a step of
the trainer's thread on `small`, cache-cold).
"""

from __future__ import annotations

import numpy as np
import torch

from memory_pool import TouchedRows, first_touch

__all__ = ["WindowRows"]


class WindowRows:
    """See the module docstring. Not thread-safe: one thread (the journal writer) uses it. NumPy
    rather than torch for these small per-table operations (a torch call's dispatch costs several
    times a NumPy one's, and a step makes ~250 of them on `small`).

    Two ways to keep the bitmaps, the same answers: per table (any ``[(Table, ids)]``), or one
    bitmap over a group of tables when the step's rows come in one numbering
    (:class:`memory_pool.TouchedRows` with ``global_rows``, the fused path's plan): then a
    step's first touches are one look-up and one split, not one look-up per pair (~50 on
    `small`: 1.16 -> 0.68 ms a step in training, measured with the pool and the step around it;
    the rest is the bitmap's cache misses). A window keeps to the way its
    first step used; a step that comes the other way in the middle of it moves the marks to the
    per-table bitmaps first (never the case in one run: the plan's kind does not change)."""

    def __init__(self):
        self._seen: dict[str, np.ndarray] = {}       # table name -> bool[num_embeddings]
        self._marked: dict[str, tuple] = {}          # table name -> (Table, [ids first touched])
        # One numbering: the bitmap over every member's rows, the rows marked in this window
        # (arrays of global rows, each sorted), and the layout that maps them back to pairs.
        self._gseen: np.ndarray | None = None
        self._gmarked: list[np.ndarray] = []
        self._layout: tuple | None = None            # (base: a tensor, [(Table, member)])

    def first_touch(self, touched) -> tuple[list, bool]:
        """Of ``touched`` (``[(Table, unique ids)]``), the rows this window touches for the first
        time, as ``[(Table, ids)]`` in the same order (some may be empty; a
        :class:`~memory_pool.TouchedRows` in the same numbering when ``touched`` is one), and
        whether that is all of them. They count as touched from now on."""
        g = getattr(touched, "global_rows", None)
        if g is not None and not self._marked:
            return self._first_touch_global(touched, g)
        if self._gmarked:
            self._to_tables()
        return self._first_touch_tables(touched)

    def mark(self, touched) -> None:
        """:meth:`first_touch` without its answer: the rows only count as touched from now on
        (a journaled tier's writer notes every step's rows; the window's end reads them all
        back with :meth:`touched_rows`). In one numbering, no split into pairs (~0.3 ms a step
        of the writer's on `small`, under cProfile)."""
        g = getattr(touched, "global_rows", None)
        if g is not None and not self._marked:
            self._first_touch_global(touched, g, answer=False)
        else:
            self.first_touch(touched)

    def _first_touch_global(self, touched, g, *, answer: bool = True) -> tuple[list, bool] | None:
        base = touched.base.numpy()
        layout = (touched.base, [(t, f) for (t, _), f in zip(touched, touched.member)])
        if self._layout is None or not _same_layout(self._layout, layout):
            if self._gmarked:
                self._to_tables()
                return self._first_touch_tables(touched)
            self._layout = layout
            self._gseen = np.zeros(int(base[-1]), dtype=bool)
        a = g.numpy()
        new = first_touch(a, self._gseen)   # (and marked)
        if not answer:
            if new.size:
                self._gmarked.append(new)
            return None
        if new.size == a.size:
            if a.size:
                self._gmarked.append(a)
            return touched, True
        if new.size:
            self._gmarked.append(new)
        rows = _split(new, base)
        # (in the same numbering too: the gathers of them take it whole, memory_pool.gather)
        return TouchedRows([(t, rows[f]) for t, f in layout[1]], global_rows=torch.from_numpy(new),
                           base=touched.base, member=touched.member), False

    def _first_touch_tables(self, touched) -> tuple[list, bool]:
        out, complete = [], True
        for t, ids in touched:
            seen = self._seen.get(t.name)
            if seen is None:
                seen = self._seen[t.name] = np.zeros(t.num_embeddings, dtype=bool)
            a = ids.numpy()
            new = first_touch(a, seen)   # (and marked)
            if new.size != a.size:
                complete = False
            if new.size:
                self._marked.setdefault(t.name, (t, []))[1].append(new)
            out.append((t, ids if new.size == a.size else torch.from_numpy(new)))
        return out, complete

    def _to_tables(self) -> None:
        """The window's marks in one numbering moved to the per-table bitmaps."""
        pairs = self._global_pairs()
        self._reset_global()
        self._first_touch_tables(pairs)

    def _global_pairs(self) -> list:
        base, members = self._layout
        a = self._gmarked[0] if len(self._gmarked) == 1 else np.sort(np.concatenate(self._gmarked))
        rows = _split(a, base.numpy())
        return TouchedRows([(t, rows[f]) for t, f in members], global_rows=torch.from_numpy(a),
                           base=base, member=[f for _, f in members])

    def touched_rows(self) -> list:
        """Every row the window touched, once: ``[(Table, ids)]`` (journaled tiers: the rows whose
        after-images the window's end writes)."""
        out = self._global_pairs() if self._gmarked else []
        if not self._marked:
            return out  # (in one numbering, when the window's steps came in one)
        return out + [(t, torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts)))
                      for t, parts in self._marked.values()]

    def reset(self) -> None:
        """A new window: no row is touched yet."""
        for name, (_, parts) in self._marked.items():
            seen = self._seen[name]
            for p in parts:
                seen[p] = False
        self._marked = {}
        self._reset_global()

    def _reset_global(self) -> None:
        for p in self._gmarked:
            self._gseen[p] = False
        self._gmarked = []


def _split(rows: np.ndarray, base: np.ndarray) -> list[torch.Tensor]:
    """Sorted rows in one numbering -> each member's own ids (views of one array)."""
    cut = np.searchsorted(rows, base)
    local = torch.from_numpy(rows - np.repeat(base[:-1], np.diff(cut)))  # (one subtraction, not one a member)
    return [local[cut[f]:cut[f + 1]] for f in range(len(base) - 1)]


def _same_layout(a: tuple, b: tuple) -> bool:
    # (the plan hands the same base tensor every step: compared by identity first)
    return (a[0] is b[0] or torch.equal(a[0], b[0])) and len(a[1]) == len(b[1]) and \
        all(ta is tb and fa == fb for (ta, fa), (tb, fb) in zip(a[1], b[1]))
