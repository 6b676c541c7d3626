"""Shared fixtures: the pool tiers, a pool directory that is cleaned up (shm regions included),
and a helper that runs a Python snippet in a fresh interpreter (crash and multi-process tests)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import memory_pool

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=memory_pool.TIERS)
def tier(request) -> str:
    """Every tier of the pool: dram, shm, pmem, power-sim."""
    return request.param


def _remove_pools_under(root: Path) -> None:
    for header in sorted(root.rglob(memory_pool.pool.HEADER)):
        for attempt in range(2):
            try:
                memory_pool.destroy_pool(header.parent)
                break
            except memory_pool.PoolLockedError:
                gc.collect()  # a pool the test dropped without close() releases its lock
            except memory_pool.DlrmCxlError:
                break  # a header the test damaged on purpose
        if not header.exists():
            continue
        try:  # still remove the shm region, which lives outside tmp_path
            storage = Path(json.loads(header.read_bytes()).get("storage_dir", ""))
        except (ValueError, OSError, AttributeError):
            continue
        if storage.name.startswith("dlrm-cxl-") and storage.parent == memory_pool.tiers.shm_root():
            shutil.rmtree(storage, ignore_errors=True)
    memory_pool.gc(under=root)  # regions of pools under root that a test deleted with rmtree


@pytest.fixture(scope="session", autouse=True)
def _gc_shm_regions(tmp_path_factory):
    """After the session, remove the orphaned shm regions of pools made under pytest's temporary
    directories (this session's, and those of earlier sessions that pytest has since deleted)."""
    yield
    base = tmp_path_factory.getbasetemp()
    memory_pool.gc(under=base.parent if base.parent.name.startswith("pytest-of-") else base)


@pytest.fixture(scope="module")
def cli():
    """Runs the CLI in real processes forked from one warm interpreter (tools/torture.py)."""
    from helpers import tool

    c = tool("torture").Cli()
    yield c
    c.close()


@pytest.fixture(scope="module")
def root(request, tmp_path_factory) -> Path:
    """A directory shared by a test module's pools; every pool under it is destroyed afterwards."""
    d = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    yield d
    _remove_pools_under(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_pool_left_behind(request):
    """Every pool a test made under its tmp_path is destroyed afterwards (an shm pool's region
    lives in RAM, outside tmp_path, and pytest keeps tmp_path around)."""
    yield
    path = request.node.funcargs.get("tmp_path") if hasattr(request.node, "funcargs") else None
    if path is not None and Path(path).exists():
        _remove_pools_under(Path(path))


@pytest.fixture
def tmp_pool_dir(tmp_path) -> Path:
    """A path for a pool (not created). Every pool made under tmp_path is destroyed afterwards."""
    yield tmp_path / "pool"
    _remove_pools_under(tmp_path)


def run_python(code: str, *args, env: dict | None = None, timeout: float = 120,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a new interpreter with ``args`` as ``sys.argv[1:]``.

    ``check``: fail the test unless it exits 0 (its stderr is in the message).
    """
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"child exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture
def run_py():
    """The :func:`run_python` helper."""
    return run_python
