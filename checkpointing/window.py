"""The rows a recovery window has touched (:mod:`checkpointing.policy`): each row's bytes are
made durable once per window, not once per step.

* Direct tiers: :meth:`WindowRows.first_touch` keeps, of a step's rows, those the window has not
  touched yet (their before-images are the values at the window's start: the only ones a
  rollback to it needs).
* Journaled tiers: :meth:`WindowRows.touched_rows` gives every row the window changed, once, for
  the after-images written at the window's end.

A per-table bitmap (one byte per row of the tables touched), cleared row by row at the window's
end: about 100 us a step on `small`.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["WindowRows"]


class WindowRows:
    """See the module docstring. Not thread-safe: one thread (the journal writer) uses it. NumPy
    rather than torch for these small per-table operations (a torch call's dispatch costs several
    times a NumPy one's, and a step makes ~250 of them on `small`)."""

    def __init__(self):
        self._seen: dict[str, np.ndarray] = {}       # table name -> bool[num_embeddings]
        self._marked: dict[str, tuple] = {}          # table name -> (Table, [ids first touched])

    def first_touch(self, touched) -> tuple[list, bool]:
        """Of ``touched`` (``[(Table, unique ids)]``), the rows this window touches for the first
        time, as ``[(Table, ids)]`` in the same order (some may be empty), and whether that is
        all of them. They count as touched from now on."""
        out, complete = [], True
        for t, ids in touched:
            seen = self._seen.get(t.name)
            if seen is None:
                seen = self._seen[t.name] = np.zeros(t.num_embeddings, dtype=bool)
            a = ids.numpy()
            new = a[~seen[a]] if a.size else a
            if new.size != a.size:
                complete = False
            if new.size:
                seen[new] = True
                self._marked.setdefault(t.name, (t, []))[1].append(new)
            out.append((t, ids if new.size == a.size else torch.from_numpy(new)))
        return out, complete

    def touched_rows(self) -> list:
        """Every row the window touched, once: ``[(Table, ids)]`` (journaled tiers: the rows whose
        after-images the window's end writes)."""
        return [(t, torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts)))
                for t, parts in self._marked.values()]

    def reset(self) -> None:
        """A new window: no row is touched yet."""
        for name, (_, parts) in self._marked.items():
            seen = self._seen[name]
            for p in parts:
                seen[p] = False
        self._marked = {}
