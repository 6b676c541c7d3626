#!/usr/bin/env python
"""What a recovery point costs, measured against the physical limit of this machine.

Two parts, in one run:

1. **The machine's limits** for the bytes one step makes durable: memcpy, crc32c, ``pwrite``
   into pages the page cache already holds (tmpfs and the disk's filesystem), ``pwrite`` into
   fresh pages, and ``fdatasync`` of that much sequential data.
2. **The checkpointer alone**, per tier: the undo log's protocol for real steps of the preset
   (``begin_step``, ``log_before_image`` of the step's rows, ``persist``, ``commit`` with the
   dense state) with no compute around it (torch on one thread; the journal writer on its own
   thread, or with ``--inline`` on the same one), over enough steps that the journal is
   compacted and its segments recycled (the steady state). CPU ms per step, and that as a
   multiple of the memcpy + crc32c + cached-``pwrite`` floor for the same bytes.

Training throughput with and without checkpointing is ``tools/bench_train.py``; this tool
says how far the checkpointer itself is from what the hardware needs.

    python tools/bench_durability.py                       # small, shm,pmem,power-sim
    python tools/bench_durability.py --tiers pmem --steps 400
    python tools/bench_durability.py --tiers shm --inline --warmup 60 --steps 150   # one thread
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from dlrm_cxl.model import PRESETS  # noqa: E402
from dlrm_cxl.options import TrainOptions  # noqa: E402
from checkpointing import UndoLogCheckpointer  # noqa: E402
from dlrm_cxl.trainer import Trainer  # noqa: E402
from memory_pool import destroy_pool  # noqa: E402
from memory_pool.records import crc32c_extend  # noqa: E402


def _best(fn, reps: int = 7) -> float:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def machine_limits(nbytes: int, disk_dir: Path, row_bytes: int = 0, row_size: int = 256) -> dict[str, float]:
    """Milliseconds for ``nbytes``: the floor of each operation a recovery point needs. With
    ``row_bytes``, also ``gather``: copying that many bytes of distinct random rows of
    ``row_size`` bytes out of a 512 MiB table (larger than the caches, as the pool's tables are)
    into one buffer, with one ``index_select``: what a step's touched rows cost to collect."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    arr = src.numpy()
    out = {"memcpy": _best(lambda: dst.copy_(src)),
           "crc32c": _best(lambda: crc32c_extend(0, arr))}
    if row_bytes:
        table = torch.ones((512 << 20) // row_size, row_size // 4, dtype=torch.float32)
        n = min(row_bytes // row_size, table.shape[0])
        # (other rows every time: rows still in the caches from the last repetition would make
        # the floor one that no step meets)
        sets = iter([torch.randperm(table.shape[0])[:n].sort().values for _ in range(8)])
        rows = torch.empty(n, table.shape[1], dtype=table.dtype)
        out["gather"] = _best(lambda: torch.index_select(table, 0, next(sets), out=rows))
        del table
    for name, d in (("tmpfs", Path("/dev/shm")), ("disk", disk_dir)):
        path = d / f"dlrm-cxl-bench-durability-{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(fd, arr, 0)
            out[f"pwrite_cached_{name}"] = _best(lambda: os.pwrite(fd, arr, 0))

            def fresh():
                os.ftruncate(fd, 0)
                os.pwrite(fd, arr, 0)
            out[f"pwrite_fresh_{name}"] = _best(fresh)
            if name == "disk":
                def sync():
                    os.pwrite(fd, arr, 0)
                    os.fdatasync(fd)
                out["fdatasync_disk"] = _best(sync, reps=5) - out["pwrite_cached_disk"]
        finally:
            os.close(fd)
            os.unlink(path)
    return {k: v * 1e3 for k, v in out.items()}


def checkpointer_cost(preset: str, tier: str, steps: int, workdir: Path, warmup: int | None = None,
                      inline: bool = False, batches: int = 8) -> dict:
    """The undo log alone on ``tier`` for ``steps`` steps after a warm-up that fills and
    recycles the journal. ``inline``: the writer's work runs on this thread (no second thread
    competing for the cores: the checkpointer's own CPU, the steadiest number on a noisy VM).
    ``batches``: distinct batches, cycled (more of them: more distinct rows for a compaction to
    write back, as in training)."""
    pool = workdir / f"pool-{tier}"
    o = TrainOptions(pool=str(pool), tier=tier, steps=10**9, checkpoint="undo", progress=False, threads=1)
    tr = Trainer(o, PRESETS[preset], log=lambda s: None)
    try:
        if inline:
            dense_state = tr.ckpt.dense_state
            tr.ckpt.close()
            tr.ckpt = UndoLogCheckpointer(tr.pool, dense_state, inline=True)
        src = tr.source.iter_batches(None)
        plans = [tr.model.plan(next(src)[0].sparse, fused=True, rows=True) for _ in range(batches)]
        ck, j = tr.ckpt, tr.pool.journal

        def step(k: int) -> None:
            ck.begin_step(k)
            ck.log_before_image(tr.sparse_opt.touched(plans[k % len(plans)]))
            ck.persist()
            ck.mark_updated()
            ck.commit(k)

        k = 0
        warm_until = time.perf_counter() + 120
        # The steady state: the journal compacted and a segment reused (or a fixed count).
        while (k < warmup if warmup is not None else (k < 8 or j.recycled == 0)) and time.perf_counter() < warm_until:
            k += 1
            step(k)
        ck.drain()
        gc.collect()
        gc.freeze()  # as Trainer.run does
        s0 = ck.stats.as_dict()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for k in range(k + 1, k + 1 + steps):
            step(k)
        ck.drain()
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        s1 = ck.stats.as_dict()
        tr.pool.wait_compaction()
        ps = tr.pool.stats
        durable = (s1["log_bytes"] + s1["dense_bytes"] + s1["table_bytes_persisted"]
                   - s0["log_bytes"] - s0["dense_bytes"] - s0["table_bytes_persisted"]) / steps
        rows = (s1["log_bytes"] + s1["table_bytes_persisted"] - s0["log_bytes"] - s0["table_bytes_persisted"]) / steps
        return {"tier": tier, "warmup_steps": k - steps, "recycled_segments": getattr(j, "recycled", 0),
                "cpu_ms": (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / steps * 1e3,
                "sys_ms": (r1.ru_stime - r0.ru_stime) / steps * 1e3,
                "wall_ms": (t1 - t0) / steps * 1e3, "durable_bytes": durable, "row_bytes": rows, "steps_run": k,
                "compactions": ps.compactions, "compact_s": ps.compact_seconds, "compact_cpu_s": ps.compact_cpu_seconds}
    finally:
        gc.unfreeze()  # (the next tier's trainer, built in this process, frees this one's memory)
        tr.close()
        destroy_pool(pool)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--tiers", default="shm,pmem,power-sim")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per tier, after the warm-up")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps first (default: until a journal segment has been reused)")
    ap.add_argument("--workdir", type=Path, default=None, help="where pmem/power-sim pools go (a real disk)")
    ap.add_argument("--inline", action="store_true",
                    help="run the journal writer's work on the stepping thread (one thread in all)")
    ap.add_argument("--batches", type=int, default=8, help="distinct batches, cycled (default 8)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    work = a.workdir or Path(tempfile.mkdtemp(prefix="dlrm-bench-durability-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        rows = [checkpointer_cost(a.preset, t, a.steps, work, a.warmup, a.inline, a.batches) for t in a.tiers.split(",")]
        per_step = max(r["durable_bytes"] for r in rows)
        row_part = max(r["row_bytes"] for r in rows)
        lim = machine_limits(int(per_step), work, int(row_part), PRESETS[a.preset].embedding_dim * 4)
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    mb = per_step / 1e6
    print(f"# preset {a.preset}: {mb:.2f} MB made durable per step; {'writer inline (one thread)' if a.inline else 'writer on its own thread'}; load avg "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"machine limits for {mb:.2f} MB (ms):  " + "  ".join(f"{k} {v:.2f}" for k, v in lim.items()))
    floor = lim["memcpy"] + lim["crc32c"] + lim["pwrite_cached_tmpfs"]
    print(f"floor of a recovery point (memcpy + crc32c + cached pwrite): {floor:.2f} ms CPU; "
          f"on disk also fdatasync {lim['fdatasync_disk']:.2f} ms of device time (overlaps compute)")
    # A mapped journal (shm) is written by the copies themselves (no pwrite): the rows are
    # gathered into it, the dense state copied into it, and all of it checksummed.
    mapped = lim["gather"] + lim["memcpy"] * (per_step - row_part) / per_step + lim["crc32c"]
    print(f"floor on a mapped journal (shm): gather of the {row_part / 1e6:.2f} MB of rows + memcpy of the "
          f"{(per_step - row_part) / 1e6:.2f} MB of dense state + crc32c of all = {mapped:.2f} ms CPU")
    print(f"{'tier':10s} {'MB/step':>8s} {'CPU ms/step':>12s} {'of which sys':>13s} {'wall ms/step':>13s} "
          f"{'x floor':>8s} {'warm-up steps':>14s} {'recycled segs':>14s}")
    for r in rows:
        print(f"{r['tier']:10s} {r['durable_bytes'] / 1e6:8.2f} {r['cpu_ms']:12.2f} {r['sys_ms']:13.2f} "
              f"{r['wall_ms']:13.2f} {r['cpu_ms'] / floor:8.1f} {r['warmup_steps']:14d} {r['recycled_segments']:14d}")
    for r in rows:
        if r["compactions"]:
            n = r["compactions"]
            print(f"{r['tier']}: {n} compaction(s) in {r['steps_run']} steps: {r['compact_s'] / n:.3f} s wall, "
                  f"{r['compact_cpu_s'] / n:.3f} s CPU of the compactor's thread each ({r['compact_cpu_s'] / r['steps_run'] * 1e3:.2f} "
                  f"ms of CPU a step, amortised; on its own thread, in the background)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
