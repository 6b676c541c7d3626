#!/usr/bin/env python
"""Tables larger than DRAM: fbgemm's fused kernels on a DRAM cache arena in front of a slow home,
against the same model fully in memory, side by side in one run (issue 26).

Variants (the same preset, seed, synthetic data and optimizers; ``--checkpoint undo`` with the
recovery window from the default budget, as ``dlrm-cxl train`` runs by default; ``--checkpoint
none`` in every variant shows what the cache costs apart from the tier's durability):

* ``memory``: every table in DRAM (tier ``dram``), no cache: the fully in-memory reference;
* ``pmem+cache``: the home on emulated pmem (``--root``: a file system), a DRAM budget of
  ``--fraction`` of the tables (``--dram-cache``);
* ``shm+cache``: the home on ``shm`` (``/dev/shm``: the emulated CXL device), the same budget;
* ``shm+cache-wt``: the same, its arena written through at every step's end
  (``DLRM_CXL_DIRECT_WRITE_BACK=0``) instead of written back and flushed at recovery points.

Each variant is a :class:`~dlrm_cxl.trainer.Trainer` driven through its API exactly as
``Trainer.run`` drives it (plans made ``--prefetch-batches`` ahead on the prefetch thread), each
in a process of its own, one after the other (so that only one model's tables are in memory at a
time), its pool destroyed after it; with ``--interleave N`` all at once, N steps at a time in
turn, the others stopped meanwhile (:class:`Gate`, :func:`run_interleaved`). After ``--warmup``
untimed steps, a window of ``--steps`` steps is timed (steady state). Printed per variant: samples/s and its ratio to ``memory``; the cache's hit rate
(distinct rows resident when their step began, prefetched ones included), rows prefetched and the
time steps waited for rows; the resident memory at the end (``RssAnon``, the pool files' page
cache by ``mincore``; on shm the region, the device, apart) against the budget; and the bytes
read from the device per step (``read_bytes`` of ``/proc/self/io``) and from the home into the
cache.

Usage::

    python tools/bench_beyond_dram.py --preset small --steps 40        # what the README's table ran
    python tools/bench_beyond_dram.py                                   # kaggle, 1/4: 2.2 GB (the lead's run)
    python tools/bench_beyond_dram.py --warmup 300 --steps 300 --variants memory,pmem+cache --rounds 4
                                        # alternating, a ratio per round and their median (noise)
    python tools/bench_beyond_dram.py --warmup 2700 --steps 600 --variants pmem+cache,memory --every 150
                                        # a long run, and samples/s per 150 steps: where the compactions fall
    python tools/bench_beyond_dram.py --warmup 2700 --steps 600 --variants memory,pmem+cache --interleave 50
                                        # the same, both at once, 50 steps at a time in turn (the drift)
    python tools/bench_beyond_dram.py --larger-than-ram --root /mnt/big # see below; not run in the suite

``--larger-than-ram``: ``kaggle`` with the smallest row width (128, 256, ... floats) whose tables,
with their Adagrad state, exceed this machine's RAM by a tenth (23 GB of RAM here: 256-dim, ~35
GB), the home on emulated pmem only (an shm home and the in-memory reference cannot hold it),
budget ``--fraction`` of it. Needs that much free under ``--root``. The emulated pmem working
copy is a private mapping of the images: every page the write-through stores to becomes
anonymous memory, given back at recovery points when the budget is reached
(``dlrm_cxl.lookahead.WorkingCopyBound``: ``trims`` in the table).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from dlrm_cxl.data import Prefetcher  # noqa: E402
from dlrm_cxl.model import PRESETS  # noqa: E402
from dlrm_cxl.options import TrainOptions  # noqa: E402
from dlrm_cxl.trainer import Trainer  # noqa: E402
from memory_pool import destroy_pool  # noqa: E402
from memory_pool.residency import pool_files, pool_memory  # noqa: E402


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def larger_than_ram(cfg):
    """``cfg`` with the smallest embedding dim (64, 128, 256, ...) whose tables, with their
    Adagrad state, are larger than this machine's RAM by a tenth."""
    ram, dim = mem_total(), cfg.embedding_dim
    while True:
        c = replace(cfg, embedding_dim=dim, bottom_mlp=(*cfg.bottom_mlp[:-1], dim))
        if c.table_bytes > 1.1 * ram:
            return c
        dim *= 2


def io_read_bytes() -> int:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def random_read_rate(root: Path, threads: int, *, size: int = 4 << 30, reads: int = 1000) -> float:
    """Random 4 KiB reads per second of the device under ``root``: ``threads`` threads of
    ``O_DIRECT`` ``preadv`` over a ``size``-byte file written for it (not in the page cache),
    ``reads`` each. What a DRAM cache's misses of a file home cost at best (``--device-floor``)."""
    import mmap
    import random
    import threading

    path = root / "random-reads.bin"
    if not path.exists() or path.stat().st_size != size:
        with open(path, "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(size >> 20):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    pages = size // 4096

    def worker(seed: int) -> None:
        buf, rng = mmap.mmap(-1, 4096), random.Random(seed)
        for _ in range(reads):
            os.preadv(fd, [buf], rng.randrange(pages) * 4096)

    try:
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return threads * reads / (time.perf_counter() - t0)
    finally:
        os.close(fd)


class PeakMemory:
    """The most DRAM a pool's trainer uses while it trains (``--peak-every``): ``RssAnon`` plus the
    pool files' page cache (``cachestat``, ~0.03 s for `kaggle`'s 12 GB of files; ``mincore`` 0.26 s), sampled every
    ``every`` seconds on a thread of its own. The end-of-run figure misses what a write-back pass
    or a compaction holds for a while (docs/tiering-measurements.md)."""

    def __init__(self, pool, every: float):
        import threading

        self.pool, self.every, self.peak = pool, every, {"dram_bytes": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            m = pool_memory(self.pool)
            if (m["dram_bytes"] or 0) > self.peak["dram_bytes"]:
                self.peak = m

    def __enter__(self):
        if self.every > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class Gate:
    """``--interleave N``, the child's side: at the start of every stretch of N steps it says where
    it is (``AT k`` on stdout) and waits for the parent's ``go`` (a line on stdin). While it waits
    the parent stops the whole process (SIGSTOP: the prefetch thread, the journal writer and the
    compactor too), so a variant's background work runs only in its own stretches and is paid in
    its own time. :meth:`clock` is ``perf_counter`` less the time spent waiting. ``every`` 0: no
    gate, the clock is ``perf_counter``."""

    def __init__(self, every: int):
        self.every, self.waited = every, 0.0

    def clock(self) -> float:
        return time.perf_counter() - self.waited

    def at(self, k: int) -> None:
        if not self.every or (k - 1) % self.every:
            return
        t = time.perf_counter()
        print(f"AT {k}", flush=True)
        line = sys.stdin.readline()
        self.waited += time.perf_counter() - t
        if line.strip() != "go":
            raise RuntimeError(f"--interleave: expected 'go' from the parent, got {line!r}")


def run_interleaved(children: list[tuple[str, list[str], dict]]) -> tuple[dict[str, dict], list[tuple[str, int]]]:
    """``--interleave N``, the parent's side: every variant's process at once, each brought alone
    to its first step, then run N steps at a time in turn (every other cycle in reverse order),
    the others stopped (SIGSTOP) at a step's start meanwhile. On this VM the speed of the machine
    drifts by 25-35 % over a quarter of an hour (docs/tiering-measurements.md, 2026-12-07), so
    two long variants run one after the other measure their order; in stretches of N steps both
    see the same drift. Returns each variant's RESULT, and the turns: (variant, the step its
    stretch began at), in the order they ran."""
    procs: dict[str, subprocess.Popen] = {}
    errs: dict[str, object] = {}
    results: dict[str, dict] = {}
    turns: list[tuple[str, int]] = []

    def until_at(v: str):
        p = procs[v]
        for line in p.stdout:
            if line.startswith("AT "):
                turns.append((v, int(line.split()[1])))
                return None
            if line.startswith("RESULT "):
                p.wait()
                return json.loads(line[7:])
        p.wait()
        errs[v].seek(0)
        raise RuntimeError(f"{v} failed (rc {p.returncode}):\n{errs[v].read().decode(errors='replace')[-3000:]}")

    try:
        for v, cmd, env in children:
            errs[v] = tempfile.TemporaryFile()
            procs[v] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errs[v],
                                        text=True, env=env)
            if (r := until_at(v)) is not None:
                results[v] = r
            else:
                os.kill(procs[v].pid, signal.SIGSTOP)
        cycle = 0
        while len(results) < len(procs):
            order = [v for v, _, _ in children if v not in results]
            for v in (order if cycle % 2 == 0 else order[::-1]):
                p = procs[v]
                os.kill(p.pid, signal.SIGCONT)
                p.stdin.write("go\n")
                p.stdin.flush()
                if (r := until_at(v)) is not None:
                    results[v] = r
                else:
                    os.kill(p.pid, signal.SIGSTOP)
            cycle += 1
        return results, turns
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()  # (SIGKILL ends a stopped process too)
                p.wait()


def base_variant(v: str) -> str:
    """``pmem+cache`` of ``pmem+cache[DLRM_CXL_COMPACT_MB=2048]``: a variant run with an
    environment of its own (``;`` between settings), beside the same variant without it."""
    return v.split("[", 1)[0]


def variant_env(v: str) -> dict[str, str]:
    """The environment of ``pmem+cache[A=1;B=2]``: ``{"A": "1", "B": "2"}`` ({} without one).
    Raises ``ValueError`` naming the setting that is not ``NAME=value``."""
    if "[" not in v:
        return {}
    body = v[v.index("[") + 1:-1] if v.endswith("]") else None
    bad = [kv for kv in (body or "").split(";") if "=" not in kv or not kv.split("=", 1)[0]]
    if body is None or bad:
        raise ValueError(f"variant {v!r}: its environment must read [NAME=value;...]"
                         + (f", got {bad[0]!r}" if bad else ", with a closing ']'"))
    return dict(kv.split("=", 1) for kv in body.split(";"))


def pool_dir(root: Path, child: str) -> Path:
    """Where the child ``child`` (``variant@lookahead``) makes its pool: one each, so that two
    lookaheads of one variant run at once (``--interleave``) never share a pool."""
    return root / re.sub(r"[^A-Za-z0-9_.-]", "-", child)


def remove_pools(root: Path, children) -> None:
    """The pools of ``children`` a failed or killed child left (an shm home's region too)."""
    for name, _, _ in children:
        path = pool_dir(root, name)
        if path.exists():
            try:
                destroy_pool(path)
            except Exception as exc:  # (one not made far enough to be a pool is refused: say where)
                print(f"left {path}: {exc}", file=sys.stderr)


def run_variant(name: str, cfg, *, tier: str, budget: int | None, pool: Path, warmup: int, steps: int,
                prefetch: int, threads: int | None, peak_every: float = 0.0, checkpoint: str = "undo",
                every: int = 0, interleave: int = 0) -> dict:
    o = TrainOptions(pool=str(pool), steps=warmup + steps, tier=tier, dram_cache_bytes=budget, threads=threads,
                     progress=False, prefetch_batches=prefetch, fresh=True, checkpoint=checkpoint)
    t0 = time.perf_counter()
    t = Trainer(o, cfg, log=lambda s: None)
    made = time.perf_counter() - t0
    try:
        arena = t.model.cache_bags.arena if t.model.cache_bags is not None else None
        # The table images were written at creation and are in the page cache: dropped (what is not
        # mapped), so that the window's reads of the home are reads of the device.
        for f in pool_files(t.pool.storage_dir):
            try:
                fd = os.open(f, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            except OSError:
                pass
        times, waits, intervals = [], [], []
        ps = t.pool.stats
        gate = Gate(interleave)
        yielded = (lambda: t.cores.steps_yielded if t.cores is not None else 0)
        mark = (gate.clock(), ps.compactions, ps.compact_cpu_seconds, yielded())
        with PeakMemory(t.pool, peak_every) as peak, \
                Prefetcher(t.plan_ahead(t.source.iter_batches(None)), depth=prefetch) as batches:
            for k in range(1, warmup + steps + 1):
                gate.at(k)
                if k == warmup + 1:
                    t.ckpt.drain()
                    st0 = dict(arena.settled_stats()) if arena is not None else None
                    io0 = io_read_bytes()
                    c0 = (ps.compactions, ps.compact_cpu_seconds)
                    w0 = gate.clock()
                tb = gate.clock()
                batch, pos, plan = next(batches)
                waits.append(gate.clock() - tb)   # (the prefetch thread behind the steps)
                times.append(t.run_step(k, batch, pos, plan)[1])  # (as Trainer.run drives it)
                if every and k % every == 0:
                    # (each stretch of steps on its own: a compaction's CPU shows in the stretch it ran in)
                    now = (gate.clock(), ps.compactions, ps.compact_cpu_seconds, yielded())
                    ov = t.pool.describe().get("overlay") or {}
                    intervals.append({"step": k, "samples_per_s": every * cfg.batch_size / (now[0] - mark[0]),
                                      "compactions": now[1] - mark[1], "compactor_cpu_s": now[2] - mark[2],
                                      "steps_on_fewer_threads": now[3] - mark[3],
                                      "run_mb": ov.get("bytes", 0) / 2**20})
                    mark = (gate.clock(), ps.compactions, ps.compact_cpu_seconds, yielded())
            t.ckpt.drain()
        window = gate.clock() - w0
        io1 = io_read_bytes()
        out = {"variant": name, "tier": tier, "budget_bytes": budget, "setup_seconds": made,
               "samples_per_s": steps * cfg.batch_size / window,
               "median_step_ms": 1e3 * statistics.median(times[warmup:]),
               # (where a mean above the median goes: slow steps, or steps waiting for their batch)
               "mean_step_ms": 1e3 * statistics.fmean(times[warmup:]),
               "p90_step_ms": 1e3 * statistics.quantiles(times[warmup:], n=10)[-1] if steps > 1 else None,
               "batch_wait_ms_per_step": 1e3 * sum(waits[warmup:]) / steps,
               "device_read_bytes_per_step": (io1 - io0) / steps if io0 >= 0 else None, "intervals": intervals,
               # (those that ended in the timed window: a window of a few hundred steps holds one or two)
               "compactions": ps.compactions - c0[0], "compactor_cpu_s": ps.compact_cpu_seconds - c0[1],
               # (dlrm_cxl/cores.py: off where the model's dense layers are not bit-identical on one thread fewer)
               "core_yield": bool(t.cores is not None and t.cores.enabled)}
        if arena is not None:
            st1 = arena.settled_stats()
            d = {k: st1[k] - st0[k] for k in ("rows_needed", "hits", "misses", "rows_prefetched", "bytes_read_home",
                                             "wait_seconds", "evictions", "dirty_evictions", "rows_created")}
            out["cache"] = {**d, "hit_rate": d["hits"] / max(d["rows_needed"], 1),
                            "wait_ms_per_step": 1e3 * d["wait_seconds"] / steps,
                            "home_read_bytes_per_step": d["bytes_read_home"] / steps,
                            "arena_bytes": arena.nbytes}
        out["memory"] = pool_memory(t.pool, budget_bytes=budget, cache_bytes=arena.nbytes if arena else 0)
        if peak_every > 0:
            out["memory"]["peak_dram_bytes"] = peak.peak["dram_bytes"]
            out["memory"]["peak_pool_page_cache_bytes"] = peak.peak.get("pool_page_cache_bytes", 0)
        if t.bound is not None:
            out["memory"].update(t.bound.as_dict())
        return out
    finally:
        t.close()
        destroy_pool(pool)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kaggle", choices=sorted(PRESETS))
    ap.add_argument("--fraction", type=float, default=0.25, help="DRAM budget as a fraction of the tables (default 1/4)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100, help="timed steps per variant (steady state)")
    ap.add_argument("--prefetch-batches", default="2", help="batches of lookahead; a list (1,2,4) runs each")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--root", type=Path, default=None, help="where the pools go (default: a temporary directory)")
    ap.add_argument("--variants", default="memory,pmem+cache,shm+cache")
    ap.add_argument("--larger-than-ram", action="store_true",
                    help="kaggle with 128-dim rows (~17.5 GB), pmem home only: see the module docstring")
    ap.add_argument("--device-floor", action="store_true",
                    help="also measure the device's random 4 KiB reads/s under --root (1 and 16 at a time; a 4 GiB "
                         "file) and print the device time a file home's misses need per step at best")
    ap.add_argument("--peak-every", type=float, default=0.0,
                    help="also sample the DRAM each variant uses (RssAnon + the pool files' page cache) every this many "
                         "seconds while it trains, and print the peak (0: off; sampling costs some CPU)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variants this many times, every other round in reverse order; each ratio is "
                         "against its own round's memory run, and the median ratio is printed (this VM is noisy)")
    ap.add_argument("--checkpoint", choices=("undo", "none"), default="undo",
                    help="none: no recovery points in any variant (what the cache costs without the tier's durability)")
    ap.add_argument("--every", type=int, default=0,
                    help="also print, per stretch of this many steps (warm-up included), each variant's samples/s, "
                         "the compactions that ended in it and the compactor's CPU (0: off)")
    ap.add_argument("--interleave", type=int, default=0,
                    help="run the variants' processes at once, this many steps at a time in turn, the others stopped "
                         "(SIGSTOP) meanwhile: each variant's time is its own stretches', so the machine's drift hits "
                         "all alike (0: one after the other; the machine needs all the variants' memory at once)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (a child: one variant, JSON on stdout)
    a = ap.parse_args(argv)
    cfg = PRESETS[a.preset]
    variants = a.variants.split(",")
    if a.larger_than_ram:
        cfg = larger_than_ram(PRESETS["kaggle"])
        variants = ["pmem+cache"]
    budget = int(cfg.table_bytes * a.fraction)
    root = a.root or Path(tempfile.mkdtemp(prefix="bench-beyond-dram-", dir=os.environ.get("TMPDIR", "/tmp")))
    print(f"preset {a.preset}{f' ({cfg.embedding_dim}-dim: larger than RAM)' if a.larger_than_ram else ''}: tables "
          f"{cfg.table_bytes / 1e9:.3f} GB, DRAM budget {budget / 1e9:.3f} GB ({a.fraction:g}); warmup {a.warmup}, "
          f"{a.steps} timed steps, lookahead {a.prefetch_batches}; torch threads {torch.get_num_threads()}", flush=True) \
        if a.one is None else None
    spec = {"memory": ("dram", None), "pmem+cache": ("pmem", budget), "shm+cache": ("shm", budget),
            "shm+cache-wt": ("shm", budget), "pmem": ("pmem", None), "shm": ("shm", None)}
    # (shm+cache-wt: see the module docstring; the child reads it at its arena's binding)
    env = {"shm+cache-wt": {"DLRM_CXL_DIRECT_WRITE_BACK": "0"}}
    if a.one is not None:  # (a child process: one variant)
        v, k = a.one.rsplit("@", 1)
        tier, b = spec[base_variant(v)]
        r = run_variant(v, cfg, tier=tier, budget=b, pool=pool_dir(root, a.one), warmup=a.warmup, steps=a.steps,
                        prefetch=int(k), threads=a.threads, peak_every=a.peak_every, checkpoint=a.checkpoint,
                        every=a.every, interleave=a.interleave)
        print("RESULT " + json.dumps(r), flush=True)
        return 0
    # Each variant in a process of its own, one after the other: the resident memory of one is
    # not what the allocator kept of the one before, and only one model's tables exist at a time.
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    if a.every < 0:
        ap.error(f"--every must be >= 0, got {a.every}")
    if a.interleave < 0:
        ap.error(f"--interleave must be >= 0, got {a.interleave}")
    results = []
    ks = [int(x) for x in str(a.prefetch_batches).split(",")]
    unknown = [v for v in variants if base_variant(v) not in spec]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}: one of {', '.join(spec)}, optionally with an environment "
                 f"in brackets, e.g. 'pmem+cache[DLRM_CXL_COMPACT_MB=2048]'")
    for v in variants:
        try:
            variant_env(v)
        except ValueError as exc:
            ap.error(str(exc))
    runs = [(v, k) for v in variants for k in (ks if spec[base_variant(v)][1] is not None else ks[:1])]
    for rnd in range(a.rounds):
        children = []
        for v, k in (runs if rnd % 2 == 0 else runs[::-1]):
            cmd = [sys.executable, __file__, "--one", f"{v}@{k}", "--preset", a.preset, "--fraction", str(a.fraction),
                   "--warmup", str(a.warmup), "--steps", str(a.steps), "--root", str(root)]
            cmd += ["--threads", str(a.threads)] if a.threads else []
            cmd += ["--peak-every", str(a.peak_every)] if a.peak_every > 0 else []
            cmd += ["--larger-than-ram"] if a.larger_than_ram else []
            cmd += ["--checkpoint", a.checkpoint, "--every", str(a.every), "--interleave", str(a.interleave)]
            children.append((f"{v}@{k}", cmd, {**os.environ, **env.get(base_variant(v), {}), **variant_env(v)}))
        if a.interleave:
            try:
                got, _ = run_interleaved(children)
            except RuntimeError as e:
                print(e, file=sys.stderr)
                remove_pools(root, children)
                return 1
            except KeyboardInterrupt:   # (run_interleaved killed the children: their pools go too)
                remove_pools(root, children)
                raise
        else:
            got = {}
            for name, cmd, e in children:
                p = subprocess.run(cmd, capture_output=True, text=True, env=e)
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if p.returncode or not line:
                    print(f"{name} failed (rc {p.returncode}):\n{p.stderr[-3000:]}", file=sys.stderr)
                    remove_pools(root, children)
                    return 1
                got[name] = json.loads(line[-1][7:])
        for name, _, _ in children:
            v, k = name.rsplit("@", 1)
            r = got[name]
            r["variant"] = name if spec[base_variant(v)][1] is not None and len(ks) > 1 else v
            r["round"] = rnd
            results.append(r)
            print(json.dumps({x: r[x] for x in ("variant", "samples_per_s", "median_step_ms", "mean_step_ms", "p90_step_ms",
                                                "batch_wait_ms_per_step", "compactions", "compactor_cpu_s")}),
                  flush=True)
    base = {r["round"]: r["samples_per_s"] for r in results if r["variant"] == "memory"}
    print()
    print(f"{'variant':<12} {'samples/s':>10} {'x memory':>8} {'hit rate':>8} {'wait ms':>8} {'home MB/st':>10} "
          f"{'dev MB/st':>9} {'made/st':>7} {'evict/st':>8} {'anon MB':>8} {'pcache MB':>9} {'DRAM MB':>8} {'budget MB':>9} {'shm dev MB':>10} "
          f"{'trim/refr':>9} {'copy MB peak':>12}" + (f" {'DRAM MB peak':>12}" if a.peak_every > 0 else ""))
    for r in results:
        c, m = r.get("cache"), r["memory"]
        dev = r["device_read_bytes_per_step"]
        cells = [r["variant"], f"{r['samples_per_s']:,.0f}",
                 f"{r['samples_per_s'] / base[r['round']]:.2f}" if r["round"] in base else "-",
                 f"{c['hit_rate']:.1%}" if c else "-",
                 f"{c['wait_ms_per_step']:.2f}" if c else "-",
                 f"{c['home_read_bytes_per_step'] / 1e6:.2f}" if c else "-",
                 f"{dev / 1e6:.2f}" if dev is not None else "-",
                 f"{c['rows_created'] / a.steps:,.0f}" if c else "-",
                 f"{c['evictions'] / a.steps:,.0f}" if c else "-",
                 f"{m.get('rss_anon', 0) / 1e6:.1f}", f"{m['pool_page_cache_bytes'] / 1e6:.1f}",
                 f"{(m['dram_bytes'] or 0) / 1e6:.1f}", f"{budget / 1e6:.1f}" if r["budget_bytes"] else "-",
                 f"{m['shm_device_bytes'] / 1e6:.1f}",
                 f"{m['trims']}/{m['refreshes']}" if "trims" in m else "-",
                 f"{m['peak_working_copy_bytes'] / 1e6:.1f}" if "peak_working_copy_bytes" in m else "-"]
        widths = [12, 10, 8, 8, 8, 10, 9, 7, 8, 8, 9, 8, 9, 10, 9, 12]
        if a.peak_every > 0:
            cells.append(f"{m.get('peak_dram_bytes', 0) / 1e6:.1f}")
            widths.append(12)
        print(" ".join(f"{x:<{w}}" if i == 0 else f"{x:>{w}}" for i, (x, w) in enumerate(zip(cells, widths))))
    print("\nDRAM = anonymous memory + the pool files' page cache (the whole process: torch, the MLPs, the "
          "journal's buffers included); shm dev = the shm region, the emulated CXL device, outside the budget; "
          "made/st = missed rows created from the initializer a step, not read (memory_pool/fresh.py); "
          "evict/st = rows evicted a step (0 while never-used slots remain); "
          "trim/refr = working copies given back at recovery points (journaled homes): trims (every committed row home: the row overlay's runs, the dense pages in place) / refreshes (only the rows the cache wrote into the working copy), copy MB peak = the most anonymous memory "
          "the working copy's copy-on-write pages held at one (the budget beside the arena, plus a window's writes)" +
          ("; DRAM MB peak = the most DRAM sampled while the variant trained (--peak-every)" if a.peak_every > 0 else ""))
    if a.every:
        print(f"\nper {a.every} steps (warm-up included): samples/s, and the compactions that ended in the stretch with "
              f"the compactor's CPU (s) and the steps that ran on one intra-op thread fewer beside one (dlrm_cxl/cores.py; "
              f"'no yield': the model's dense layers differ on fewer threads here, so every step keeps them all); the "
              f"in-memory variant's only drop its journal's segments")
        for r in results:
            print(f"  {r['variant']:<12} " + "  ".join(
                f"{i['step']}: {i['samples_per_s']:,.0f}" +
                (f" [{i['compactions']}c {i['compactor_cpu_s']:.1f}s {i.get('steps_on_fewer_threads', 0)}y]"
                 if i["compactions"] else "")
                for i in r["intervals"]) + ("" if r.get("core_yield", True) else "  (no yield)"))
    if a.rounds > 1 and base:
        print(f"\nover {a.rounds} rounds (every other one in reverse order), each against its own round's memory run:")
        for v in dict.fromkeys(r["variant"] for r in results if r["variant"] != "memory"):
            ratios = sorted(r["samples_per_s"] / base[r["round"]] for r in results
                            if r["variant"] == v and r["round"] in base)
            print(f"  {v}: median {statistics.median(ratios):.2f}x of memory (" +
                  ", ".join(f"{x:.2f}" for x in ratios) + ")")
    floor = None
    if a.device_floor:
        rates = {k: random_read_rate(root, k) for k in (1, 16)}
        (root / "random-reads.bin").unlink(missing_ok=True)
        mem = next((r for r in results if r["variant"] == "memory"), None)
        print(f"\ndevice floor: random 4 KiB reads {rates[1]:,.0f}/s one at a time, {rates[16]:,.0f}/s sixteen at a time")
        floor = {"reads_per_s": rates, "variants": {}}
        for r in results:
            c = r.get("cache")
            if c is None or not r["tier"].startswith("pmem"):
                continue
            # (a miss reads a page of every member: the row, and its optimizer state in its own file)
            pages = (c["misses"] + c["rows_prefetched"]) / a.steps * (2 if cfg.embedding_optimizer.kind == "rowwise_adagrad" else 1)
            best = pages / rates[16]
            bound = f", at most {mem['median_step_ms'] / 1e3 / best:.2f}x of memory" if mem else ""
            print(f"  {r['variant']}: {pages:,.0f} page reads a step: >= {1e3 * best:.0f} ms of device time{bound}")
            floor["variants"][r["variant"]] = {"page_reads_per_step": pages, "device_ms_per_step": 1e3 * best}
    if a.json:
        a.json.write_text(json.dumps({"preset": a.preset, "budget_bytes": budget, "results": results,
                                      "device_floor": floor}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
