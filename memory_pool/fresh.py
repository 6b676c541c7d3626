"""Rows never written since their table was initialised: created on a miss, not read.

A DRAM cache in front of a table larger than DRAM (``memory_pool/cache_arena.py``) reads every
missed row from the table's home. On Criteo-like ids most misses of a run's first hundreds of
steps are rows no step has trained yet (measured on `kaggle`: 95 % of the misses of steps 1-30,
65 % of steps 271-300), whose value is still their initial one. Since a row's initial value is a
hash of ``(seed, row, column)`` (``memory_pool/initializers.py``, version 2), such a row is
*created* in its slot instead (HierarchicalKV's and Monolith's tables do the same on a first
lookup): no device read.

**What a bitmap says.** One bit per row of a table, set while the row's value *in every state the
pool can come back in* is its initial value. The one rule that keeps it true: a bit is cleared
before the row can change -- when a cache admits the row (whatever it does with it later), and
on every write path of a table (``Table.write``, ``scatter_rows``, ``restore_raw``,
``mark_dirty``, a bulk load: ``TableHost.written``). A table whose memory is handed out for
writing without a cache in front (``Table.view``, ``MemoryPool.arena_tensor``: the uncached fused
kernels write the arena directly) loses its bitmap (:meth:`FreshRows.exposed`), unless a cache
arena has claimed it (:meth:`FreshRows.claim`: then every row the kernels touch was admitted
first). A cleared bit is never wrong, only slower: the row is read, and its home holds the
initial value too (the initialisation wrote every row).

**Durability: a file, ``<storage>/fresh.bits``** (temporary name, fsync, rename, fsync the
directory: a power loss leaves the old file or the new one). Its rule: **every row that a
durable state the pool can come back in holds with a value other than its initial one is
either cleared in the file, or in a journal record the next open replays** -- which then clears
it (``Replayer.start``). Two regimes:

* **Journaled tiers (emulated pmem, power-sim): the file is kept while the pool is open.**
  There every change reaches the images or the runs through the journal's committed records
  (a compaction, a write-back pass, a refresh: committed values only), or through a bulk load.
  So the file is saved again (:meth:`FreshRows.save`, from memory, where every row was cleared
  before it changed) before the journal's START moves (``Compaction.compact``), before the
  applied mark moves (``Compaction.apply``: an open after a crash of the trainer replays only
  what follows it), at a writer's first transaction or persist (a pool made by this process
  has none yet: ``TableSet.save_fresh(once=True)``) and at a clean close; the open clears the
  rows of every record it replays; and a bulk load removes the file, durably, before it writes
  the image (:meth:`FreshRows.written` with no ids). A crash or a power loss then comes back
  with the file and creates the rows it may: on `kaggle` behind the cache, after a SIGKILL,
  ~2/3 of a replayed step's misses.
* **Direct tiers (shm, real pmem): a clean-shutdown file.** Rows change in place there, and
  nothing lists them durably, so a writer's open reads the file and **removes it, durably,
  before anything can change**: a crash comes back with no file, and every row is read from its
  home until the next clean close (correct, as before this file existed).

A save that fails (a full disk) removes the file instead, which is always correct.

Only tables made with initializer version 2 have a bitmap (their header entry records the
initializer: ``MemoryPool.create_table``); a table of an older pool is always read.
"""

from __future__ import annotations

import json
import struct
import threading
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import fileio
from .durable import atomic_write, fsync_dir, json_crc_ok, json_with_crc
from .errors import DlrmCxlError
from .initializers import INIT_VERSION, uniform_rows

__all__ = ["FRESH_FILE", "InitSpec", "FreshGroup", "FreshRows"]

FRESH_FILE = "fresh.bits"
_MAGIC = b"DLRMFRS1"
_HEAD = struct.Struct("<8sI")   # magic, length of the JSON that follows (then the bitmaps)


@dataclass(frozen=True)
class InitSpec:
    """How a table was initialised: ``kind`` ``"uniform"`` (in ``[-scale, scale)`` from
    ``seed``) or ``"zeros"``, by initializer ``version``. Recorded in the pool's header."""

    kind: str
    seed: int = 0
    scale: float = 0.0
    version: int = INIT_VERSION

    def fill(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """The initial values of ``rows`` (int64) written into ``out`` (``[rows, dim]`` float32,
        contiguous)."""
        if self.kind == "zeros":
            out.zero_()
        else:
            uniform_rows(self.seed, rows.numpy(), out.shape[1], self.scale, out=out.numpy())

    def fill_at(self, rows: torch.Tensor, slots: torch.Tensor, at: torch.Tensor) -> None:
        """The initial values of ``rows`` (int64) written into rows ``at`` of ``slots``
        (``[slots, dim]`` float32, contiguous): no temporary, no scatter."""
        if self.kind == "zeros":
            slots.index_fill_(0, at, 0.0)
        else:
            uniform_rows(self.seed, rows.numpy(), slots.shape[1], self.scale, out=slots.numpy(), at=at.numpy())

    def values(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        """The initial float32 values of ``rows`` (int64), ``[rows, dim]``."""
        out = torch.empty(rows.numel(), dim, dtype=torch.float32)
        self.fill(rows, out)
        return out

    @classmethod
    def from_dict(cls, d) -> "InitSpec | None":
        """The spec a header entry records, or None when it is not one this version can create
        rows from (an older initializer, an unknown kind, a damaged entry)."""
        try:
            spec = cls(str(d["kind"]), int(d.get("seed", 0)), float(d.get("scale", 0.0)), int(d["version"]))
        except (KeyError, TypeError, ValueError):
            return None
        return spec if spec.version == INIT_VERSION and spec.kind in ("uniform", "zeros") else None


def _bits_of(rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    r = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows, dtype=np.int64)
    return r >> 3, (np.uint8(1) << (r & 7).astype(np.uint8))


class FreshGroup:
    """A cache arena group's view of its bitmap (shared by its member tables: a row is created
    only when every member's value is still initial). ``take`` and ``values`` are called by
    ``CacheArena._admit`` under its lock."""

    def __init__(self, lock: threading.Lock, bits: np.ndarray, specs: list[InitSpec], dims: list[int]):
        self._lock, self._bits, self._specs, self._dims = lock, bits, specs, dims

    def take(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Which of ``rows`` (sorted, distinct, int64) are fresh, as a bool mask (None: none
        is); their bits are cleared now, before the caller may change them."""
        byte, bit = _bits_of(rows)
        with self._lock:
            hit = (self._bits[byte] & bit) != 0
            if not hit.any():
                return None
            np.bitwise_and.at(self._bits, byte[hit], ~bit[hit])
        return torch.from_numpy(hit)

    def create(self, member: int, rows: torch.Tensor, slots: torch.Tensor, at: torch.Tensor) -> None:
        """Member ``member``'s initial values of ``rows`` written into ``slots`` (``[slots,
        dim]``) at ``at`` (sorted, distinct), in place: no temporary and no scatter (~1.3 ms a
        batch of the prefetch thread's CPU on `kaggle`, whose ~3,000 rows a batch are mostly new
        for its first thousands of steps, before the C hash: ``memory_pool/_rowhash.c``)."""
        n = at.numel()
        if n and int(at[-1]) - int(at[0]) + 1 == n:
            self._specs[member].fill(rows, slots[int(at[0]):int(at[0]) + n])
        elif n:
            self._specs[member].fill_at(rows, slots, at)


class FreshRows:
    """The pool's bitmaps, per table name (see the module). Tables that share one (a cache
    group's members) point to the same array."""

    def __init__(self):
        self._lock = threading.Lock()
        self._bits: dict[str, np.ndarray] = {}
        self._rows: dict[str, int] = {}
        self._specs: dict[str, InitSpec] = {}
        self._claimed: set[str] = set()
        self.note = ""   # why a file found at open was not used, if it was not
        self.loaded = False   # read from a file found at open, intact (load)
        # A journaled pool's file, kept while the pool is open (see the module): its path, and
        # whether a bitmap was zeroed wholesale since it was last saved.
        self._kept: Path | None = None

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in {id(b): b for b in self._bits.values()}.values())

    def add(self, name: str, rows: int, spec: InitSpec, bits: np.ndarray | None = None) -> None:
        """Table ``name`` was just created and initialised: every row fresh (or those of
        ``bits``, packed little-endian, 1 fresh: a file's, :meth:`load`)."""
        if bits is None:
            bits = np.full((rows + 7) // 8, 0xFF, dtype=np.uint8)
            if rows % 8:
                bits[-1] = (1 << (rows % 8)) - 1
        with self._lock:
            self._bits[name], self._rows[name], self._specs[name] = bits, rows, spec

    def count(self, name: str) -> int:
        """Rows of ``name`` known to be at their initial value (0 without a bitmap)."""
        b = self._bits.get(name)
        return 0 if b is None else int(np.unpackbits(b).sum())

    def initial(self, name: str, lo: int, hi: int) -> tuple[np.ndarray, InitSpec] | None:
        """Which of rows ``lo..hi-1`` of ``name`` still hold their initial value (a bool mask
        over the range) and how to make it; None where the table keeps no bitmap or none of
        them does (``Table.snapshot``: such a row is made, not read)."""
        with self._lock:
            bits = self._bits.get(name)
            if bits is None or hi <= lo:
                return None
            got = np.unpackbits(bits[lo >> 3:(hi + 7) >> 3], bitorder="little")
            spec = self._specs[name]
        mask = got[lo & 7:(lo & 7) + hi - lo].view(bool)
        return (mask, spec) if mask.any() else None

    def written(self, name: str, ids: torch.Tensor | None = None) -> None:
        """Rows ``ids`` of ``name`` (None: any of them: a bulk load) are about to change."""
        with self._lock:
            if ids is None and self._kept is not None:
                # A bulk load writes the image itself, not through the journal: no replay plan
                # clears its rows at the next open, so the kept file must not outlive it
                # (removed durably before a row of the image changes; the next save writes one
                # without the table). Whether or not a bitmap is in memory: the file may hold
                # one that was dropped since (claim).
                _remove_durably(self._kept)
            b = self._bits.get(name)
            if b is None:
                return
            if ids is None:
                b[:] = 0
            elif ids.numel():
                byte, bit = _bits_of(ids.reshape(-1).to(torch.int64))
                np.bitwise_and.at(b, byte, ~bit)

    def exposed(self, name: str | None = None) -> None:
        """The memory of ``name`` (None: of every table) was handed out writable, with no cache
        in front to see which rows change: its bitmap is dropped unless a cache claimed it."""
        with self._lock:
            for n in [name] if name is not None else list(self._bits):
                if n in self._bits and n not in self._claimed:
                    self._bits[n][:] = 0

    def claim(self, names: list[str], dims: list[int]) -> FreshGroup | None:
        """A cache arena's group of tables ``names`` (weights first, then their optimizer
        state; widths ``dims``) admits every row it serves from now on: one bitmap for them all,
        a row fresh in every one. None when one of them has none (then none of them keeps one:
        the arena will change their rows without clearing bits)."""
        with self._lock:
            if any(n not in self._bits for n in names):
                for n in names:
                    self._bits.pop(n, None)
                return None
            bits = self._bits[names[0]]
            if any(self._bits[n] is not bits for n in names):  # (claimed again: the same array kept)
                bits = bits.copy()
                for n in names[1:]:
                    np.bitwise_and(bits, self._bits[n], out=bits)
            for n in names:
                self._bits[n] = bits
                self._claimed.add(n)
            return FreshGroup(self._lock, bits, [self._specs[n] for n in names], list(dims))

    @property
    def any(self) -> bool:
        """Some table has a bitmap."""
        return bool(self._bits)

    @property
    def kept(self) -> bool:
        """The file is kept while the pool is open (a journaled tier's writer: see the module)."""
        return self._kept is not None

    def keep(self, storage_dir: Path) -> None:
        """From now on the file stays while the pool is open and is saved again (:meth:`save`)
        before anything durable moves past a row change it does not show."""
        self._kept = Path(storage_dir) / FRESH_FILE

    # -- the file
    def save(self, storage_dir: Path, pool_id: str) -> bool:
        """Write the bitmaps that still have a fresh row to ``storage_dir/fresh.bits``, durably
        (``atomic_write``); with none, remove the file (durably). A failure (a full disk)
        removes the file, which is always correct; raises only if that fails too (the file
        then says rows are fresh that a durable record no longer lists). Returns whether a file
        was written."""
        path = Path(storage_dir) / FRESH_FILE
        try:
            return self._save(path, pool_id)
        except (OSError, DlrmCxlError):  # (a full disk comes as PoolFullError: durable.raise_if_full)
            _remove_durably(path)
            return False

    def _save(self, path: Path, pool_id: str) -> bool:
        with self._lock:
            keep = [(n, b) for n, b in self._bits.items() if b.any()]
            tables, blobs = [], []
            for n, b in keep:
                tables.append({"name": n, "rows": self._rows[n], "init": asdict(self._specs[n]),
                               "bytes": b.nbytes, "crc32": zlib.crc32(b.tobytes())})
                blobs.append(b.tobytes())
        if not tables:
            if path.exists():  # (every removal is durable: one not there needs no sync)
                _remove_durably(path)
            return False
        doc = json_with_crc({"pool_id": pool_id, "tables": tables})  # (the header's own checksummed JSON)
        atomic_write(path, _HEAD.pack(_MAGIC, len(doc)) + doc + b"".join(blobs))
        return True

    @classmethod
    def load(cls, storage_dir: Path, pool_id: str, tables: dict[str, int], specs: dict[str, InitSpec], *,
             remove: bool = True, keep: bool = False) -> "FreshRows":
        """An open: the bitmaps the last clean close left, for the tables that still match
        (``tables``: rows per name; ``specs``: their header's initializers); with ``remove`` (a
        writer's open) the file removed durably before the pool can change (see the module: a
        crash must come back to no file). A damaged file is not an error -- it only says which
        rows need no read -- it is dropped (a writer's open), and :attr:`note` says why."""
        out = cls()
        if keep:
            out.keep(storage_dir)
        path = Path(storage_dir) / FRESH_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return out
        try:
            magic, n = _HEAD.unpack_from(raw, 0)
            if magic != _MAGIC:
                raise ValueError("wrong magic")
            doc = json.loads(raw[_HEAD.size:_HEAD.size + n])
            if not json_crc_ok(doc):
                raise ValueError("its table list is damaged")
            if doc.get("pool_id") != pool_id:
                raise ValueError(f"written for pool {doc.get('pool_id')!r}")
            off = _HEAD.size + n
            for t in doc["tables"]:
                blob = raw[off:off + int(t["bytes"])]
                off += int(t["bytes"])
                name, rows = t["name"], int(t["rows"])
                if len(blob) != (rows + 7) // 8 or zlib.crc32(blob) != t["crc32"]:
                    raise ValueError(f"table {name!r}'s bitmap is damaged")
                spec = InitSpec.from_dict(t["init"])
                if tables.get(name) == rows and spec is not None and specs.get(name) == spec:
                    out.add(name, rows, spec, np.frombuffer(blob, dtype=np.uint8).copy())
            out.loaded = True
        except (ValueError, KeyError, TypeError, struct.error) as e:
            out = cls()
            out.note = f"{path.name} not used ({e}): every row is read from its home until the next clean close"
        if keep:  # (a journaled tier's writer: the file stays, see the module)
            if out.note:  # (a damaged one, never trusted: no sync needed for its removal)
                fileio.unlink(path, missing_ok=True)
            return out
        if not remove:  # (a reader: the file stays the writer's to take)
            return out
        # Removed, and the removal durable, before the caller may change a row: else a crash
        # (or a power loss undoing the unlink) would bring back bits for rows trained since.
        _remove_durably(path)
        return out


def _remove_durably(path: Path) -> None:
    """``path`` unlinked if it is there, and that durable (its directory synced)."""
    fileio.unlink(path, missing_ok=True)
    fsync_dir(path.parent)
