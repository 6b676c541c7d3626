"""Plain helpers shared by test modules (``from helpers import flip``; pytest puts tests/ on
sys.path). Fixtures live in conftest.py."""

from __future__ import annotations

from pathlib import Path

__all__ = ["flip"]


def flip(path: Path, offset: int, mask: int = 0x10) -> None:
    """XOR the byte at ``offset`` of the file ``path`` with ``mask`` (a bit flip on media)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))
