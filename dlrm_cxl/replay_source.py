"""What a replay needs to be the same computation (:mod:`dlrm_cxl.replay`): the data source it
reads, identified, and the settings that make a step bit-exact. The trainer records both in the
pool at each run's start, and checks them before it replays."""

from __future__ import annotations

import os
from pathlib import Path

from .arithmetic import mkl_mode
from .errors import ReplaySourceError

__all__ = ["data_identity", "check_replay_source", "check_replay_settings", "run_settings"]


def data_identity(data: str | None) -> dict:
    """What identifies a data source: synthetic data by its name (its seed and skew are the
    pool's own), a file by path, size and mtime, a directory (zarr) by those of every file."""
    if data is None or str(data) == "synthetic":
        return {"source": "synthetic"}
    p = Path(data).resolve()
    if p.is_dir():
        files = []
        for d, _, names in os.walk(p):
            for n in sorted(names):
                st = os.stat(os.path.join(d, n))
                files.append([os.path.relpath(os.path.join(d, n), p), st.st_size, st.st_mtime_ns])
        return {"source": str(p), "files": sorted(files)}
    st = p.stat()
    return {"source": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def check_replay_source(recorded: dict | None, data: str | None, *, first: int, last: int, step: int) -> None:
    """Raise ReplaySourceError when ``data`` is not the source the steps ``first..last`` read
    (``recorded``: the pool's ``data_identity`` meta; None for a pool that recorded none)."""
    if recorded is None:
        return
    what = f"steps {first}..{last}" if last > first else f"step {first}"
    if recorded.get("source") != "synthetic" and not Path(recorded["source"]).exists():
        raise ReplaySourceError(f"the data file {recorded['source']} that {what} read is gone: the pool stays at "
                                f"step {step}, the start of its recovery window (a replay never reads other data)")
    try:
        now = data_identity(data)
    except OSError:
        now = None
    if now != recorded:
        raise ReplaySourceError(f"the data source {recorded.get('source')} changed since {what} read it "
                                f"(size or modification time differ): the pool stays at step {step}, the start of "
                                f"its recovery window (a replay never reads other data)")


def run_settings(threads: int, kernel: str, device: str, dram_cache_bytes: int | None = None) -> dict:
    """What a replay must run with to be bit-exact, recorded in the pool at each run's start:
    torch's threads, the kernels the steps ran on (fused, or the reference path: also what a
    DRAM row cache or several ranks imply), the device, the DRAM cache's budget, and the mode
    MKL runs in, spelled as ``MKL_CBWR`` sets it (MKL's GEMMs give other bits under another
    mode, and a process cannot change it once MKL has run: dlrm_cxl/arithmetic.py)."""
    return {"threads": threads, "kernel": kernel, "device": device, "dram_cache_bytes": dram_cache_bytes,
            "mkl_cbwr": mkl_mode()}


def check_replay_settings(run: dict | None, *, first: int, last: int, step: int) -> None:
    """Raise ReplaySourceError when this process cannot repeat the arithmetic of the steps
    ``first..last``: they ran under another MKL mode (``run``: the pool's ``run`` meta; a pool
    that recorded none is not checked). The other settings the replay takes from ``run``."""
    if not run or "mkl_cbwr" not in run:
        return
    had, now = run["mkl_cbwr"], mkl_mode()
    if had != now:
        what = f"steps {first}..{last}" if last > first else f"step {first}"
        raise ReplaySourceError(
            f"{what} ran with MKL_CBWR {_shown(had)} and this process runs MKL with {_shown(now)}: its GEMMs would not "
            f"repeat their arithmetic, so the pool stays at step {step}, the start of its recovery window",
            hint=(f"export MKL_CBWR={had}" if had is not None else "export MKL_CBWR= (empty: MKL's default mode)") +
                 " before starting `dlrm-cxl recover` (or `train`) and run it again; the records are kept")


def _shown(value: str | None) -> str:
    return "MKL's default mode" if value is None else repr(value)
