#!/usr/bin/env python
"""What checkpointing costs and buys: dlrm-cxl's undo log vs what users do today, in one run.

Training variants, all on the same pool tier (``--tier``, default pmem: rows on disk), the same
pre-generated SyntheticData batches and the same model, measured side by side in interleaved
timed windows (A B C D E, B C D E A, ...) after a warm-up; medians over ``--rounds``:

* ``none``            ``--checkpoint none`` (no recovery point while training);
* ``undo w=1``        batch-aware undo logging, a recovery point every step (--window 1);
* ``undo w=M``        the same, recovery windows of M steps (``--window``, default 10);
* ``full N``          torch.save of the whole model every N steps, synchronous and durable
                      (FullSaveCheckpointer in tools/baselines.py; ``--every``, default 10);
* ``incremental N``   the rows changed since the last checkpoint + dense state every N steps
                      (Check-N-Run style; IncrementalCheckpointer in tools/baselines.py).

For each: steps/s, its change vs ``none``, bytes made durable per step, main-thread time in the
checkpointer, and the recovery point (how many steps a crash can lose, the unfinished one
included: undo -> stats max_commit_lag + 1, full/incremental -> N).

Recovery time, ``--recover-reps`` times:

(a) ``--preset`` (small): ``python -m dlrm_cxl train ... --crash-at K:mid-update`` is SIGKILLed
    in a subprocess, then ``checkpointing.recover(path, digest=False)`` runs in this process
    (its ``.seconds``: verify + roll back + persist, no digest); each further rep continues
    training the same pool a few steps and crashes again. Compared with ``torch.load`` of the
    same model (tables + dense state) written with torch.save (file in the page cache: warm).
(b) ``--kaggle`` (optional: ~9 GB of disk and RAM, minutes to initialise): the same on the full
    Criteo-Kaggle model (33.8M rows); compared with reading the table files back
    (``--kaggle-load readback``, default: a lower bound on any torch.load of them) or with
    torch.load of a real 9 GB torch.save file (``--kaggle-load torchsave``).

Usage::

    python tools/bench_checkpoint.py                         # small preset, pmem tier
    python tools/bench_checkpoint.py --quick                 # tiny preset: smoke test
    python tools/bench_checkpoint.py --rounds 9 --steps 30 --every 10 --window 10
    python tools/bench_checkpoint.py --kaggle                # + full-size recovery (slow)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench_train import (PoolVariant, command_line, fmt_table, interleave, machine_line,  # noqa: E402
                         make_batches, median)
from checkpointing import committed_state, recover  # noqa: E402
from baselines import FullSaveCheckpointer, IncrementalCheckpointer, durable_torch_save  # noqa: E402
from dlrm_cxl.model import PRESETS  # noqa: E402
from memory_pool import MemoryPool, destroy_pool  # noqa: E402
from memory_pool.lifecycle import gc as gc_shm_regions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- recovery


def _train_cli(pool: Path, preset: str, steps: int, crash_step: int, tier: str, batch_size: int | None,
               extra: list[str] = ()) -> tuple[list[str], int, float, str]:
    cmd = [sys.executable, "-m", "dlrm_cxl", "train", "--pool", str(pool), "--preset", preset,
           "--checkpoint", "undo", "--steps", str(steps), "--crash-at", f"{crash_step}:mid-update",
           "--tier", tier, "--no-progress", *extra]
    if batch_size:
        cmd += ["--batch-size", str(batch_size)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return cmd, p.returncode, time.perf_counter() - t0, (p.stderr + p.stdout)[-2000:]


def crash_and_recover(pool: Path, preset: str, tier: str, reps: int, first_step: int,
                      batch_size: int | None = None, log=print) -> dict:
    """Crash a training subprocess mid-update, recover in process; ``reps`` times on one pool."""
    out = {"commands": [], "create_and_crash_s": None, "recover_s": [], "rows_restored": [],
           "rolled_back_steps": [], "committed_step": []}
    step = first_step
    for i in range(reps):
        cmd, rc, dt, tail = _train_cli(pool, preset, step, step, tier, batch_size,
                                       extra=["--fresh"] if i == 0 else [])
        if rc != -9:
            raise RuntimeError(f"expected the training subprocess to be SIGKILLed (rc -9), got rc {rc}:\n"
                               f"$ {' '.join(cmd)}\n{tail}")
        out["commands"].append(" ".join(cmd))
        if i == 0:
            out["create_and_crash_s"] = dt
        rep = recover(pool, digest=False)
        out["recover_s"].append(rep.seconds)
        out["rows_restored"].append(rep.rows_restored)
        out["rolled_back_steps"].append(rep.rolled_back_steps)
        out["committed_step"].append(rep.committed_step)
        log(f"  crash at step {step} ({dt:.1f} s incl. start-up{' and pool creation' if i == 0 else ''}); "
            f"recover: {1e3 * rep.seconds:.1f} ms, rolled back steps {rep.rolled_back_steps}, "
            f"{rep.rows_restored:,} rows, committed step {rep.committed_step}")
        step += 2
    return out


def save_full_model(pool_path: Path, out: Path) -> int:
    """torch.save (durably) of the recovered pool's model: every table + the committed dense state."""
    with MemoryPool.open(pool_path, read_only=True) as pool:
        step, dense = committed_state(pool)
        tables = {n: pool.table(n).view() for n in pool.tables()}
        return durable_torch_save({"step": step, "tables": tables, "dense": dense}, out)


def time_torch_load(path: Path, reps: int) -> list[float]:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        obj = torch.load(path, weights_only=False)
        ts.append(time.perf_counter() - t0)
        del obj
    return ts


def time_readback(pool_path: Path, reps: int) -> tuple[list[float], int]:
    """Read every table file of the pool into a fresh tensor, one file at a time."""
    with MemoryPool.open(pool_path, read_only=True) as pool:
        files = sorted((Path(pool.storage_dir) / "tables").glob("*.bin"))
    ts, total = [], 0
    for _ in range(reps):
        total = 0
        t0 = time.perf_counter()
        for f in files:
            n = f.stat().st_size
            buf = torch.empty(n, dtype=torch.uint8)
            view = memoryview(buf.numpy())
            got = 0
            with open(f, "rb", buffering=0) as fh:
                while got < n:  # one read() returns at most ~2 GiB on Linux
                    k = fh.readinto(view[got:])
                    if not k:
                        break
                    got += k
            if got != n:
                raise RuntimeError(f"short read of {f}: {got} of {n} bytes")
            total += n
            del buf
        ts.append(time.perf_counter() - t0)
    return ts, total


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--tier", default="pmem", choices=["shm", "pmem", "power-sim"])
    p.add_argument("--every", type=int, default=10, help="full/incremental: checkpoint every N steps (default 10)")
    p.add_argument("--window", type=int, default=10, help="the second undo variant's recovery window (default 10)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed window; rounded up to a multiple "
                   "of --every and --window (default 20)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per variant (default: --every)")
    p.add_argument("--num-batches", type=int, default=32)
    p.add_argument("--threads", type=int)
    p.add_argument("--crash-step", type=int, default=3, help="(a): first crash at this step (default 3)")
    p.add_argument("--recover-reps", type=int, default=3)
    p.add_argument("--no-train", action="store_true", help="skip the training-throughput part")
    p.add_argument("--no-recovery", action="store_true", help="skip the recovery part")
    p.add_argument("--kaggle", action="store_true", help="also time recovery of the full Kaggle model "
                   "(~9 GB of disk and RAM, minutes to initialise)")
    p.add_argument("--kaggle-load", choices=["readback", "torchsave"], default="readback",
                   help="kaggle comparison: read the table files back (default) or torch.load a 9 GB torch.save")
    p.add_argument("--kaggle-preset", default="kaggle", help=argparse.SUPPRESS)  # smoke-test the path
    p.add_argument("--workdir", type=Path, help="default: a new dir under $TMPDIR (a real disk for pmem)")
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true", help="tiny preset, few steps: a smoke test")
    a = p.parse_args(argv)
    if a.quick:
        a.preset = "tiny" if a.preset == "small" else a.preset
        a.every, a.window = min(a.every, 5), min(a.window, 5)
        a.steps, a.rounds, a.num_batches, a.recover_reps = 5, min(a.rounds, 2), 8, min(a.recover_reps, 2)
    if a.warmup is None:
        a.warmup = a.every
    lcm = a.every * a.window // _gcd(a.every, a.window)
    a.steps = -(-a.steps // lcm) * lcm
    return a


def _gcd(x, y):
    while y:
        x, y = y, x % y
    return x


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = PRESETS[a.preset]
    own_workdir = a.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="dlrm-bench-ckpt-")) if own_workdir else a.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    N, M = a.every, a.window
    print(f"$ {command_line()}")
    print(f"# {machine_line()}")
    print(f"# preset {a.preset}: {sum(cfg.num_embeddings):,} rows x dim {cfg.embedding_dim} "
          f"({cfg.table_bytes / 1e6:.1f} MB of tables + optimizer state), batch {cfg.batch_size}; tier {a.tier}; "
          f"windows of {a.steps} steps x {a.rounds} rounds after {a.warmup} warm-up steps; workdir {workdir}",
          flush=True)
    report: dict = {"command": command_line(), "machine": machine_line(), "preset": a.preset, "tier": a.tier}
    try:
        if not a.no_train:
            report["train"] = bench_training(a, cfg, workdir, N, M)
        if not a.no_recovery:
            report["recovery"] = bench_recovery(a, workdir)
        if a.kaggle:
            report["kaggle"] = bench_kaggle(a, workdir)
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
            gc_shm_regions(under=workdir)  # shm regions of pools an error left behind
    print(f"\n# load avg at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


def bench_training(a, cfg, workdir: Path, N: int, M: int) -> dict:
    batches = make_batches(cfg, a.num_batches)
    variants = [
        PoolVariant("none", cfg, batches, workdir, tier=a.tier, checkpoint="none"),
        PoolVariant("undo w=1", cfg, batches, workdir, tier=a.tier, checkpoint="undo", window=1),
    ]
    if M != 1:
        variants.append(PoolVariant(f"undo w={M}", cfg, batches, workdir, tier=a.tier, checkpoint="undo",
                                    window=M))
    variants += [
        PoolVariant(f"full {N}", cfg, batches, workdir, tier=a.tier,
                    ckpt_factory=lambda pool, ds: FullSaveCheckpointer(pool, ds, every=N)),
        PoolVariant(f"incremental {N}", cfg, batches, workdir, tier=a.tier,
                    ckpt_factory=lambda pool, ds: IncrementalCheckpointer(pool, ds, every=N, keep_files=False)),
    ]
    per = {v.name: {"bytes": [], "io": [], "cpu": [], "crit": [], "wait": []} for v in variants}

    def on_window(v, before, after, steps, dt):
        b = sum(after[k] - before[k] for k in ("log_bytes", "dense_bytes", "table_bytes_persisted"))
        per[v.name]["bytes"].append(b / steps)
        per[v.name]["cpu"].append((after["cpu_seconds"] - before["cpu_seconds"]) / steps)
        if before["io_write_bytes"] >= 0:
            per[v.name]["io"].append((after["io_write_bytes"] - before["io_write_bytes"]) / steps)
        per[v.name]["crit"].append((after["critical_seconds"] - before["critical_seconds"]) / steps)
        per[v.name]["wait"].append((after["log_wait_seconds"] - before["log_wait_seconds"]) / steps)

    print("\n## training throughput", flush=True)
    try:
        for v in variants:
            t0 = time.perf_counter()
            v.setup()
            print(f"# set up {v.name} in {time.perf_counter() - t0:.1f} s (untimed)", flush=True)
        print(f"# durability: {variants[0].durability}")
        res = interleave(variants, warmup=a.warmup, steps=a.steps, rounds=a.rounds, batch_size=cfg.batch_size,
                         on_window=on_window, log=lambda s: print(s, flush=True))
        lag = {v.name: v.stats.max_commit_lag for v in variants}
    finally:
        for v in variants:
            v.close()
    base = median(res["none"]) / cfg.batch_size
    rows, out = [], {}
    for v in variants:
        sps = median(res[v.name]) / cfg.batch_size
        if v.name == "none":
            lost = "all (no recovery point)"
        elif v.name.startswith("undo"):
            lost = f"{lag[v.name] + 1} (lag {lag[v.name]})"
        else:
            lost = f"{N} (lag {lag[v.name]})"
        byt = median(per[v.name]["bytes"])
        rows.append([v.name, f"{sps:.2f}", f"{min(res[v.name]) / cfg.batch_size:.2f}-"
                     f"{max(res[v.name]) / cfg.batch_size:.2f}", f"{100 * (sps / base - 1):+.1f}%",
                     f"{1e3 * median(per[v.name]['cpu']):.0f}",
                     _mb(byt), _mb(median(per[v.name]["io"])) if per[v.name]["io"] else "?",
                     f"{1e3 * median(per[v.name]['crit']):.1f}", f"{1e3 * median(per[v.name]['wait']):.1f}",
                     f"{1e3 * median(v.drain_seconds):.0f}", lost])
        out[v.name] = {"steps_per_s": [x / cfg.batch_size for x in res[v.name]],
                       "bytes_per_step": per[v.name]["bytes"], "io_write_bytes_per_step": per[v.name]["io"],
                       "cpu_s_per_step": per[v.name]["cpu"], "critical_s_per_step": per[v.name]["crit"],
                       "log_wait_s_per_step": per[v.name]["wait"],
                       "drain_s": v.drain_seconds, "max_commit_lag": lag[v.name]}
    print()
    print(fmt_table(["variant", "steps/s (median)", "min-max", "vs none", "CPU ms/step", "MB/step (ckpt stats)",
                     "MB/step to device",
                     "ckpt critical ms/step", "log wait ms/step", "drain ms/window", "max steps lost"], rows))
    undo1 = median(res["undo w=1"]) / cfg.batch_size
    print(f"\ntarget: undo logging costs <= 3% of steps/s -> undo w=1: {100 * (1 - undo1 / base):.1f}% "
          f"slower than none" + (f"; undo w={M}: {100 * (1 - median(res[f'undo w={M}']) / cfg.batch_size / base):.1f}%"
                                 if M != 1 else ""))
    print("MB/step (ckpt stats): CheckpointStats.bytes_durable_per_step (log + dense + table bytes the "
          "checkpointer reports). MB/step to device: this process's write_bytes in /proc/self/io per step "
          "(page-granular; includes the pool's own dirty-page writeback, so `none` is not 0 on a disk tier; "
          "0 on tmpfs). ckpt critical: main-thread time in the checkpointer (log wait is part of it). CPU ms/step: process "
          "user+sys CPU per step, all threads (background checkpoint work included; less sensitive to other "
          "load than wall time).\n"
          "max steps lost: the unfinished step included (undo: stats max_commit_lag + 1; full/incremental: N). "
          "drain: end-of-window wait for background checkpoint work (counted in the window's time).")
    return out


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def bench_recovery(a, workdir: Path) -> dict:
    print(f"\n## recovery time, preset {a.preset} (tier {a.tier})", flush=True)
    pool = workdir / "pool-crash"
    r = crash_and_recover(pool, a.preset, a.tier, a.recover_reps, a.crash_step, log=lambda s: print(s, flush=True))
    print(f"# first command: {r['commands'][0]}")
    full = workdir / "full-model.pt"
    size = save_full_model(pool, full)
    loads = time_torch_load(full, a.recover_reps)
    rows = [[f"recover ({a.preset}, undo log)", f"{1e3 * median(r['recover_s']):.1f}",
             f"{1e3 * min(r['recover_s']):.1f}-{1e3 * max(r['recover_s']):.1f}",
             f"{median(r['rows_restored']):,.0f} rows restored"],
            [f"torch.load full checkpoint ({size / 1e6:.0f} MB)", f"{1e3 * median(loads):.1f}",
             f"{1e3 * min(loads):.1f}-{1e3 * max(loads):.1f}", "file in page cache (warm)"]]
    print(fmt_table(["what", "ms (median)", "min-max", "note"], rows, align="lrrl"))
    ok = max(r["recover_s"]) < 1.0
    print(f"target: recovery < 1 s -> {'met' if ok else 'NOT met'} (max {1e3 * max(r['recover_s']):.1f} ms)")
    destroy_pool(pool)
    full.unlink(missing_ok=True)
    return {**r, "torch_load_s": loads, "full_file_bytes": size}


def bench_kaggle(a, workdir: Path) -> dict:
    preset = a.kaggle_preset
    cfg = PRESETS[preset]
    need = cfg.table_bytes * (2.05 if a.kaggle_load == "torchsave" else 1.05)
    free = shutil.disk_usage(workdir).free
    print(f"\n## recovery time, preset {preset} ({sum(cfg.num_embeddings):,} rows, {cfg.table_bytes / 1e9:.2f} GB; "
          f"tier {a.tier})", flush=True)
    if free < need:
        print(f"skipped: needs ~{need / 1e9:.1f} GB free under {workdir}, has {free / 1e9:.1f} GB")
        return {"skipped": "disk"}
    pool = workdir / "pool-kaggle"
    try:
        r = crash_and_recover(pool, preset, a.tier, a.recover_reps, 2, batch_size=2048,
                              log=lambda s: print(s, flush=True))
        print(f"# first command: {r['commands'][0]}")
        if a.kaggle_load == "torchsave":
            full = workdir / "kaggle-full.pt"
            t0 = time.perf_counter()
            size = save_full_model(pool, full)
            print(f"# wrote the torch.save file ({size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", flush=True)
            loads = time_torch_load(full, 1)
            full.unlink(missing_ok=True)
            what = f"torch.load full checkpoint ({size / 1e9:.2f} GB)"
        else:
            loads, size = time_readback(pool, 1)
            what = f"read table files back ({size / 1e9:.2f} GB; lower bound for torch.load)"
        rows = [[f"recover ({preset}, undo log)", f"{1e3 * median(r['recover_s']):.1f}",
                 f"{1e3 * min(r['recover_s']):.1f}-{1e3 * max(r['recover_s']):.1f}",
                 f"{median(r['rows_restored']):,.0f} rows restored"],
                [what, f"{1e3 * median(loads):.1f}", "", "files possibly in page cache (just written)"]]
        print(f"# pool created + first crash in {r['create_and_crash_s']:.1f} s")
        print(fmt_table(["what", "ms (median)", "min-max", "note"], rows, align="lrrl"))
        ok = max(r["recover_s"]) < 1.0
        print(f"target: recovery < 1 s whatever the model size -> {'met' if ok else 'NOT met'} "
              f"(max {1e3 * max(r['recover_s']):.1f} ms)")
        return {**r, "load_s": loads, "load_kind": a.kaggle_load, "bytes": size}
    finally:
        try:
            destroy_pool(pool)
        except Exception as exc:  # noqa: BLE001
            print(f"warning: removing {pool}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
