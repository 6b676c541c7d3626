"""Plain helpers shared by test modules (``from helpers import flip``; pytest puts tests/ on
sys.path). Fixtures live in conftest.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["file_system", "flip", "journal_writer", "kill_writer_and_check_journal", "need_native", "tool"]

REPO = Path(__file__).resolve().parents[1]


def tool(name: str):
    """``tools/<name>.py`` as a module (the tools are scripts, not installed), loaded once and
    shared by every test module that uses it."""
    import importlib.util

    key = f"dlrm_cxl_tool_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, REPO / "tools" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod  # (its dataclasses look their module up while it loads)
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]


def flip(path: Path, offset: int, mask: int = 0x10) -> None:
    """XOR the byte at ``offset`` of the file ``path`` with ``mask`` (a bit flip on media)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def journal_writer(journal_args: str, sizes: tuple[int, int, int]) -> str:
    """Code of a process that appends transactions of three records of ``sizes`` bytes (two in
    one write, then one) to the journal at ``sys.argv[1]``, opened with ``journal_args``, until
    it is killed; it prints "committed" after its first commit."""
    return f"""
import sys
from pathlib import Path
from memory_pool.journal import Journal, RecordType
j = Journal(Path(sys.argv[1]), {journal_args})
big = bytes(range(256)) * 4096                      # 1 MiB records: the kill lands mid-write
tag = 0
while True:
    j.append_many([(RecordType.UNDO, tag, [big[:{sizes[0]}]]), (RecordType.ROWS, tag, [big[:{sizes[1]}]])])
    j.append(RecordType.DENSE, tag, [big[:{sizes[2]}]])
    j.end(tag, {{"step": tag}})
    if tag == 0:
        print("committed", flush=True)
    tag += 1
"""


def kill_writer_and_check_journal(code: str, d: Path, after: float, sizes: list[int], **journal_kwargs) -> None:
    """Run ``code`` (a journal writer on ``d`` that prints "committed" after its first commit),
    SIGKILL it ``after`` seconds later, and check what a crash must leave: every commit before
    the kill, in order, the last two with their records (``sizes``) whole; a tail that is clean
    or torn, never damage; a journal that takes appends again once its tail is truncated."""
    from memory_pool.journal import Journal, RecordType

    proc = subprocess.Popen([sys.executable, "-c", code, str(d)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "committed"
        time.sleep(after)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    j = Journal(d, **journal_kwargs)
    tags = [t.tag for t in j.txns]
    assert tags == list(range(len(tags))) and tags, "every commit before the kill survives, in order"
    assert j.tail_damage is None and all(r.tag == tags[-1] + 1 for r in j.tail)
    for t in j.txns[-2:]:
        assert [len(p) for _, p in j.read_many(t.records)] == sizes
    if j.tail or j.torn_bytes:
        j.truncate_tail()
    j.append(RecordType.UNDO, 99, [b"after"])
    j.end(99, {})
    j.close()
    again = Journal(d, read_only=True)
    assert [t.tag for t in again.txns] == tags + [99] and again.tail == [] and again.torn_bytes == 0


def file_system(path) -> str:
    """The type of the file system ``path`` lies on (``fileio.mount_entry``)."""
    from memory_pool.fileio import mount_entry
    m = mount_entry(path)
    return m[1] if m is not None else ""


def need_native(fn, source: str):
    """Skip when the C function ``fn()`` (a ``memory_pool._native`` loader) is missing for a
    real reason: no C compiler here (``setup.py`` builds the C files as optional extensions).
    With a compiler present its build failed or was not run: a failure, not a skip."""
    import os
    import shutil
    import sysconfig

    import pytest

    if fn() is not None:
        return
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None and shutil.which("cc") is None:
        pytest.skip(f"{source} was not built (no C compiler at install)")
    pytest.fail(f"{source} is not loadable although a C compiler ({cc}) is here"
                f"{' (DLRM_CXL_NO_NATIVE=1 is set)' if os.environ.get('DLRM_CXL_NO_NATIVE') == '1' else ''}: "
                f"rebuild with `pip install -e . --no-deps --no-build-isolation` and read its output")
