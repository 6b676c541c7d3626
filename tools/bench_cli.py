#!/usr/bin/env python
"""What a user sees: ``dlrm-cxl train`` as a real process vs the same loop in TorchRec.

Both sides generate their batches per step (the same SyntheticData Zipf batches, prefetched by
a background thread, as the CLI does) and run in fresh processes, alternating, ``--rounds``
times; each reports samples/s over its ``--steps`` steps (after its own set-up: pool creation
or DMP sharding). Variants:

* ``cli <tier> <checkpoint>``: ``dlrm-cxl train --preset P --tier T --checkpoint C --json``;
  its summary also gives, per step, the bytes made durable and written to the device
  (/proc/self/io) and the time the trainer waited for the previous step to be durable;
* ``torchrec``: ``torchrec.models.dlrm.DLRM`` under ``DistributedModelParallel`` (world 1,
  gloo), TABLE_WISE + FUSED with EXACT_ROWWISE_ADAGRAD, dense Adagrad: this file run with
  ``--torchrec-worker``.

    python tools/bench_cli.py                                   # small: shm none/undo, pmem undo, torchrec
    python tools/bench_cli.py --variants "shm none,torchrec" --rounds 5
    git worktree add /tmp/base <rev>
    python tools/bench_cli.py --variants "shm none,shm undo" --baseline /tmp/base   # before vs after

``vs none`` is the ratio of the two variants' medians; ``paired`` the median over rounds of the
ratio of the two runs in the same round (this machine's slow drifts cancel in it).

``--baseline DIR``: every ``<tier> <checkpoint>`` variant also runs with the ``dlrm-cxl`` of
another checkout (a worktree of an earlier commit; same interpreter), interleaved with this
one's, and is reported as ``base <tier> <checkpoint>``: a before/after measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def torchrec_worker(preset: str, steps: int, threads: int | None) -> None:
    import warnings

    import torch
    import torch.nn.functional as F

    from dlrm_cxl.data import Prefetcher, SyntheticData
    from dlrm_cxl.model import PRESETS
    from dlrm_cxl.options import data_spec
    from tools.bench_train import TorchRecVariant

    warnings.simplefilter("ignore")
    if threads:
        torch.set_num_threads(threads)
    cfg = PRESETS[preset]
    work = Path(tempfile.mkdtemp(prefix="dlrm-bench-cli-tr-"))
    v = TorchRecVariant(cfg, [], work)
    v.setup()
    src = SyntheticData(data_spec(cfg), seed=0)
    with Prefetcher(src.iter_batches(None)) as batches:
        t0 = time.perf_counter()
        for _ in range(steps):
            b, _pos = next(batches)
            logits = v.model(b.dense, b.sparse).squeeze(-1)
            loss = F.binary_cross_entropy_with_logits(logits, b.labels)
            v.opt.zero_grad(set_to_none=True)
            loss.backward()
            v.opt.step()
            float(loss.detach())
        dt = time.perf_counter() - t0
    print(json.dumps({"samples_per_s": steps * cfg.batch_size / dt}))


def run_cli(preset: str, tier: str, checkpoint: str, steps: int, work: Path, threads: int | None,
            root: Path = _ROOT, extra: list[str] | None = None) -> dict:
    pool = work / f"pool-{tier}-{checkpoint}"
    cmd = [sys.executable, "-m", "dlrm_cxl", "train", "--pool", str(pool), "--preset", preset, "--tier", tier,
           "--checkpoint", checkpoint, "--steps", str(steps), "--fresh", "--json", "--no-progress"]
    if threads:
        cmd += ["--threads", str(threads)]
    if extra and checkpoint == "undo":
        cmd += extra
    # (python -m runs the package of the working directory: this checkout's, or the baseline's)
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    subprocess.run([sys.executable, "-m", "dlrm_cxl", "destroy", "--pool", str(pool)], capture_output=True, cwd=root)
    return json.loads(p.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--variants", default="shm none,shm undo,pmem undo,torchrec",
                   help="comma-separated: '<tier> <none|undo>' or 'torchrec'")
    p.add_argument("--workdir", type=Path, help="where pools go (default: a new directory under $TMPDIR)")
    p.add_argument("--baseline", type=Path, help="another checkout: its CLI runs every pool variant too")
    p.add_argument("--undo-args", default="", help="more train flags for this checkout's undo variants (not the "
                   "baseline's), e.g. '--window 1' against a baseline from before recovery windows")
    p.add_argument("--torchrec-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.torchrec_worker:
        torchrec_worker(a.preset, a.steps, a.threads)
        return 0
    work = a.workdir or Path(tempfile.mkdtemp(prefix="dlrm-bench-cli-"))
    work.mkdir(parents=True, exist_ok=True)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if a.baseline is not None:
        if not (a.baseline / "dlrm_cxl" / "__main__.py").is_file():
            raise SystemExit(f"--baseline {a.baseline}: not a checkout of this project")
        variants += ["base " + v for v in variants if v != "torchrec"]
    print(f"$ {' '.join([sys.executable, *sys.argv])}")
    print(f"# {os.cpu_count()} cpus, load avg {' '.join(f'{x:.2f}' for x in os.getloadavg())}; preset {a.preset}, "
          f"{a.steps} steps per run, {a.rounds} rounds, workdir {work}")
    res: dict[str, list] = {v: [] for v in variants}
    for r in range(a.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        line = []
        for v in order:
            if v == "torchrec":
                cmd = [sys.executable, __file__, "--torchrec-worker", "--preset", a.preset, "--steps", str(a.steps)]
                if a.threads:
                    cmd += ["--threads", str(a.threads)]
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=_ROOT)
                if out.returncode != 0:
                    raise RuntimeError(out.stderr[-2000:])
                res[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            else:
                *base, tier, ck = v.split()
                res[v].append(run_cli(a.preset, tier, ck, a.steps, work, a.threads,
                                      a.baseline.resolve() if base else _ROOT,
                                      extra=None if base else a.undo_args.split()))
            line.append(f"{v} {res[v][-1]['samples_per_s']:,.0f}")
        print(f"  round {r + 1}/{a.rounds}: " + " | ".join(line), flush=True)
    ref = statistics.median(x["samples_per_s"] for x in res["torchrec"]) if "torchrec" in res else None
    base = {}
    print(f"\n{'variant':<19}{'samples/s':>11}{'vs torchrec':>13}{'vs none':>9}{'paired':>8}{'durable MB/step':>17}"
          f"{'device MB/step':>16}{'WA':>7}{'wait ms/step':>14}{'window':>8}")
    for v in variants:
        m = statistics.median(x["samples_per_s"] for x in res[v])
        if v.endswith(" none"):
            base[v.rsplit(" ", 1)[0]] = m  # "<tier>", or "base <tier>"
    for v in variants:
        xs = res[v]
        m = statistics.median(x["samples_per_s"] for x in xs)
        ck = xs[-1].get("checkpoint") if v != "torchrec" else None
        durable = dev = wa = wait = ""
        if ck:
            durable = f"{(ck['touched_row_bytes_per_step'] + ck['dense_bytes_per_step']) / 1e6:.2f}"
            dev = f"{ck['device_write_bytes_per_step'] / 1e6:.2f}" if ck.get("device_write_bytes_per_step") is not None else ""
            wa = f"{ck['write_amplification']:.2f}" if ck.get("write_amplification") else ""
            wait = f"{1e3 * ck['commit_wait_seconds'] / max(ck['steps'], 1):.2f}"
        tier = v.rsplit(" ", 1)[0]
        vs_none = f"{m / base[tier]:.3f}x" if v.endswith(" undo") and tier in base else ""
        # (the median over rounds of the two runs' ratio in one round: this machine's slow
        # drifts cancel, as in bench_train's "undo vs none")
        paired = ""
        if vs_none and f"{tier} none" in res:
            paired = f"{statistics.median(u['samples_per_s'] / n['samples_per_s'] for u, n in zip(xs, res[f'{tier} none'])):.3f}x"
        window = str(xs[-1].get("window", "")) if ck and v.endswith(" undo") else ""
        print(f"{v:<19}{m:>11,.0f}{(f'{m / ref:.3f}x' if ref else ''):>13}{vs_none:>9}{paired:>8}{durable:>17}{dev:>16}{wa:>7}{wait:>14}"
              f"{window:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
