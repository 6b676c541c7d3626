"""MKL's pinned mode against its default: the `kaggle` MLPs' time, and whether they give one
result on one thread or two (dlrm_cxl/arithmetic.py).

Each round runs two fresh processes one after the other, in alternating order: one in MKL's
default mode (``MKL_CBWR=`` empty: dlrm-cxl leaves a mode in the environment alone) and one as
dlrm-cxl pins it. Each times forward and backward of the bottom and top MLPs at the preset's batch
size on ``--threads`` threads (median of ``--iters`` after 10 warm-up ones) and runs the core
yield's probe (``cores.thread_count_invariant``). Prints per round, then the medians and their
ratio.

    python tools/bench_mkl_mode.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = """
import json, statistics, sys, time
import dlrm_cxl   # (pins MKL's mode unless MKL_CBWR is set)
import torch
from torchrec.models.dlrm import DenseArch, OverArch
from dlrm_cxl.arithmetic import mkl_mode
from dlrm_cxl.cores import thread_count_invariant
from dlrm_cxl.model import PRESETS

cfg, threads, iters = PRESETS[sys.argv[1]], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
torch.manual_seed(0)
F, D = len(cfg.feature_names), cfg.embedding_dim
over_in = D + (F + 1) * F // 2


class Mlps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense_arch = DenseArch(cfg.num_dense, list(cfg.bottom_mlp))
        self.over_arch = OverArch(over_in, list(cfg.top_mlp))


m = Mlps()
x, z = torch.randn(cfg.batch_size, cfg.num_dense), torch.randn(cfg.batch_size, over_in)
times = []
for i in range(10 + iters):
    t0 = time.perf_counter()
    (m.dense_arch(x).sum() + m.over_arch(z).sum()).backward()
    times.append(time.perf_counter() - t0)
print(json.dumps({"mode": mkl_mode(), "ms": 1e3 * statistics.median(times[10:]),
                  "invariant": thread_count_invariant(m, cfg.batch_size, cfg.num_dense, threads)}))
"""


def _run(preset: str, threads: int, iters: int, default: bool) -> dict:
    env = dict(os.environ)
    if default:
        env["MKL_CBWR"] = ""         # (empty: MKL's default mode, left alone by dlrm-cxl)
    else:
        env.pop("MKL_CBWR", None)    # (unset: dlrm-cxl pins its mode)
    out = subprocess.run([sys.executable, "-c", _CHILD, preset, str(threads), str(iters)], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="kaggle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    got: dict[str, list[float]] = {"default": [], "pinned": []}
    for r in range(args.rounds):
        order = ("default", "pinned") if r % 2 == 0 else ("pinned", "default")
        for name in order:
            res = _run(args.preset, args.threads, args.iters, name == "default")
            got[name].append(res["ms"])
            print(f"round {r + 1} {name:8s} mode {res['mode']!s:12s} {res['ms']:7.2f} ms  "
                  f"one result on {args.threads} or {args.threads - 1} threads: {res['invariant']}", flush=True)
    d, p = statistics.median(got["default"]), statistics.median(got["pinned"])
    print(f"median: default {d:.2f} ms, pinned {p:.2f} ms: pinned/default {p / d:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
