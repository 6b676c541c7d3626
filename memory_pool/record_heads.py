"""Row records' heads as this process wrote them: a compaction's first pass without reads.

A compaction behind a row overlay reads its records twice (memory_pool/newest.py): first each
row record's header and ids (to plan where every newest value goes), then every record whole,
verified. The first pass was ~2,700 direct reads of 16 KiB for `kaggle`'s GiB of journal: 0.3 s
of the compactor's CPU and 0.6-1 s of device waits a compaction, on 2 cores that the trainer's
two threads share with it. But the journal's writer had those bytes in hand a moment before it
wrote them. :class:`RecordHeads` keeps a copy (~3 % of the records' bytes: ~32 MB a GiB of
journal, counted in the DRAM budget like any memory of the process) until the journal drops the
records (``Journal.reclaim``).

Nothing is trusted more for it. The second pass still reads every record whole from the device,
checks it against its checksum and compares its ids with the kept ones: a record whose bytes on
the device are not those written is refused (``JournalCorruptError``) before anything is written,
as before. A record this process did not write (before the open, or while heads were not kept)
is read from the device, as before.
"""

from __future__ import annotations

import threading

import numpy as np

from .records import row_set_ids_end
from .segment_format import RecordRef

__all__ = ["RecordHeads"]


class RecordHeads:
    """Heads (a row record's payload up to the end of its ids) by sequence number. ``note`` and
    ``add`` are called by the journal's writer, ``get`` by the compactor, ``drop_below`` by
    ``Journal.reclaim``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_seq: dict[int, tuple[int, int, np.ndarray]] = {}   # seq -> (payload crc, length, head)
        self.nbytes = 0

    @staticmethod
    def note(seq: int, payload: np.ndarray) -> tuple[int, np.ndarray] | None:
        """The head of the row record ``payload`` (uint8, as written), copied, to :meth:`add`
        once the record is written; None for a payload of another format."""
        end = row_set_ids_end(payload[:64])
        if end is None or end > len(payload):
            return None
        return seq, payload[:end].copy()

    def add(self, noted: list, refs: list[RecordRef]) -> None:
        """The records ``refs`` were written; ``noted``: what :meth:`note` gave for them."""
        if not noted:
            return
        by_seq = {r.seq: r for r in refs}
        with self._lock:
            for seq, head in noted:
                r = by_seq[seq]
                self._by_seq[seq] = (r.crc, r.length, head)
                self.nbytes += head.nbytes

    def get(self, ref: RecordRef) -> np.ndarray | None:
        """The head of ``ref`` as written, or None (not written by this process since heads were
        kept, or dropped). The record's checksum and length must match: a sequence number alone
        could name a record of another life of the journal."""
        with self._lock:
            got = self._by_seq.get(ref.seq)
        if got is None or got[0] != ref.crc or got[1] != ref.length:
            return None
        return got[2]

    def drop_below(self, seq: int) -> None:
        """Forget the records below ``seq`` (dropped from the journal)."""
        with self._lock:
            for s in [s for s in self._by_seq if s < seq]:
                self.nbytes -= self._by_seq.pop(s)[2].nbytes

    def __len__(self) -> int:
        return len(self._by_seq)
