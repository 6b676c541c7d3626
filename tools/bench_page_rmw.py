#!/usr/bin/env python
"""What a compaction's write home in place costs the machine, a page at a time, against the same
rows written packed (issue 26's long run: memory_pool/overlay.py's dense pages).

A compaction through the row overlay writes a page home in place when at least a quarter of it
changed (``DENSE_FRACTION``): the page is read in (``POSIX_FADV_WILLNEED``, as
``FileRegion._will_store`` asks), its rows stored through a shared mapping, the mapping dropped,
the page written out and its cache dropped (``Compaction._write_back``). The other rows go into a
run: packed, written sequentially with ``O_DIRECT``. This measures both on one cold file of
``--mib`` MiB in ``--dir``, side by side in one process: ``--pages`` scattered pages with
``--rows`` 256-byte rows stored in each, and rows of 264 bytes (the id included) written packed
(at least ``--packed-mib``, 1 GiB by default, for the clock ticks to resolve).

Printed per phase and in all: wall time, the thread's CPU, and the whole machine's busy CPU
(``/proc/stat``: user, nice, system, irq and softirq, steal left out), which counts what the
kernel does for the I/O on other threads -- on 2 cores a millisecond of it beside a step costs
the step about one (``tools/bench_cpu_beside.py``). Run it with nothing else running.

    python tools/bench_page_rmw.py --dir /work/pools --mib 2048 --pages 60000

On the 2-core VM of 2026-12-07 (2 GiB, 60,000 pages, 4 rows each; two runs): 23.5 and 27.5 us
of the machine's CPU a page in place (15.6 and 17.3 us on the thread), against 0.19 and 0.13 ms
a MB for the packed write (0.05 and 0.03 us a row) -- a page home costs what ~480-800 packed
rows do.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from memory_pool import fileio  # noqa: E402
from memory_pool.tiers import prefetch_if_cold  # noqa: E402

PAGE = mmap.PAGESIZE
ROW = 256
PACKED = ROW + 8
CHUNK = 8 << 20


def busy() -> float:
    """Seconds of CPU the whole machine spent busy so far (steal left out)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


class Phases:
    """Each phase's wall, thread CPU and machine CPU; a short settle after each so that the
    I/O it started completes inside it."""

    def __init__(self):
        self.rows: list[tuple[str, float, float, float]] = []

    def run(self, name: str, fn, settle: float = 0.3) -> None:
        b0, t0, w0 = busy(), time.thread_time(), time.perf_counter()
        fn()
        wall = time.perf_counter() - w0
        time.sleep(settle)
        self.rows.append((name, wall, time.thread_time() - t0, busy() - b0))


def make_file(path: Path, nbytes: int) -> None:
    buf = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for at in range(0, nbytes, CHUNK):
            f.write(buf[:min(CHUNK, nbytes - at)])
        f.flush()
        os.fsync(f.fileno())


def in_place(path: Path, pages: np.ndarray, rows: int, ph: Phases) -> None:
    """The dense pages' way home (FileRegion.write_back through FileRegion.home)."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        mm.madvise(mmap.MADV_RANDOM)
        home = torch.frombuffer(mm, dtype=torch.int64).view(-1, ROW // 8)
        per = PAGE // ROW
        ids = torch.from_numpy(pages * per).repeat_interleave(rows) + torch.arange(rows).repeat(pages.size)
        vals = torch.full((ids.numel(), ROW // 8), 0x0707070707070707, dtype=torch.int64)   # (bytes 7)

        def unmap():
            nonlocal home
            home = None
            mm.close()

        # (the compaction's own calls: FileRegion._will_store, FileRegion.drop_cache(write_out=True))
        ph.run("in place: read in", lambda: prefetch_if_cold(fd, home.data_ptr(), ROW, [(ids,)]), settle=1.0)
        ph.run("in place: store rows", lambda: home.index_copy_(0, ids, vals))
        ph.run("in place: unmap", unmap)
        ph.run("in place: write out", lambda: fileio.start_writeback(fd, 0, 0, wait=True))
        ph.run("in place: drop cache", lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))
        ph.run("in place: fdatasync", lambda: os.fdatasync(fd))
    finally:
        os.close(fd)


def packed(path: Path, nbytes: int, ph: Phases) -> int:
    """Rows into a run: packed, sequential, O_DIRECT (runfile._write_direct); ``nbytes`` of them
    (whole chunks). Returns the bytes written."""
    nbytes = max(CHUNK, nbytes // CHUNK * CHUNK)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o644)
    try:
        buf = mmap.mmap(-1, CHUNK)
        buf.write(b"\x07" * CHUNK)

        def write():
            for at in range(0, nbytes, CHUNK):
                os.pwrite(fd, buf, at)
            os.fdatasync(fd)

        ph.run(f"packed: {nbytes / 2**20:.0f} MiB", write)
        return nbytes
    finally:
        os.close(fd)
        path.unlink()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp", help="a directory on the device to measure (default /tmp)")
    ap.add_argument("--mib", type=int, default=2048, help="the image file's size (default 2048 MiB)")
    ap.add_argument("--pages", type=int, default=60000, help="pages written in place (default 60,000)")
    ap.add_argument("--rows", type=int, default=4, help="rows stored a page (default 4: a quarter of it)")
    ap.add_argument("--packed-mib", type=int, default=1024, help="packed rows written at least (default 1024 MiB)")
    a = ap.parse_args(argv)
    total = a.mib << 20
    if not 1 <= a.rows <= PAGE // ROW:
        ap.error(f"--rows must be 1..{PAGE // ROW}, got {a.rows}")
    if a.mib < 1 or not 1 <= a.pages <= total // PAGE:
        ap.error(f"--pages must be 1..{max(total // PAGE, 1)} for a {a.mib} MiB file, got {a.pages}")
    if not Path(a.dir).is_dir():
        ap.error(f"--dir {a.dir} is not a directory: give one on the device to measure")
    image, run = Path(a.dir) / "bench_page_rmw.img", Path(a.dir) / "bench_page_rmw.run"
    ph = Phases()
    try:
        make_file(image, total)
        pages = np.sort(np.random.default_rng(1).choice(total // PAGE, a.pages, replace=False))
        in_place(image, pages, a.rows, ph)
        # (at least --packed-mib: the machine's CPU is counted in clock ticks)
        written = packed(run, max(a.pages * a.rows * PACKED, a.packed_mib << 20), ph)
    except OSError as exc:
        # (a full disk, or a file system that refuses O_DIRECT)
        print(f"bench_page_rmw: {exc}. Give --dir a directory on a block device with "
              f"{(total >> 20) + a.packed_mib} MiB free (its files are removed).", file=sys.stderr)
        return 1
    finally:
        image.unlink(missing_ok=True)
        run.unlink(missing_ok=True)
    print(f"# {a.pages:,} pages of a {a.mib} MiB file, {a.rows} rows of {ROW} B stored in each; "
          f"the same rows packed ({PACKED} B each)")
    print(f"{'phase':<26} {'wall s':>7} {'thread CPU s':>12} {'machine CPU s':>13}")
    for name, wall, thread, machine in ph.rows:
        print(f"{name:<26} {wall:>7.2f} {thread:>12.2f} {machine:>13.2f}")
    home = [r for r in ph.rows if r[0].startswith("in place")]
    run = [r for r in ph.rows if r[0].startswith("packed")][0]
    t_home, m_home = sum(r[2] for r in home), sum(r[3] for r in home)
    per_row = run[3] / (written / PACKED)
    print(f"in place: {1e6 * m_home / a.pages:.1f} us of the machine's CPU a page ({1e6 * t_home / a.pages:.1f} us "
          f"on the thread); packed: {1e3 * run[3] / (written / 1e6):.2f} ms a MB ({1e6 * per_row:.3f} us a row); "
          f"a page in place costs what {m_home / a.pages / max(per_row, 1e-12):,.0f} packed rows do")
    return 0


if __name__ == "__main__":
    sys.exit(main())
