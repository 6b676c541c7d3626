"""What reading a file in costs the CPU, by way of reading it (memory_pool/newest.py's why).

One file (default 1 GiB, in ``--dir``), read again and again, cold each time (its page cache
dropped first), in one process, side by side:

* ``mmap touch``: mapped, one byte a page touched (the compaction's old pre-read);
* ``pread copy``: copied out through the page cache into one reused 8 MiB buffer;
* ``pread again``: the same, the file still cached from the run before (no device read);
* ``sendfile``: read through the page cache to ``/dev/null`` (no page touched by the CPU);
* ``O_DIRECT``: read into one reused, already touched 8 MiB buffer, past the page cache;
* ``anon fault-in``: fresh anonymous memory of the same size, one byte a page written.

Prints each way's thread CPU and wall time, the median of ``--rounds``. On the 2-core VM of
2026-12-06 (1 GiB, 3 rounds), CPU seconds a GiB: mmap touch 0.49, pread copy 0.70, pread again
0.125, sendfile 0.023, O_DIRECT 0.029, anon fault-in 0.60 -- the CPU's first touch of a page
the disk just filled costs ~2 us there, as a fresh anonymous page does. Usage::

    python tools/bench_page_touch.py --dir /tmp --mib 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

CHUNK = 8 << 20
PAGE = mmap.PAGESIZE


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mmap_touch(path: Path, size: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:
            pages = np.frombuffer(m, dtype=np.uint8)
            int(pages[::PAGE].sum())
            del pages
    finally:
        os.close(fd)


def pread_copy(path: Path, size: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    buf = memoryview(bytearray(CHUNK))
    try:
        for off in range(0, size, CHUNK):
            os.preadv(fd, [buf], off)
    finally:
        os.close(fd)


def send_to_null(path: Path, size: int) -> None:
    fd, sink = os.open(path, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY)
    try:
        off = 0
        while off < size:
            n = os.sendfile(sink, fd, off, size - off)
            if n <= 0:
                break
            off += n
    finally:
        os.close(fd)
        os.close(sink)


def direct(path: Path, size: int, buf: mmap.mmap) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    view = memoryview(buf)
    try:
        for off in range(0, size, CHUNK):
            os.preadv(fd, [view], off)
    finally:
        view.release()
        os.close(fd)


def anon(size: int) -> None:
    m = mmap.mmap(-1, size)
    a = np.frombuffer(m, dtype=np.uint8)
    a[::PAGE] = 1
    del a
    m.close()


def timed(fn) -> tuple[float, float]:
    c0, w0 = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - c0, time.perf_counter() - w0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp", help="where the scratch file goes (a disk, not tmpfs)")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    size = a.mib << 20
    path = Path(a.dir) / f"bench-page-touch-{os.getpid()}.bin"
    buf = mmap.mmap(-1, CHUNK)
    np.frombuffer(buf, dtype=np.uint8)[:] = 0   # (touched once: the direct reads' memory is not new)
    try:
        with open(path, "wb") as f:
            for _ in range(0, size, CHUNK):
                f.write(os.urandom(CHUNK))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            os.close(fd)
            has_direct = True
        except OSError:
            has_direct = False
        ways = [("mmap touch", True, lambda: mmap_touch(path, size)),
                ("pread copy", True, lambda: pread_copy(path, size)),
                ("pread again", False, lambda: pread_copy(path, size)),
                ("sendfile", True, lambda: send_to_null(path, size)),
                ("anon fault-in", False, lambda: anon(size))]
        if has_direct:
            ways.insert(4, ("O_DIRECT", True, lambda: direct(path, size, buf)))
        got: dict[str, list] = {name: [] for name, _, _ in ways}
        for _ in range(a.rounds):
            for name, cold, fn in ways:
                if cold:
                    drop(path)
                got[name].append(timed(fn))
        print(f"# {a.mib} MiB in {a.dir}, median of {a.rounds} rounds; thread CPU and wall seconds per GiB")
        print(f"{'way':15s} {'CPU s/GiB':>10s} {'wall s/GiB':>11s}")
        per = (1 << 30) / size
        for name, _, _ in ways:
            cpu = statistics.median(c for c, _ in got[name]) * per
            wall = statistics.median(w for _, w in got[name]) * per
            print(f"{name:15s} {cpu:10.3f} {wall:11.3f}")
        if not has_direct:
            print("(O_DIRECT: refused by this file system)")
    finally:
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
