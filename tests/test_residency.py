"""memory_pool.residency: what a pool's files hold in the page cache, counted two ways."""

import os

import pytest

from memory_pool import residency
from memory_pool.residency import PAGE, page_cache_bytes


def _kernel() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _half_cached(path, pages=64):
    """A file of ``pages`` pages, written and synced, then its odd pages dropped from the cache."""
    with open(path, "wb") as f:
        f.write(os.urandom(pages * PAGE))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # (all out: then the even ones read back in,
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)     # with no read-ahead)
        for i in range(0, pages, 2):
            os.pread(fd, PAGE, i * PAGE)
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["disk", "shm"])
def test_cachestat_and_mincore_count_the_same_cached_pages_of_a_partly_cached_file(tmp_path, where):
    if where == "shm":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm on this machine")
        path = f"/dev/shm/dlrm-cxl-test-residency-{os.getpid()}"
    else:
        path = str(tmp_path / "f")
    try:
        _half_cached(path)
        by_mincore = page_cache_bytes([path], use_cachestat=False)
        by_cachestat = page_cache_bytes([path])
        if where == "disk":
            assert by_mincore == 32 * PAGE
        else:
            assert by_mincore == 64 * PAGE    # (tmpfs pages are the file: never dropped)
        assert by_cachestat == by_mincore
        if _kernel() >= (6, 5):   # (the call is there: it counted them, no fallback did)
            fd = os.open(path, os.O_RDONLY)
            try:
                assert residency._cachestat_pages(fd) * PAGE == by_mincore
            finally:
                os.close(fd)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_page_cache_bytes_falls_back_to_mincore_where_the_kernel_has_no_cachestat(tmp_path, monkeypatch):
    path = tmp_path / "f"
    _half_cached(path)
    want = page_cache_bytes([path], use_cachestat=False)
    monkeypatch.setattr(residency, "_SYS_CACHESTAT", -1)   # (an unknown call: ENOSYS, as on a kernel before 6.5)
    monkeypatch.setattr(residency, "_cachestat_works", True)
    assert page_cache_bytes([path]) == want
    assert residency._cachestat_works is False
