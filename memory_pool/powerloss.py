"""The power loss that an undo log of ``memory_pool/fileio.py`` describes: the log's format, and
:func:`power_on`, which takes back what was never synced (all of it, a prefix, or random subsets
torn at block granularity). See fileio.py's module doc for the mechanism."""

from __future__ import annotations

import json
import os
import random
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["LOG_DIR", "Lose", "PowerOnReport", "encode_entry", "pending", "power_on", "unsynced_count"]

LOG_DIR = ".power-loss"
_MAGIC = b"PLG1"
_HEAD = struct.Struct("<4sIQI")   # magic, crc32 of the rest, blob bytes, json bytes
_os_open = os.open


def pending(root) -> bool:
    """Whether ``root`` holds an undo log (a process that watched it ended without syncing all)."""
    d = Path(root) / LOG_DIR
    return d.is_dir() and any(d.iterdir())


@dataclass
class Lose:
    """Which of the unsynced operations a power loss takes back (:func:`power_on`).

    ``mode``: ``"all"`` (nothing unsynced reached the disk), ``"prefix"`` (the first ``keep``
    unsynced operations did, in the order they were made, the rest did not), ``"subset"`` (each
    did or did not, drawn with ``seed``; a write may be torn: some of its ``block``-sized blocks
    reached the disk, others not)."""

    mode: str = "all"
    keep: int = 0
    seed: int = 0
    block: int = 4096


@dataclass
class PowerOnReport:
    entries: int = 0        # unsynced operations found
    undone: int = 0         # taken back
    torn: int = 0           # writes taken back in part
    logs: list = field(default_factory=list)


def encode_entry(doc: dict, blob: bytes | memoryview = b"") -> bytes:
    """One entry of the undo log: its header (magic, crc32 of the rest, blob and JSON lengths),
    ``doc`` as JSON, then ``blob`` (what :func:`power_on` reads back, in ``_read_log``)."""
    j = json.dumps(doc, separators=(",", ":")).encode()
    body = j + bytes(blob)
    return _HEAD.pack(_MAGIC, zlib.crc32(body), len(body) - len(j), len(j)) + body


def _read_log(path: Path) -> list[tuple[dict, bytes]]:
    raw = path.read_bytes()
    out, at = [], 0
    while at + _HEAD.size <= len(raw):
        magic, crc, nblob, nj = _HEAD.unpack_from(raw, at)
        end = at + _HEAD.size + nj + nblob
        if magic != _MAGIC or end > len(raw) or zlib.crc32(raw[at + _HEAD.size:end]) != crc:
            break  # a torn last entry (a real power loss): the operation after it never ran
        doc = json.loads(raw[at + _HEAD.size:at + _HEAD.size + nj])
        out.append((doc, raw[at + _HEAD.size + nj:end]))
        at = end
    return out


def _unsynced(entries: list[tuple[dict, bytes]]) -> list[tuple[dict, bytes]]:
    """The entries no later marker cancels, in log order. A data entry of a file that a durable
    rename then moved names the file's new name (an undone rename is :func:`power_on`'s)."""
    alive: list[list] = []
    for doc, blob in entries:
        op = doc["op"]
        if op == "sync":
            for a in alive:
                if a[0]["op"] in ("data", "size") and a[2] == doc["path"]:
                    a[3] = False
        elif op == "dirsync":
            for a in alive:
                if a[0]["op"] in ("create", "rename", "unlink"):
                    a[4].discard(doc["path"])
                    if not a[4]:
                        a[3] = False
        else:
            path = doc.get("path", doc.get("dst"))
            dirs = {os.path.dirname(doc["src"]), os.path.dirname(doc["dst"])} if op == "rename" else \
                {os.path.dirname(path)}
            # A rename moves the data entries of its source to its destination's name (a
            # later sync of the new name cancels them).
            if op == "rename":
                for a in alive:
                    if a[0]["op"] in ("data", "size") and a[2] == doc["src"]:
                        a[2] = doc["dst"]
            alive.append([doc, blob, path, True, dirs])
    out = []
    for i, a in enumerate(alive):
        if not a[3]:
            continue
        if a[0]["op"] in ("data", "size"):
            # Where the file is after the power loss: renames after it that are durable moved it.
            p = a[0]["path"]
            for r in alive[i + 1:]:
                if r[0]["op"] == "rename" and not r[3] and r[0]["src"] == p:
                    p = r[0]["dst"]
            if p != a[0]["path"]:
                a[0] = {**a[0], "path": p}
        out.append((a[0], a[1]))
    return out


def unsynced_count(root) -> int:
    """How many operations under ``root`` a power loss now would take back (the crash-state
    checker spreads its prefixes over them)."""
    d = Path(root) / LOG_DIR
    return sum(len(_unsynced(_read_log(p))) for p in sorted(d.glob("undo-*.log"))) if d.is_dir() else 0


def power_on(root, lose: Lose | None = None) -> PowerOnReport:
    """Apply the power loss that the undo logs under ``root`` describe (see the module doc), then
    remove the logs. Call with the pool's writer lock held and before anything reads the pool.
    Idempotent: the logs go last (a crash during it leaves them, and a later call undoes the
    same entries again, to the same bytes)."""
    root = Path(os.path.abspath(root))
    lose = lose or Lose()
    rep = PowerOnReport()
    d = root / LOG_DIR
    if not d.is_dir():
        return rep
    logs = sorted(d.glob("undo-*.log"))
    rep.logs = [p.name for p in logs]
    todo: list[tuple[dict, bytes]] = []
    for p in logs:
        todo += _unsynced(_read_log(p))
    rep.entries = len(todo)
    rng = random.Random(lose.seed)
    if lose.mode == "all":
        lost = [True] * len(todo)
    elif lose.mode == "prefix":
        lost = [i >= lose.keep for i in range(len(todo))]
    elif lose.mode == "subset":
        lost = [rng.random() < 0.5 for _ in todo]
    else:
        raise ValueError(f"Lose.mode must be all, prefix or subset, got {lose.mode!r}")
    moved: dict[str, str] = {}   # renames that stay (later than the entry being undone)
    extent: dict[str, int] = {}  # the size that kept writes (later ones) need

    def where(rel: str) -> str:
        seen = 0
        while rel in moved and seen < 64:
            rel, seen = moved[rel], seen + 1
        return rel

    dirs: set[Path] = {root}  # directories whose entries the power-on changed
    for (doc, blob), gone in reversed(list(zip(todo, lost))):
        op = doc["op"]
        if op in ("data", "size"):
            path = root / where(doc["path"])
            if not gone:
                if op == "data":
                    n = doc["n"]
                    r = np.frombuffer(blob[:16 * n], dtype="<i8").reshape(n, 2)
                    extent[str(path)] = max(extent.get(str(path), 0), int((r[:, 0] + r[:, 1]).max()) if n else 0)
                continue
            if not path.exists():
                continue
            rep.undone += 1
            fd = _os_open(path, os.O_RDWR)
            try:
                need = extent.get(str(path), 0)
                if op == "size":
                    if doc["new"] < doc["size"]:  # a shrink: the cut bytes come back
                        os.ftruncate(fd, max(doc["size"], need))
                        os.pwrite(fd, blob, doc["new"])
                    else:
                        os.ftruncate(fd, max(doc["size"], need))
                    continue
                n = doc["n"]
                r = np.frombuffer(blob[:16 * n], dtype="<i8").reshape(n, 2)
                old = memoryview(blob)[16 * n:]
                tear = lose.mode == "subset" and rng.random() < 0.5
                at = 0
                for off, ln in r.tolist():
                    have = max(0, min(ln, doc["size"] - off))  # bytes that existed before the write
                    piece = bytes(old[at:at + have])
                    at += have
                    if tear:  # some blocks of this write reached the disk, the others did not
                        rep.torn += 1
                        b = lose.block
                        for lo in range(off - off % b, off + ln, b):
                            if rng.random() < 0.5:
                                a, z = max(lo, off), min(lo + b, off + ln)
                                chunk = piece[a - off:z - off]
                                os.pwrite(fd, chunk + bytes(z - a - len(chunk)), a)
                    else:
                        os.pwrite(fd, piece + bytes(ln - have), off)
                if not tear:
                    os.ftruncate(fd, max(doc["size"], need))
            finally:
                os.fsync(fd)  # what was undone is durable before the logs go (else it is undone again)
                os.close(fd)
        elif op == "create":
            path = root / doc["path"]
            if gone and where(doc["path"]) == doc["path"] and path.exists():
                rep.undone += 1
                path.unlink()
                dirs.add(path.parent)
        elif op == "rename":
            if not gone:
                moved[doc["src"]] = doc["dst"]
                continue
            rep.undone += 1
            src, dst = root / doc["src"], root / doc["dst"]
            dirs.update((src.parent, dst.parent))
            if dst.exists():
                os.rename(dst, src)
            if doc.get("grave") and (d / doc["grave"]).exists():
                os.rename(d / doc["grave"], dst)
        elif op == "unlink":
            g = d / doc["grave"]
            if gone and g.exists():
                rep.undone += 1
                os.rename(g, root / doc["path"])
                dirs.add((root / doc["path"]).parent)
    # Only what was undone is synced (a close with nothing unsynced costs no walk of the pool);
    # the files above, the directories here, and only then do the logs go (a crash in between
    # undoes the same entries again, to the same bytes).
    def sync_dir(path: Path) -> None:
        fd = _os_open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    for dirpath in sorted(dirs - {root}):
        sync_dir(dirpath)
    sync_dir(root)
    for p in sorted(d.iterdir()):
        p.unlink()
    d.rmdir()
    sync_dir(root)
    return rep
