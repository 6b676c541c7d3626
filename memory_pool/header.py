"""The pool header, ``DIR/pool.json``: magic, format version, pool id, tier, tables, meta and a
crc32 of its canonical JSON. It is the pool's commit marker: written last at creation, replaced
atomically and durably (``durable.atomic_write``) whenever it changes."""

from __future__ import annotations

from pathlib import Path

from .durable import json_crc, json_with_crc, parse_json_object
from .errors import PoolCorruptError, PoolFormatError, PoolVersionError

__all__ = ["MAGIC", "FORMAT_VERSION", "RUNS_FORMAT_VERSION", "READABLE_VERSIONS", "HEADER", "TABLES_DIR", "JOURNAL_DIR",
           "table_file", "header_bytes", "read_header"]

MAGIC = "dlrm-cxl-pool"
FORMAT_VERSION = 2   # 2: journal (byte-granular persistence), the checkpointer's records in it
RUNS_FORMAT_VERSION = 3   # 2 + a row overlay (runs/, memory_pool/overlay.py): set before its first manifest
READABLE_VERSIONS = (FORMAT_VERSION, RUNS_FORMAT_VERSION)
HEADER = "pool.json"
# Where the header's tables and the journal live under a pool's storage directory (the layout:
# memory_pool/pooldir.py).
TABLES_DIR = "tables"
JOURNAL_DIR = "journal"


def table_file(storage_dir: Path, name: str) -> Path:
    """The file of table ``name``'s rows: ``<storage_dir>/tables/<name>.bin``."""
    return Path(storage_dir) / TABLES_DIR / f"{name}.bin"


def header_bytes(doc: dict) -> bytes:
    return json_with_crc(doc, indent=1)


def read_header(path: Path) -> dict:
    """Parse and verify ``DIR/pool.json``; typed errors for every way it can be wrong."""
    hp = Path(path) / HEADER
    if not Path(path).is_dir():
        raise PoolFormatError(f"{path} is not a pool: no such directory")
    try:
        raw = hp.read_bytes()
    except FileNotFoundError:
        raise PoolFormatError(f"{path} is not a pool: {HEADER} is missing") from None
    doc = parse_json_object(raw, hp, "header")
    if doc.get("magic") != MAGIC:
        raise PoolFormatError(f"{hp}: wrong magic {doc.get('magic')!r}, expected {MAGIC!r}: not a dlrm-cxl pool")
    crc = json_crc(doc)
    if doc.get("crc32") != crc:
        raise PoolCorruptError(f"{hp}: header checksum mismatch (stored {doc.get('crc32')}, computed {crc})")
    if doc.get("format_version") not in READABLE_VERSIONS:
        raise PoolVersionError(
            f"{hp}: pool format version {doc.get('format_version')}, this dlrm-cxl reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}")
    return doc
