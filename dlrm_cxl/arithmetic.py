"""MKL's arithmetic mode: pinned to one that gives the same bits on any thread count.

Why: a replay after a crash must repeat the steps' arithmetic bit for bit. MKL splits a GEMM's
work by the thread count in its default mode: on the Intel Xeon host of 2026-12-06 the `kaggle`
MLPs' GEMMs at batch 2048 gave other bits on one thread than on two. A step run on one thread
fewer while the pool compacts (dlrm_cxl/cores.py) was then refused on that host, and a replay on
a machine with another core count would stop at its first step. MKL's conditional numerical
reproducibility mode ``AUTO,STRICT`` (what ``MKL_CBWR=AUTO,STRICT`` selects) gives one result on
any count, at ~1 % of the MLPs' time there (``tools/bench_mkl_mode.py``: 28.55 against 28.14 ms).

MKL takes its mode once, at its first call (a GEMM); ``import torchrec`` makes one. So
:func:`pin_mkl_mode` runs when this package is imported, before it imports TorchRec: a program
that ran a GEMM before importing ``dlrm_cxl`` keeps MKL's mode as it was. Where ``MKL_CBWR`` is
in the environment MKL has read it, and it is left alone (``MKL_CBWR=`` empty: MKL's default
mode). Each run records the mode MKL really runs in (:func:`mkl_mode`,
``replay_source.run_settings``); a replay under another stops at its window's start
(``replay_source.check_replay_settings``). Without MKL (a torch built without it) nothing is
pinned and the mode reads None, as MKL's default does.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

__all__ = ["PINNED", "pin_mkl_mode", "mkl_mode"]

PINNED = "AUTO,STRICT"

# mkl_cbwr.h: MKL_CBWR_ALL, MKL_CBWR_STRICT, MKL_CBWR_AUTO and the branches' numbers
_ALL, _STRICT, _AUTO, _DEFAULT = -1, 0x10000, 2, 1
_BRANCHES = {2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
             10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}


@functools.cache
def _mkl():
    """torch's MKL service calls (get, set), or None where this torch has no MKL (looked up once)."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get, put = lib.mkl_serv_cbwr_get, lib.mkl_serv_cbwr_set
    except (OSError, AttributeError):
        return None
    get.restype = put.restype = ctypes.c_int
    get.argtypes = put.argtypes = [ctypes.c_int]
    return get, put


def pin_mkl_mode() -> None:
    """MKL set to :data:`PINNED`, unless ``MKL_CBWR`` is in the environment or MKL has run
    already (then it keeps its mode: :func:`mkl_mode` says which)."""
    calls = _mkl()
    if calls is not None and "MKL_CBWR" not in os.environ:
        calls[1](_AUTO | _STRICT)   # (refused once MKL has run: nothing to do then)


def mkl_mode() -> str | None:
    """The mode MKL's GEMMs run in, spelled as ``MKL_CBWR`` would set it (``"AUTO,STRICT"``),
    None for MKL's default (or no MKL)."""
    calls = _mkl()
    mode = calls[0](_ALL) if calls is not None else _DEFAULT
    branch = mode & ~_STRICT
    if branch in (0, _DEFAULT) and not mode & _STRICT:
        return None
    name = _BRANCHES.get(branch, f"branch {branch}")
    return name + (",STRICT" if mode & _STRICT else "")
