"""The run file format of the row overlay (:mod:`memory_pool.overlay`): :func:`write_run` writes
one, :class:`Run` opens one (header and index verified) and checks its rows a block at a time
when they are first read.

Run file (``RUN``): a 4 KiB header block (magic ``DCXRUN01``, version, generation, tables, where
the index and the rows are, the block size, crc32c); the **index** (per table: name, row size,
rows, tombstones, where its rows start; then every table's ids and tombstones, sorted int64; then
one crc32c per 4 KiB block of the rows; a crc32c of all of it); the rows, packed, table after
table, from a page-aligned offset.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from crc32c import crc32c as _crc32c

from .arena import PAGE, Arena, adjacent_runs, page_round, will_need
from . import fileio
from .durable import pwrite_all, raise_if_full
from .errors import PoolCorruptError
from .records import copy_rows, crc32c_extend, row_words

__all__ = ["Run", "RunTable", "RunCorruptError", "Gathered", "write_run", "RUN_MAGIC", "RUN_VERSION", "BLOCK", "HEAD", "ENTRY"]

RUN_MAGIC = b"DCXRUN01"
RUN_VERSION = 1
BLOCK = 4096                      # rows are verified this much at a time
BULK_ROWS = 1024                  # Run.rows(bulk=True): from this many rows, large direct reads
SPAN = 1 << 20                    # ... of at most this many bytes
GAP_BLOCKS = 24                   # ... reading through gaps of up to this many blocks (~15 us a request, 0.6 a block)
HEAD = struct.Struct("<8sIIQQQQQI")   # magic, version, tables, gen, index off, index len, data off, data len, block
ENTRY = struct.Struct("<HIQQQ")       # name length, row bytes, rows, tombstones, rows' start in the data


class RunCorruptError(PoolCorruptError):
    """A run file of the row overlay, or its manifest, is damaged, truncated or missing."""

    exit_code = 4
    default_hint = "the pool's row overlay (runs/) is damaged; restore the pool from a copy (nothing was changed)"


class Gathered:
    """The rows ``src[index]`` (``src`` ``[n, row bytes]`` uint8), not copied out: a table's rows
    for a run being planned. :func:`write_run` gathers them a slice at a time into its staging
    buffer. Why: a compaction on `kaggle` behind a DRAM cache keeps ~200 MB of its newest rows for
    its run; copied out whole first, they were ~50k fresh pages to fault in (~0.1 s of the
    compactor's CPU on this VM, ~2 us a page) and 200 MB more at the compaction's peak."""

    SLICE = 1 << 20   # bytes gathered at a time (in the CPU's cache until copied on)

    def __init__(self, src: torch.Tensor, index: torch.Tensor):
        self.src, self.index = src, index

    @property
    def shape(self) -> tuple[int, int]:
        return (self.index.numel(), self.src.shape[1])

    def numel(self) -> int:
        return self.index.numel() * self.src.shape[1]

    def select(self, positions: torch.Tensor) -> torch.Tensor:
        """Rows ``positions`` of these, copied (``[k, row bytes]`` uint8)."""
        return row_words(self.src).index_select(0, self.index.index_select(0, positions)).view(torch.uint8)

    def tensor(self) -> torch.Tensor:
        """All of them, copied."""
        return row_words(self.src).index_select(0, self.index).view(torch.uint8)

    def copy_into(self, dst: torch.Tensor, places: torch.Tensor) -> None:
        """Row ``i`` of these into ``dst[places[i]]`` (``dst`` ``[m, row bytes]`` uint8), a slice
        at a time (:meth:`slices`): the rows gathered stay in the CPU's cache until they are
        copied on."""
        rb, at = self.src.shape[1], 0
        for chunk in self.slices():
            rows = torch.from_numpy(chunk).view(-1, rb)
            copy_rows(dst, places[at:at + rows.shape[0]], rows)
            at += rows.shape[0]

    def slices(self):
        """The rows in order, as uint8 numpy arrays of about :data:`SLICE` bytes, each valid
        until the next is made (one buffer, reused)."""
        rb = self.src.shape[1]
        per = max(1, self.SLICE // rb)
        words = row_words(self.src)
        buf = torch.empty(min(per, self.index.numel()), words.shape[1], dtype=words.dtype)
        for a in range(0, self.index.numel(), per):
            idx = self.index[a:a + per]
            out = buf[:idx.numel()]
            torch.index_select(words, 0, idx, out=out)
            yield out.view(torch.uint8).view(-1).numpy()


def rows_of(part) -> torch.Tensor:
    """A run table's rows as one tensor (a :class:`Gathered` copied out)."""
    return part.tensor() if isinstance(part, Gathered) else part


@dataclass
class RunTable:
    row_bytes: int
    ids: torch.Tensor      # sorted, distinct int64: the rows this run holds a value of
    tombs: torch.Tensor    # sorted, distinct int64: rows whose older run values no longer count
    start: int             # byte offset of its rows in the run's data


@dataclass
class Run:
    """One run file, opened: header and index verified, rows mapped (verified per block when
    read). ``slot``: its number in ``where`` (1..MAX_RUNS)."""

    path: Path
    gen: int
    nbytes: int
    tables: dict[str, RunTable]
    data: torch.Tensor | None          # uint8 over the mapped rows
    crcs: np.ndarray                   # crc32c per BLOCK of the rows
    verified: np.ndarray = field(repr=False, default=None)
    slot: int = 0
    _mm: mmap.mmap | None = field(repr=False, default=None)
    window: Arena | None = field(repr=False, default=None)   # mapped there (an open's runs), at wbase
    wbase: int = 0
    data_off: int = 0                  # where the rows start in the file (page-aligned)
    gblock: int = 0                    # (an open's runs: its first block in the overlay's "verified")
    # Blocks asked for (``will_need``) since the run's pages were last dropped (``drop_cache``):
    # advice only, so a race that loses a mark costs a request, one that keeps a stale mark a
    # synchronous fault later -- never a wrong value.
    advised: np.ndarray = field(repr=False, default=None)

    def __post_init__(self):
        for name in ("verified", "advised"):   # (a bool a block; an open's runs get views of one array)
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(len(self.crcs), dtype=bool))

    @classmethod
    def open(cls, path: Path, window: Arena | None = None) -> "Run":
        """``window``: map the rows there (at the next free offset) instead of on their own."""
        fd = _open_run(path)
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, HEAD.size + 4, 0)
            if len(head) != HEAD.size + 4 or head[:8] != RUN_MAGIC:
                raise RunCorruptError(f"run {path}: not a run file, or its header is truncated")
            if crc32c_extend(0, head[:HEAD.size]) != struct.unpack_from("<I", head, HEAD.size)[0]:
                raise RunCorruptError(f"run {path}: header fails its checksum")
            _, version, ntables, gen, ioff, ilen, doff, dlen, block = HEAD.unpack_from(head)
            if version != RUN_VERSION or block != BLOCK:
                raise RunCorruptError(f"run {path}: version {version}, block {block}: not one this dlrm-cxl writes")
            if size < doff + dlen or ioff + ilen > doff or ilen < 4:
                raise RunCorruptError(f"run {path}: {size} bytes, its header says {doff + dlen}: truncated")
            index = bytearray(ilen)
            got = os.preadv(fd, [index], ioff)
            if got != ilen or crc32c_extend(0, memoryview(index)[:-4]) != struct.unpack_from("<I", index, ilen - 4)[0]:
                raise RunCorruptError(f"run {path}: index fails its checksum")
            tables = _parse_index(path, index, ntables, dlen)
            nblocks = -(-dlen // BLOCK)
            crcs = np.frombuffer(index, dtype=np.uint32, count=nblocks, offset=ilen - 4 - 4 * nblocks)
            mm, wbase = None, (window.used if window is not None else 0)   # (the bases stay in order)
            if dlen and window is not None:
                wbase = window.place(dlen)
                window.map_file(wbase, fd, dlen, shared=True, writable=False, file_offset=doff)
                data = window.tensor(wbase, dlen, torch.uint8)
            elif dlen:
                mm = mmap.mmap(fd, dlen, mmap.MAP_SHARED, mmap.PROT_READ, offset=doff)
                data = torch.frombuffer(mm, dtype=torch.uint8)
            else:
                data = torch.empty(0, dtype=torch.uint8)
        finally:
            os.close(fd)
        return cls(path, gen, size, tables, data, crcs, _mm=mm, window=window if mm is None and dlen else None,
                   wbase=wbase, data_off=doff)

    def rows(self, name: str, ids: torch.Tensor, *, bulk: bool = False) -> torch.Tensor:
        """The values of rows ``ids`` (sorted or not, all held by this run's table ``name``) as
        ``[n, row_bytes]`` uint8, their blocks verified first. ``bulk`` (a compaction's reads):
        at least :data:`BULK_ROWS` rows are read from the file in large direct reads
        (:meth:`_read_rows`), not faulted in a page at a time."""
        t = self.tables[name]
        pos = torch.searchsorted(t.ids, ids)
        rb = t.row_bytes
        off = t.start + pos * rb
        if bulk and ids.numel() >= BULK_ROWS:
            return self._read_rows(off.numpy(), rb)
        blocks = torch.cat([off // BLOCK, (off + rb - 1) // BLOCK])
        self.will_need(blocks)
        self.verify(blocks)
        return self.data[t.start:t.start + t.ids.numel() * rb].view(-1, rb).index_select(0, pos)

    def _read_rows(self, off: np.ndarray, rb: int) -> torch.Tensor:
        """Rows of ``rb`` bytes at data offsets ``off`` (one table's, so all ``rb`` apart modulo
        ``rb``; any order), read from the file in spans of at most :data:`SPAN` bytes (gaps of up to
        :data:`GAP_BLOCKS` blocks read through), with ``O_DIRECT`` where the file system allows
        it; each block verified from what was read. Nothing goes through the page cache (the
        DRAM budget counts it, and a trim would drop it again), except where ``O_DIRECT`` is
        refused (tmpfs before Linux 6.6, many FUSE file systems): there the reads are ordinary.

        Why: a compaction behind a DRAM cache reads the rows it carries home or moves on from
        runs whose pages every trim dropped, 80-170k rows on `kaggle` at the runs' bound, each
        alone in its 4 KiB page of the runs. On this 2-core VM a page read costs 13-20 us of the
        machine's CPU however it is asked for (a fault after ``MADV_WILLNEED``, a ``pread``: the
        cost is the request), and a 1 MiB direct read ~160 us (0.6 us a block):
        ``tools/bench_run_reads.py``. Read through, a span's unneeded blocks cost less than the
        requests they save."""
        if off.size > 1 and bool((off[1:] < off[:-1]).any()):   # (in the order asked for)
            order = np.argsort(off, kind="stable")
            out = torch.empty(off.size, rb, dtype=torch.uint8)
            out[torch.from_numpy(order)] = self._read_rows(off[order], rb)
            return out
        out = torch.empty(off.size, rb, dtype=torch.uint8)
        if not off.size:
            return out
        dlen = self.data.numel()
        lo, hi = off // BLOCK, (off + rb - 1) // BLOCK
        # Spans: a new one where a gap of more than GAP_BLOCKS blocks begins, and every
        # SPAN bytes within a stretch without one (a row belongs to the span its first block is
        # in; a span reads to its rows' last block).
        brk = np.empty(off.size, dtype=bool)
        brk[0] = True
        np.greater(lo[1:] - hi[:-1], GAP_BLOCKS, out=brk[1:])
        stretch = np.cumsum(brk) - 1
        key = stretch * (dlen // BLOCK + 2) + (lo - lo[brk][stretch]) // (SPAN // BLOCK)
        starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
        ends = np.append(starts[1:], off.size)
        last = np.maximum.reduceat(hi, starts)
        # (page-aligned, as O_DIRECT wants; as large as the largest span, not SPAN for a few rows)
        buf = mmap.mmap(-1, page_round(int((last - lo[starts]).max() + 1) * BLOCK))
        view = torch.frombuffer(buf, dtype=torch.uint8)
        raw = memoryview(buf)
        fd = _open_run(self.path)
        try:
            fileio.set_direct(fd, True)   # (refused on tmpfs: read through its page cache)
            for a, e, hb in zip(starts.tolist(), ends.tolist(), last.tolist()):
                lb = int(lo[a])
                n = min((hb + 1) * BLOCK, dlen) - lb * BLOCK
                got = os.preadv(fd, [raw[:page_round(n)]], self.data_off + lb * BLOCK)
                if got < n:
                    raise RunCorruptError(f"run {self.path}: {got} bytes at byte {lb * BLOCK} of its data, "
                                          f"{n} expected: truncated")
                self._check(raw, np.unique(np.concatenate([lo[a:e], hi[a:e]])), lb)
                rel = off[a:e] - lb * BLOCK
                shift = int(rel[0]) % rb
                m = (n - shift) // rb
                torch.index_select(view[shift:shift + m * rb].view(m, rb), 0,
                                   torch.from_numpy((rel - shift) // rb), out=out[a:e])
        finally:
            os.close(fd)
            del view
        return out

    def will_need(self, blocks: torch.Tensor) -> int:
        """Ask for the pages of data blocks ``blocks`` (indexes, any order) at once: one
        ``MADV_WILLNEED`` per run of adjacent blocks, so that the checksums and copies that
        follow fault on reads already in flight, many at a time, not on one synchronous read
        after another. A run's pages are dropped from the page cache at every trim and refresh
        behind a DRAM cache (``Overlay.drop_cache``), and a resumed `kaggle` run read its pending
        rows back that way: its prefetch thread spent ~10 of its 42 s in 100 steps faulting
        them in (py-spy). Only the blocks not asked for since the last :meth:`drop_cache`
        (``advised``): a request for pages already cached is a system call and a page-cache
        walk for nothing, and asking again for every block a batch read cost a resumed
        `kaggle` run's prefetch thread 649k calls and 11 s of CPU in 300 steps. Returns the
        requests made."""
        n = self.data.numel() if self.data is not None else 0
        if not n or not blocks.numel():
            return 0
        todo = torch.unique(blocks).numpy()
        todo = todo[~self.advised[todo]]
        if not todo.size:
            return 0
        self.advised[todo] = True
        starts, ends = adjacent_runs(torch.from_numpy(todo))
        base = self.data.data_ptr()   # (page-aligned: the rows start on a page of the file and of the window)
        for a, e in zip(starts, ends):
            will_need(base + a * BLOCK, min((e + 1) * BLOCK, n) - a * BLOCK)
        return len(starts)

    def verify(self, blocks: torch.Tensor | None = None) -> None:
        """Check the crc32c of ``blocks`` (indexes; None: all) that were not checked yet."""
        todo = np.arange(len(self.crcs)) if blocks is None else np.unique(blocks.numpy())
        if todo.size:
            self._check(memoryview(self.data.numpy()), todo, 0)

    def _check(self, raw: memoryview, blocks: np.ndarray, first: int) -> None:
        """Check the crc32c of data blocks ``blocks`` (sorted indexes) not checked yet, whose
        bytes are in ``raw`` from block ``first`` on (the mapping's, or a bulk read's buffer)."""
        todo = blocks[~self.verified[blocks]]
        dlen = self.data.numel()
        for b, c in zip(todo.tolist(), self.crcs[todo].tolist()):
            at = (b - first) * BLOCK
            # (the C function on a memoryview slice: ~1 us a block, a third of crc32c_extend's wrapper)
            if _crc32c(raw[at:at + min(BLOCK, dlen - b * BLOCK)], 0, 0) != c:
                raise RunCorruptError(f"run {self.path}: rows at byte {b * BLOCK} of its data fail their checksum "
                                      f"(bit flip or foreign write)")
        self.verified[todo] = True

    def entries(self) -> int:
        return sum(t.ids.numel() for t in self.tables.values())

    def drop_cache(self) -> None:
        """Unmap this run's pages where they are and drop them from the page cache: rows read
        from it later fault in again (its bytes are durable: nothing is written)."""
        n = self.data.numel() if self.data is not None else 0
        if not n:
            return
        self.advised[:] = False   # (before the drop: a request racing it asks again, harmlessly)
        if self.window is not None:
            self.window.drop_pages(self.wbase, n)
        elif self._mm is not None:
            self._mm.madvise(mmap.MADV_DONTNEED)
        _fadvise_dontneed(self.path)

    def close(self) -> None:
        data, self.data = self.data, None
        if self.window is not None and data is not None:
            n = data.numel()
            del data
            self.window.release(self.wbase, n)   # (its blocks freed once the file is deleted)
            self.window = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):   # (a view still held: unmapped when it goes)
                self._mm.close()
            self._mm = None


def _parse_index(path: Path, index: bytearray, ntables: int, dlen: int) -> dict[str, RunTable]:
    try:
        p = 0
        entries = []
        for _ in range(ntables):
            entries.append(ENTRY.unpack_from(index, p))
            p += ENTRY.size
        names = []
        for nlen, *_ in entries:
            names.append(bytes(index[p:p + nlen]).decode())
            p += nlen
        p = -(-p // 8) * 8
        out = {}
        end = 0
        for name, (_, rb, n, nt, start) in zip(names, entries):
            # (views of the index buffer, which they keep alive: no copy of 8 bytes a row)
            ids = torch.frombuffer(index, dtype=torch.int64, count=n, offset=p) if n else \
                torch.empty(0, dtype=torch.int64)
            p += 8 * n
            tombs = torch.frombuffer(index, dtype=torch.int64, count=nt, offset=p) if nt else \
                torch.empty(0, dtype=torch.int64)
            p += 8 * nt
            if ids.numel() != n or tombs.numel() != nt or rb < 1 or start != end:
                raise ValueError(f"table {name!r}: its entry does not match its ids")
            end = start + n * rb
            out[name] = RunTable(rb, ids, tombs, start)
        if end != dlen:
            raise ValueError(f"its tables hold {end} bytes of rows, its header says {dlen}")
        return out
    except (struct.error, ValueError, UnicodeDecodeError, RuntimeError) as exc:
        raise RunCorruptError(f"run {path}: index is malformed ({exc})") from None


def write_run(path: Path, gen: int, tables: dict[str, tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]], *,
              direct: bool = True) -> int:
    """Write a run: ``tables[name] = (row bytes, ids sorted, rows [n, row bytes] uint8 or a
    :class:`Gathered`, tombstones sorted)``, durably (fdatasync; its directory entry is made durable by the manifest's write).
    Returns the file's size.

    ``direct``: written with ``O_DIRECT`` through a page-aligned staging buffer, each block's
    checksum taken there (:func:`_write_direct`), where the file system allows it; otherwise, or
    with ``direct=False``, through the page cache. The bytes on disk are the same either way."""
    names = list(tables)
    starts, at = [], 0
    for n in names:
        rb, ids, _, _ = tables[n]
        starts.append(at)
        at += ids.numel() * rb
    dlen = at
    nblocks = -(-dlen // BLOCK)
    fixed = ENTRY.size * len(names) + sum(len(n.encode()) for n in names)
    ilen = -(-fixed // 8) * 8 + sum(8 * (tables[n][1].numel() + tables[n][3].numel()) for n in names) + 4 * nblocks + 4
    ioff = PAGE
    doff = page_round(ioff + ilen)
    rows = [tables[n][2] for n in names]
    fd = fileio.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            fileio.ftruncate(fd, doff + dlen)   # (its size whatever its last part: a run of tombstones has no rows)
            crcs = _write_direct(fd, rows, doff, dlen) if direct else None
            direct = crcs is not None   # (the rows went direct: so do the header and index)
            if not direct:
                rows = [rows_of(r) for r in rows]
                for r, start in zip(rows, starts):
                    if r.numel():
                        pwrite_all(fd, r.contiguous().numpy(), doff + start)
                # The rows' checksums, a block at a time, from the rows as written (a block may
                # span two tables: its crc continues across them).
                crcs = _block_crcs(rows)
            crcs = np.array(crcs, dtype=np.uint32)
            assert crcs.size == nblocks
            parts = [ENTRY.pack(len(n.encode()), tables[n][0], tables[n][1].numel(), tables[n][3].numel(), s)
                     for n, s in zip(names, starts)]
            parts += [n.encode() for n in names]
            index = b"".join(parts)
            index += bytes(-len(index) % 8)
            index += b"".join(tables[n][1].to(torch.int64).numpy().tobytes() + tables[n][3].to(torch.int64).numpy().tobytes()
                              for n in names)
            index += crcs.tobytes()
            index += struct.pack("<I", crc32c_extend(0, index))
            assert len(index) == ilen
            head = HEAD.pack(RUN_MAGIC, RUN_VERSION, len(names), gen, ioff, ilen, doff, dlen, BLOCK)
            head += struct.pack("<I", crc32c_extend(0, head))
            if direct:
                # The header page and the index, padded to the rows' page: one aligned write.
                with _aligned(doff) as buf:
                    buf[:len(head)] = np.frombuffer(head, dtype=np.uint8)
                    buf[ioff:ioff + ilen] = np.frombuffer(index, dtype=np.uint8)
                    pwrite_all(fd, buf, 0)
            else:
                pwrite_all(fd, index, ioff)
                pwrite_all(fd, head, 0)
            fileio.fdatasync(fd)
            # (its pages are clean now: out of the page cache, which a DRAM cache's budget
            # counts; its rows are read back a page at a time, if ever. The direct path too: its
            # cut back to a size inside a page brought that last page in, to zero its tail)
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return doff + dlen
        except OSError as exc:
            raise_if_full(exc, f"writing run {path}")
    except BaseException:
        fileio.close(fd)
        fd = -1
        try:
            fileio.unlink(path)
        except OSError:
            pass
        raise
    finally:
        if fd >= 0:
            fileio.close(fd)


STAGE = 8 << 20   # the direct writes' staging buffer (a multiple of BLOCK and of the page)


def _write_direct(fd: int, parts: list, at: int, total: int) -> list[int] | None:
    """Write the concatenated ``parts`` (uint8 tensors, ``total`` bytes) at ``at`` (page-aligned)
    with ``O_DIRECT``, through a page-aligned staging buffer, and return the crc32c of every
    BLOCK, taken from the buffer while it is in the CPU's cache. None, nothing written and the
    descriptor as it was, where the file system refuses ``O_DIRECT``.

    Why: through the page cache a compaction's run (~200 MB on `kaggle` behind a DRAM cache)
    cost the compactor's thread the copy into new page-cache pages, their write-back and their
    eviction again (``POSIX_FADV_DONTNEED``: the budget counts the page cache) -- 0.3-0.5 s of
    CPU a compaction, where the copy into the staging buffer is ~30 ms. A last partial block is
    written padded with zeros (direct writes are whole blocks) and the file cut back to its size
    after: ``write_run`` syncs after that."""
    if not total or not fileio.set_direct(fd, True):
        return None
    try:
        crcs: list[int] = []
        with _aligned(min(STAGE, page_round(total))) as stage:
            mv = memoryview(stage)
            fill = off = 0
            for src in _pieces(parts):
                pos = 0
                while pos < src.size:
                    n = min(src.size - pos, stage.size - fill)
                    stage[fill:fill + n] = src[pos:pos + n]
                    fill, pos = fill + n, pos + n
                    if fill == stage.size:
                        crcs.extend([_crc32c(mv[i:i + BLOCK], 0, 0) for i in range(0, fill, BLOCK)])
                        pwrite_all(fd, mv, at + off)
                        off, fill = off + fill, 0
            if fill:
                crcs.extend([_crc32c(mv[i:min(i + BLOCK, fill)], 0, 0) for i in range(0, fill, BLOCK)])
                whole = page_round(fill)
                stage[fill:whole] = 0
                pwrite_all(fd, mv[:whole], at + off)
                if whole > fill:
                    fileio.ftruncate(fd, at + total)   # (the padding past the rows goes)
            mv.release()
        return crcs
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        # (a file system that takes the flag but not the write: through the page cache, from
        # the start -- every byte is written again)
        fileio.set_direct(fd, False)
        return None


def _pieces(parts: list):
    """The bytes of ``parts`` (tensors, or :class:`Gathered`) in order, as uint8 numpy arrays."""
    for t in parts:
        if isinstance(t, Gathered):
            yield from t.slices()
        else:
            yield t.contiguous().view(-1).view(torch.uint8).numpy()


@contextlib.contextmanager
def _aligned(nbytes: int):
    """A page-aligned, zeroed uint8 array of ``nbytes`` (anonymous memory, unmapped after)."""
    m = mmap.mmap(-1, page_round(nbytes))
    try:
        a = np.frombuffer(m, dtype=np.uint8)[:nbytes]
        yield a
        del a
    finally:
        with contextlib.suppress(BufferError):
            m.close()


def _block_crcs(parts: list) -> list[int]:
    """The crc32c of every BLOCK of the concatenated ``parts`` (tensors; the last block may be
    short). The whole blocks inside a part take one C call each and nothing else of Python's
    (a slice of a memoryview): the compactor's thread holds the GIL for its loop, and every
    Python operation of it may keep the trainer's thread waiting for the GIL (~0.4 s for a
    `kaggle` compaction's 51k blocks as a loop of numpy slices and ``crc32c_extend`` calls)."""
    crcs: list[int] = []
    fill = crc = 0
    for t in parts:
        if not t.numel():
            continue
        mv = memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()).cast("B")
        pos = 0
        if fill:  # (a block that spans two parts: its crc continues into this one)
            pos = min(BLOCK - fill, len(mv))
            crc, fill = crc32c_extend(crc, mv[:pos]), fill + pos
            if fill < BLOCK:
                continue
            crcs.append(crc)
            fill = crc = 0
        whole = pos + (len(mv) - pos) // BLOCK * BLOCK
        crcs.extend([_crc32c(mv[i:i + BLOCK], 0, 0) for i in range(pos, whole, BLOCK)])
        if whole < len(mv):
            crc, fill = crc32c_extend(0, mv[whole:]), len(mv) - whole
    if fill:
        crcs.append(crc)
    return crcs


def _open_run(path: Path) -> int:
    """A read-only descriptor of the run at ``path``; one the manifest names and the directory
    lacks is damage (RunCorruptError), as at open."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise RunCorruptError(f"run {path} is missing (its manifest names it)") from None


def _fadvise_dontneed(path: Path) -> None:
    """``POSIX_FADV_DONTNEED`` on the whole file at ``path`` (clean pages leave the page cache)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
