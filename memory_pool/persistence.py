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
  at a time, on a background thread. Between compactions, sealed segments are written back as
  they are sealed, unsynced (``MemoryPool.apply``), and :class:`AppliedMark` records how far the
  images' page cache is up to date, so that opening after a crash of the trainer replays only
  the rest.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .errors import CompactionError, DlrmCxlError, PoolCorruptError
from .arena import Arena
from .durable import json_crc_ok, json_with_crc, raise_if_full
from .header import HEADER
from .journal import Journal, RecordType, decode_row_set, encode_rows, window_bytes
from .overlay import DENSE_FRACTION
from .newest import newest_mask, newest_places, newest_rows
from .records import copy_rows, copy_rows_at
from .tiers import shm_root
from .threads import one_intra_op_thread

__all__ = ["persist_rows", "replay_plan", "table_resets", "replay_rows", "newest_mask", "latest",
           "absorb_rows", "Compactor", "CompactionError", "AppliedMark", "APPLIED_PREFIX", "stale_marks"]

APPLIED_PREFIX = "dlrm-cxl-applied."   # <shm root>/dlrm-cxl-applied.<pool id>.<key>: see AppliedMark
_FS_IOC_GETVERSION = 0x80087601        # _IOR('v', 1, long): the inode's generation number
BOOT_ID = "/proc/sys/kernel/random/boot_id"  # changes at every boot


def persist_rows(journal: Journal | None, pairs) -> int:
    """Make rows ``[(table, ids)]`` (trusted ids) durable: on ``journal`` when the tier is
    journaled (ROWS + one group commit), else by the region's own flush. Returns row bytes.

    The rows stay dirty until their transaction is durable (the END synced): a persist that
    fails half way (a full disk, EIO) leaves every one of them dirty, so that the next persist
    writes them again -- clearing them first made a retry persist nothing, and the rows were
    lost at the next open. (Records of a failed attempt that did reach the journal carry no END
    of their own: the retry's END commits them with their newer copies, or an open drops them
    as an unfinished tail.)"""
    pairs = [(t, ids) for t, ids in pairs if ids.numel()]
    if journal is None:
        return sum(t.region.flush_rows(ids) for t, ids in pairs)
    if not pairs:
        return 0
    n = 0
    for t, ids in pairs:
        rows = t.current_rows(ids)  # (behind a write-back DRAM cache, the cached rows are the newer)
        journal.append(RecordType.ROWS, -1, encode_rows(t.name, ids, rows))
        n += ids.numel() * t.config.row_bytes
    journal.end(-1, {"kind": "persist"})
    for t, ids in pairs:
        t.region.clear_dirty(ids)  # (durable now)
    return n


def table_resets(journal: Journal) -> dict[str, int]:
    """``{table: seq}`` of the journal's reset markers (a bulk load of the whole table, durable in
    its image, committed as a transaction with the document ``{"kind": "reset", "table": ...}``):
    the table's ``ROWS`` records below ``seq`` no longer count, at replay or at a compaction."""
    out: dict[str, int] = {}
    for txn in journal.txns:
        if txn.doc.get("kind") == "reset" and isinstance(txn.doc.get("table"), str):
            out[txn.doc["table"]] = max(out.get(txn.doc["table"], -1), txn.end.seq)
    return out


def replay_plan(journal: Journal, tables: set[str], where: Path, since_seq: int = 0, *,
                on_demand: bool = False, resets: dict[str, int] | None = None) -> tuple[dict[str, list], Arena | None]:
    """ROWS records of every complete transaction from ``since_seq`` on, per table, in journal
    order (the images' page cache already holds those below it: :class:`AppliedMark`), and
    with ``on_demand`` the window they were read (and verified) through: one address range
    holding every segment they are in, which an on-demand replay gathers rows from
    (memory_pool/ondemand.py); else None."""
    refs = [r for txn in journal.txns if txn.end.seq >= since_seq
            for r in txn.records if r.type == RecordType.ROWS and r.seq >= since_seq]
    window = Arena(window_bytes(refs)) if on_demand and refs else None
    plan: dict[str, list] = {}
    for ref, payload in journal.read_many(refs, window=window):
        # Views of the mapped segment (kept mapped while they live); latest() copies them.
        for name, ids, raw in decode_row_set(payload):
            if resets and ref.seq < resets.get(name, -1):
                continue  # (the table was loaded whole since: these rows no longer count)
            plan.setdefault(name, []).append((ids, raw))
    unknown = set(plan) - set(tables)
    if unknown:
        raise PoolCorruptError(f"{where}: the journal holds rows of unknown tables {sorted(unknown)}")
    return plan, window


def latest(parts: list, rows: int, window: Arena | None = None,
           scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The newest value of every row of (ids, raw) parts in journal order (ids in ``[0,
    rows)``), sorted by row: what compaction writes back. The rows are gathered straight from
    the parts into the result (no concatenated copy of them all: half a GB, and its page
    faults, per compaction on `small`). ``window``: the journal's segments mapped side by side
    (``Journal.read_many(window=...)``); when every part's rows lie in it, they are gathered
    with one ``index_select`` in row order, not a gather and a scatter per part (a `kaggle`
    table's 77k newest rows of 15 records: ~5 ms against ~17, 1/4 of a compaction's CPU).
    ``scratch``: :func:`newest_mask`'s."""
    if not parts:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, 0, dtype=torch.uint8)
    ids = torch.cat([p[0] for p in parts])
    rb = parts[0][1].shape[1]
    kept, places = newest_places(ids, [p[0].numel() for p in parts], rows, scratch)
    if window is not None and all(_in_window(raw, window) for _, raw in parts):
        # (each kept row's offset in the window, in row order: one gather of them all)
        src = torch.empty(kept.numel(), dtype=torch.int64)
        for k, local, dst in places:
            src[dst] = (parts[k][1].data_ptr() - window.base) + local * rb
        return kept, window.rows_at_every_offset(rb).index_select(0, src)
    out = torch.empty(kept.numel(), rb, dtype=torch.uint8)
    for k, local, dst in places:
        copy_rows_at(out, dst, parts[k][1], local)
    return kept, out


def _in_window(raw: torch.Tensor, window: Arena) -> bool:
    """``raw`` (``[n, row_bytes]`` uint8) is rows laid end to end inside ``window``'s used range."""
    at = raw.data_ptr() - window.base
    return raw.is_contiguous() and 0 <= at and at + raw.numel() <= window.used


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
            pid, raw = pid[sel], raw.index_select(0, sel)
        copy_rows(rows, pid, raw)
        written += pid.numel()
    return written


def absorb_rows(journal: Journal, tables: dict, refs, stats, *, coalesce: bool = True, overlay=None,
                dense: float = DENSE_FRACTION, resets: dict[str, int] | None = None,
                superseded: list | None = None, reading=None) -> set[str]:
    """Write the ROWS of journal records back into the table images: newest value per row,
    sorted and coalesced (compaction); or (``coalesce=False``: a few segments at a time, as they
    are sealed) record after record in journal order, the newest landing last -- no sort, and
    no table-sized scratch per call (~0.1 s per call on `kaggle`'s 10M-row tables). Not synced:
    returns the names of the tables written, which the caller makes durable (fdatasync) before
    the records are dropped. ``overlay`` (a compaction of a pool with a row overlay,
    memory_pool/overlay.py): the newest values go to :meth:`Overlay.absorb` instead, which writes
    the dense pages home and keeps the other rows for its new run (``dense``: its threshold).
    ``superseded`` (``[(seq, {table: sorted rows})]``, ``Compaction.refresh``): those rows of a
    table were written into its image with their newest value as of sequence number ``seq``:
    a record below ``seq`` no longer writes them (it would put an older value back). With an
    ``overlay``, the rows left out go to :meth:`Overlay.absorb` too (``superseded``): one whose
    every record here was left out is home already. ``reading``: a context manager the first of
    :func:`~memory_pool.newest.newest_rows`' passes runs in (with an ``overlay``)."""
    parts: dict[str, list] = {}
    older = Superseded(superseded) if superseded else None
    gone: dict[str, list] = {}
    refs = [r for r in refs if r.type == RecordType.ROWS]
    if overlay is not None and refs and not journal.mapped:
        # (read direct, in two passes, not through a mapping of the segments: memory_pool/newest.py)
        def select(ref, name, ids):
            if resets and ref.seq < resets.get(name, -1):
                return None  # (older than a bulk load of the table: writing them back would undo it)
            drop = older.rows(ref.seq, name, ids) if older is not None else None
            if drop is None:
                return True
            gone.setdefault(name, []).append(ids[drop])
            return ~drop
        newest = newest_rows(journal, refs, {name: t.region.rows for name, t in tables.items()}, select,
                             reading=reading)
        for name, (ids, raw) in newest.items():
            region = tables[name].region
            asked = region.pages_prefetched
            overlay.absorb(name, ids, raw, dense=dense,
                           superseded=torch.unique(torch.cat(gone[name])) if name in gone else None)
            stats.pages_prefetched += region.pages_prefetched - asked
        return set(newest)
    # (the segments side by side in one window, for latest's one gather a table; it goes, and
    # the segments' mappings with it, when this returns: no view of it is kept)
    window = Arena(window_bytes(refs)) if coalesce and refs else None
    for ref, payload in journal.read_many(refs, window=window):
        for name, ids, raw in decode_row_set(payload):
            # Views of the mapped segments, as in replay_plan (the mappings live while they do,
            # and the segments are reused only after this returns): latest() copies them once.
            if resets and ref.seq < resets.get(name, -1):
                continue  # (older than a bulk load of the table: writing them back would undo it)
            drop = older.rows(ref.seq, name, ids) if older is not None else None
            if drop is not None:
                if overlay is not None:
                    gone.setdefault(name, []).append(ids[drop])
                ids, raw = ids[~drop], raw[~drop]
            parts.setdefault(name, []).append((ids, raw))
    # (one int32 scratch for every table's newest_mask, as large as the largest: a fresh one a
    # table is a table-sized buffer's page faults, 40 MB for a 10M-row `kaggle` table)
    scratch = torch.empty(max(tables[n].region.rows for n in parts), dtype=torch.int32) if coalesce and parts else None
    for name, p in parts.items():
        region = tables[name].region
        asked = region.pages_prefetched  # (cold pages asked for first: FileRegion._will_store)
        if overlay is not None:
            overlay.absorb(name, *latest(p, region.rows, window, scratch), dense=dense,
                           superseded=torch.unique(torch.cat(gone[name])) if name in gone else None)
        elif coalesce:
            stats.bytes_written_back += region.write_back(*latest(p, region.rows, window, scratch))
        else:
            stats.bytes_written_back += region.write_back_in_order(p)
        stats.pages_prefetched += region.pages_prefetched - asked
    return set(parts)


class Superseded:
    """The rows refreshes wrote into the images (``[(seq, {table: sorted rows})]``,
    ``Compaction.refresh``), per table: sorted, each with the newest such sequence number --
    one lookup a record (a compaction reads thousands), not one per refresh."""

    def __init__(self, entries: list):
        per: dict[str, list] = {}
        for at, rows in entries:
            for name, r in rows.items():
                per.setdefault(name, []).append((r, np.full(r.size, at, dtype=np.int64)))
        self.tables = {}
        for name, got in per.items():
            rows = np.concatenate([g[0] for g in got])
            seqs = np.concatenate([g[1] for g in got])
            order = np.lexsort((seqs, rows))
            rows, seqs = rows[order], seqs[order]
            last = np.append(rows[1:] != rows[:-1], True)  # (each row's newest refresh)
            self.tables[name] = (rows[last], seqs[last])

    def rows(self, seq: int, name: str, ids: torch.Tensor) -> torch.Tensor | None:
        """Which of ``ids`` (a record at ``seq`` of table ``name``) a later refresh wrote: a
        bool mask, or None when none did."""
        t = self.tables.get(name)
        if t is None or not ids.numel():
            return None
        rows, seqs = t
        x = ids.numpy()
        at = np.minimum(np.searchsorted(rows, x), rows.size - 1)
        hit = (rows[at] == x) & (seqs[at] > seq)
        return torch.from_numpy(hit) if hit.any() else None


def compaction_error(exc: BaseException) -> BaseException:
    """The typed error a failed background job is reported as (see :meth:`Compactor.check`)."""
    if isinstance(exc, DlrmCxlError):
        return exc  # typed already, with its hint (PoolFullError, PoolIOError, RunCorruptError...)
    if isinstance(exc, OSError):
        try:
            raise_if_full(exc, "background compaction")  # a full disk, a device error (EIO)
        except DlrmCxlError as typed:
            return typed
        except OSError:
            pass
    err = CompactionError(f"background compaction failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


class Compactor:
    """One compaction at a time, inline or on a background thread.

    A background job that fails is reported, once, to the next caller that looks: :meth:`check`
    (the pool's ``compacting``, which the checkpointer reads after every commit, and its persist
    calls), :meth:`run` and :meth:`wait`. Why: a failure nobody looked at was replaced by the
    next job, and a compactor failing every time (a full disk, a bad run directory) let the
    journal grow until the disk filled, with the trainer none the wiser. Typed
    (:func:`compaction_error`): the CLI exits with the error's code and hint."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None
        self._lock = threading.Lock()   # (the journal writer, the trainer and close() look)

    @property
    def running(self) -> bool:
        job = self._job
        return job is not None and not job.done()

    def check(self) -> None:
        """Raise the error of the background job if it finished with one (once: the next job may
        run after it); nothing when it succeeded or still runs."""
        with self._lock:
            job = self._job
            if job is None or not job.done():
                return
            self._job = None
        exc = job.exception()
        if exc is not None:
            raise compaction_error(exc)

    def run(self, fn: Callable[[], None], *, wait: bool) -> Future | None:
        """Run ``fn`` now (``wait``: after the background job, if one runs), or in the
        background: None if one is still running. Raises the error of a background job that
        failed instead (:meth:`check`)."""
        if wait:
            self.wait()
            fn()
            return None
        self.check()
        if self.running:
            return None
        if self._pool is None:
            # (one intra-op thread: it runs beside the trainer's GEMMs, see one_intra_op_thread)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="journal-compactor", initializer=one_intra_op_thread)
        with self._lock:
            self._job = self._pool.submit(fn)
            return self._job

    def wait(self) -> None:
        """Wait for the background compaction, if one is running (and raise its error: :meth:`check`)."""
        job = self._job
        if job is not None:
            futures_wait([job])
            self.check()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class AppliedMark:
    """How far the table images' *page cache* is up to date: every ``ROWS`` record of the journal
    below ``seq`` has been written into the images, synced or not (emulated pmem).

    Why: after a crash of the trainer (not of the machine), the page cache still holds every
    store made into the images, synced or not. Opening the pool then needs to replay only the
    journal from ``seq`` on -- a segment or two -- instead of everything since the last
    compaction (on `kaggle`, a GiB of journal: ~440k copy-on-write faults, over a second). The
    pool writes back each sealed journal segment soon after it is sealed (``apply``), and moves
    the mark after it.

    Why it can be trusted: the mark lives in the same place as what it vouches for. It is a file
    on tmpfs (``/dev/shm``), so it is lost exactly when the page cache is -- at a reboot or a power
    loss -- and then opening replays the whole live journal, as before. It is never fsynced (there
    is nothing to make durable: it must not outlive the page cache). It names the boot
    (``/proc/sys/kernel/random/boot_id``: a shm root that is not tmpfs still cannot carry it over
    a reboot), the pool id, and the device, inode and inode generation of the journal directory and
    of every image file: a copy of the pool, or files restored from a backup, are other files, and
    their page cache never held these stores. A file system that cannot tell an inode's
    generation gets no mark (full replay). ``power-sim`` never uses one: it emulates a power loss
    at every crash."""

    def __init__(self, pool_id: str, files: Callable[[], list[Path]], pool_dir: Path | None = None):
        self.pool_id = pool_id
        self.files = files        # the journal directory and every image file, as they are now
        self.pool_dir = pool_dir  # named in the mark, for `gc` (a pool deleted by hand)

    def _key(self) -> str | None:
        try:
            with open(BOOT_ID) as f:
                parts = [f.read().strip(), self.pool_id]
            for p in sorted(self.files()):
                fd = os.open(p, os.O_RDONLY)
                try:
                    st = os.fstat(fd)
                    gen = struct.unpack("<q", fcntl.ioctl(fd, _FS_IOC_GETVERSION, b"\0" * 8))[0]
                finally:
                    os.close(fd)
                parts.append(f"{p.name}:{st.st_dev}:{st.st_ino}:{gen}")
        except OSError:
            return None  # no boot id, a file gone, or no inode generation here: trust nothing
        return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()

    def _path(self, key: str) -> Path:
        return shm_root() / f"{APPLIED_PREFIX}{self.pool_id}.{key}"

    def read(self) -> int | None:
        """The sequence number vouched for, or None (no mark, another boot, other files)."""
        key = self._key()
        if key is None:
            return None
        try:
            doc = json.loads(self._path(key).read_bytes())
        except (OSError, ValueError):
            return None
        if not (isinstance(doc, dict) and json_crc_ok(doc) and doc.get("key") == key
                and isinstance(doc.get("seq"), int) and doc["seq"] >= 0):
            return None
        return doc["seq"]

    def write(self, seq: int) -> None:
        """Vouch for ``seq``: call only after every store it covers was made (program order:
        a crash after this write keeps those stores in the page cache). Best effort: a mark that
        cannot be written only makes the next open replay more."""
        key = self._key()
        # Marks of another key go: they name files that are gone or were replaced.
        self.remove(keep=None if key is None else self._path(key).name)
        if key is None:
            return
        try:
            path = self._path(key)
            tmp = path.with_name(f".{path.name}.tmp")
            # tmp + rename: a crash mid-write leaves the old mark or the new one, never half of one.
            tmp.write_bytes(json_with_crc({"key": key, "seq": int(seq),
                                           "pool": str(self.pool_dir.resolve()) if self.pool_dir else None}))
            os.replace(tmp, path)
        except OSError:
            self.remove()

    def remove(self, keep: str | None = None) -> None:
        """Vouch for nothing (after an error that may have cost the page cache its stores):
        every mark of this pool id goes, but the one named ``keep``."""
        for old in shm_root().glob(f"{APPLIED_PREFIX}{self.pool_id}.*"):
            if old.name != keep:
                try:
                    old.unlink()
                except OSError:
                    pass  # gone already, or not ours to remove: it vouches for nothing we use


def stale_marks(under: Path | None = None) -> list[Path]:
    """Applied marks whose pool is gone (its directory deleted by hand, or holding another pool):
    what ``gc`` removes. ``under``: only marks of pools in that directory or inside it."""
    out = []
    for p in shm_root().glob(f"{APPLIED_PREFIX}*"):
        try:
            doc = json.loads(p.read_bytes())
            pool = Path(doc["pool"])
        except (OSError, ValueError, TypeError, KeyError):
            out.append(p)  # unreadable or unnamed: vouches for nothing anyway
            continue
        if under is not None and not (pool == under or under in pool.parents):
            continue
        pool_id = p.name[len(APPLIED_PREFIX):].split(".")[0]
        try:
            alive = json.loads((pool / HEADER).read_bytes()).get("pool_id") == pool_id
        except (OSError, ValueError, AttributeError):
            alive = False
        if not alive:
            out.append(p)
    return out
