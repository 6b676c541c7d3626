"""A transaction of the pool's journal: records added by kind, committed by one ``END``.

py-lmdb's Environment -> Transaction, SQLite's "one place for the commit order". The only way
the checkpointer (and recovery) writes the journal::

    txn = pool.begin(k)          # nothing written yet
    txn.undo(touched, ...)       # before-images of rows about to change in place (direct tiers):
                                 #   appended, synced, then the logged mark (see undo())
    txn.rows(touched)            # after-images of rows (journaled tiers); not yet durable
    txn.dense(parts)             # a dense blob (the checkpointer packs it); not yet durable
    txn.commit(doc)              # the records synced, then END(k, doc) appended and synced:
                                 #   durable when it returns. The one place END is written.

or ``with pool.begin(k, doc) as txn: ...``: leaving the block commits with ``doc``; an exception
commits nothing (the records stay an unfinished tail, which recovery drops or rolls back).

Records of a transaction may be appended by several calls on one thread (the journal has one
writer at a time; ``checkpointing.undo``'s writer thread is it while a checkpointer trains).

Reading: :func:`record_kind` names a record's kind (``"undo"``, ``"rows"``, ``"dense"``,
``"logged"``, ``"end"``) for code outside ``memory_pool`` that walks ``pool.journal.txns``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .records import Fill, decode_logged_mark, decode_row_set, encode_logged_mark, encode_row_set, undo_group_of
from .segment_format import RecordType

__all__ = ["Transaction", "record_kind", "decode_row_set", "decode_logged_mark", "undo_group_of"]

_KINDS = {RecordType.UNDO: "undo", RecordType.ROWS: "rows", RecordType.DENSE: "dense",
          RecordType.LOGGED: "logged", RecordType.END: "end"}


def record_kind(ref) -> str:
    """The kind of a journal record (a ``RecordRef``): undo, rows, dense, logged or end."""
    return _KINDS.get(ref.type, f"unknown-{int(ref.type)}")


class Transaction:
    """See the module docstring. Made by :meth:`memory_pool.MemoryPool.begin`."""

    def __init__(self, pool, tag: int, doc: dict | None = None):
        self.pool = pool
        self.journal = pool.journal
        self.tag = tag
        self.doc = doc
        self.first_seq: int | None = None   # the first record this transaction appended
        self.committed = None                # the journal's TxnInfo, once committed
        self._pending: list = []             # rows/dense records not yet written

    # -- records
    def _appended(self, refs) -> None:
        if refs and self.first_seq is None:
            self.first_seq = refs[0].seq

    def undo(self, touched, *, mark: bool, buffers: dict | None = None,
             gathered: Callable[[list], None] | None = None, halfway: Callable[[], None] | None = None) -> int:
        """The current values of ``touched`` (``[(Table, ids)]``: the rows a step is about to
        change in place) as ``UNDO`` records, durable when this returns; with ``mark``, then the
        logged mark (``LOGGED``: the records of this undo group are all durable, the rows may
        change from here on; see ``checkpointing.undo``). Returns the payload bytes.

        ``gathered(before)``: called with the before-images (one tensor per pair, in order) as
        soon as they are copied, before the sync. ``buffers``: reusable gather buffers for a
        journal written directly (the before-images live in them until the step commits).
        ``halfway()``: called once half of the records are appended and synced (crash tests)."""
        j = self.journal
        # The undo group: the sequence number of the step's first UNDO record (this thread is
        # the journal's only appender, so that is the next one).
        group = j.next_seq if mark else None
        gathers = self.pool.row_gathers(touched, before_images=True)
        if j.mapped:
            # Copied from the tables straight into the journal's mapping (no buffer); the
            # before-images are views of the records, which stay until a compaction after the
            # step's commit.
            groups: list = [None] * len(gathers)
            recs = _gather_records(RecordType.UNDO, self.tag, touched, gathers, groups, undo_group=group)
        else:
            # (A direct write's buffer is reused by the next append: gathered into the step's
            # own buffers first.)
            groups = self.pool.copy_row_gathers(gathers, buffers=buffers)
            recs = [(RecordType.UNDO, self.tag, encode_row_set(tables, rows, undo_group=group))
                    for tables, rows in _row_sets(touched, groups)]
        logged = (RecordType.LOGGED, self.tag, encode_logged_mark(group, len(recs))) if mark else None
        # Where the journal is never synced (shm, dram: a store into its shared mapping is all
        # the durability there is, and a crash of the process keeps the stores made before it
        # in program order), the mark rides in the records' own write, last: the journal stores
        # each payload before its header, so the mark's header is the last store, and a valid
        # mark implies every UNDO byte before it. Where a sync makes bytes durable, a write's
        # blocks may reach the media in any order until it returns: the mark goes after the
        # records' sync (below).
        same_write = logged is not None and not j.sync
        if halfway is not None:
            half = len(recs) // 2
            self._appended(j.append_many(recs[:half]))
            j.flush()
            halfway()
            recs = recs[half:]
        self._appended(j.append_many(recs + [logged] if same_write else recs))
        if gathered is not None:
            gathered(self.pool.rows_per_pair(touched, groups))
        # Write-ahead rule: durable before any row it covers changes in place.
        j.flush()
        if logged is not None and not same_write:
            # The mark only once the records' sync has returned (a mark that could outlive
            # records torn by a power loss would make recovery refuse a step that never changed
            # a row), and durable itself before a row changes (a step whose rows changed without
            # a durable mark would have a bad record taken for a torn tail).
            self._appended(j.append_many([logged]))
            j.flush()
        return _payload_bytes(gathers)

    def rows(self, touched) -> int:
        """After-images of ``touched`` (``[(Table, ids)]``), copied from the tables straight to
        where the records are written when the transaction's next write happens (with the
        dense blob, or at commit). Returns the payload bytes."""
        if not touched:
            return 0
        gathers = self.pool.row_gathers(touched)
        self._pending.extend(_gather_records(RecordType.ROWS, self.tag, touched, gathers))
        return _payload_bytes(gathers)

    def rows_raw(self, name: str, ids: torch.Tensor, raw: torch.Tensor) -> None:
        """After-images given as bytes (``raw``: one row per id)."""
        self._pending.append((RecordType.ROWS, self.tag, encode_row_set([(name, ids)], raw)))

    def dense(self, parts) -> None:
        """A dense blob (payload parts: buffers, or ``Fill`` parts written in place)."""
        self._pending.append((RecordType.DENSE, self.tag, parts))

    def dense_of(self, txn) -> bytes | None:
        """The dense blob of a committed transaction (``TxnInfo``), or None if it has none."""
        d = [r for r in txn.records if r.type == RecordType.DENSE]
        return self.journal.read(d[-1]) if d else None

    def write(self) -> None:
        """Append what ``rows``/``dense`` added (one write); not yet durable. The tables' rows
        and the ``Fill`` parts are read now: from here on they may change."""
        recs, self._pending = self._pending, []
        if recs:
            self._appended(self.journal.append_many(recs))

    def sync(self) -> None:
        """Make every record appended so far durable (the write-ahead barrier)."""
        self.journal.flush()

    def commit(self, doc: dict | None = None, *, before_end: Callable[[], None] | None = None):
        """Append what is pending, sync the records, then append ``END(tag, doc)`` and sync it.
        Durable when it returns (SQLite's rule: the commit record last and durably). Returns the
        journal's ``TxnInfo``. ``before_end()``: called between the records' sync and the END
        (crash tests)."""
        self.write()
        if before_end is not None:
            self.journal.flush()
            before_end()
        # The records durable first (only then may an END vouch for them), then the END, synced:
        # from there on the transaction survives any crash (both inside Journal.end).
        self.committed = self.journal.end(self.tag, doc if doc is not None else (self.doc or {}))
        return self.committed

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None and self.committed is None:
            self.commit()
        return False


def _gather_records(rtype: int, step: int, touched: list, gathers: list, out: list | None = None, *,
                    undo_group: int | None = None) -> list:
    """One journal record per :class:`~memory_pool.gather.RowGather`, whose rows are copied from
    the tables straight to where the record is written. ``out[i]``: set to ``(pair indexes,
    the rows as written)`` (a view of the record) as group ``i`` is copied."""
    recs = []
    for i, g in enumerate(gathers):
        tables = [(touched[j][0].name, touched[j][1]) for j in g.idx]
        if not g.rows:
            if out is not None:
                out[i] = (g.idx, g.src[:0])
            recs.append((rtype, step, encode_row_set(tables, g.src[:0], undo_group=undo_group)))
            continue

        def fill(dest, g=g, i=i) -> None:
            rows = g.into(torch.from_numpy(dest).view(g.dtype).view(g.rows, -1))
            if out is not None:
                out[i] = (g.idx, rows)

        recs.append((rtype, step, encode_row_set(tables, Fill(g.rows * g.row_bytes, fill), g.row_bytes,
                                                 undo_group=undo_group)))
    return recs


def _payload_bytes(gathers: list) -> int:
    """The bytes of row records that matter (rows and their ids)."""
    return sum(g.rows * (g.row_bytes + 8) for g in gathers)


def _row_sets(touched: list, groups: list) -> list:
    """One journal record per gathered group: ``[([(table name, ids)], rows)]``."""
    return [([(touched[i][0].name, touched[i][1]) for i in idx], rows) for idx, rows in groups]
