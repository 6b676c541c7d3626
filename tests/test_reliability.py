"""Faults during training, with real processes and real files: a full disk and a failing device
while the journal is written, a non-finite gradient behind a finite loss, and readers beside a
writer that is training the pool right now.

Each fault must stop training with one clear line and its exit code, lose nothing that was
committed, and leave a pool that resumes bit for bit (compared with an uninterrupted run).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrm_cxl.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY = ["--preset", "tiny", "--threads", "1", "--no-progress"]
DIGEST_RE = re.compile(r"^state_digest ([0-9a-f]{64})$", re.M)


def cli(*argv, prelude: str = "", timeout: int = 180) -> subprocess.CompletedProcess:
    """``dlrm-cxl ARGV`` in a fresh interpreter, after running ``prelude`` there (fault injection)."""
    code = (f"import sys, os, signal, resource\n{prelude}\n"
            f"from dlrm_cxl.cli import main\nsys.exit(main({[str(a) for a in argv]!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def digest_of(proc: subprocess.CompletedProcess) -> str:
    m = DIGEST_RE.search(proc.stdout)
    assert m, proc.stdout + proc.stderr
    return m.group(1)


def one_line_error(proc, code: int, *needles) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("dlrm-cxl train: error:")]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Digests of uninterrupted tiny runs, per tier."""
    from memory_pool import destroy_pool

    out, made = {}, []
    for tier in ("power-sim", "shm"):
        made.append(tmp_path_factory.mktemp("ref") / tier)
        p = cli("train", "--pool", made[-1], *TINY, "--tier", tier, "--steps", 12)
        assert p.returncode == 0, p.stderr
        out[tier] = digest_of(p)
    yield out
    for pool in made:
        destroy_pool(pool)


def _journal_bytes(pool: Path) -> int:
    from memory_pool import MemoryPool

    with MemoryPool.open(pool, read_only=True) as p:
        return sum(f.stat().st_size for f in (p.storage_dir / "journal").glob("seg-*.log"))


def test_full_disk_while_the_journal_is_written_stops_with_exit_6_and_the_pool_resumes_bit_exact(tmp_path, reference):
    pool = tmp_path / "pool"
    # (--window 1: a recovery point, ~180 kB, every step)
    assert cli("train", "--pool", pool, *TINY, "--tier", "power-sim", "--steps", 3, "--window", 1).returncode == 0
    # The journal segment may grow by ~4 more steps, then writes fail with EFBIG: a full disk.
    limit = _journal_bytes(pool) + 4 * 180_000
    p = cli("train", "--pool", pool, "--steps", 12, "--threads", 1, "--no-progress", "--window", 1,
            prelude=f"signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                    f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))")
    one_line_error(p, 6, "File too large", "hint:")
    info = json.loads(cli("inspect", "--pool", pool, "--json").stdout)
    assert 3 <= info["step"] < 12  # every committed step is there; the failed one is not
    p = cli("train", "--pool", pool, "--steps", 12, "--threads", 1, "--no-progress")
    assert p.returncode == 0, p.stderr
    assert digest_of(p) == reference["power-sim"]


@pytest.mark.parametrize("tier", ["power-sim", "shm"])
def test_device_error_while_the_journal_is_written_stops_with_exit_9_and_the_pool_resumes_bit_exact(
        tmp_path, reference, tier):
    pool = tmp_path / "pool"
    assert cli("train", "--pool", pool, *TINY, "--tier", tier, "--steps", 3).returncode == 0
    # The 6th write to the journal fails with EIO (an injected device error). The journal's one
    # write path: a direct pwrite on a disk, a copy into the segment's mapping on shm (there the
    # error stands for a failing mapping).
    prelude = """
import errno, memory_pool.journal as J
real, calls = J.Journal._write, [0]
def failing(self, *args):
    calls[0] += 1
    if calls[0] == 6:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    return real(self, *args)
J.Journal._write = failing
"""
    p = cli("train", "--pool", pool, "--steps", 12, "--threads", 1, "--no-progress", prelude=prelude)
    one_line_error(p, 9, "Input/output error", "hint:")
    p = cli("train", "--pool", pool, "--steps", 12, "--threads", 1, "--no-progress")
    assert p.returncode == 0, p.stderr
    assert digest_of(p) == reference[tier]


def test_non_finite_gradient_behind_a_finite_loss_is_refused_before_any_row_is_written(tmp_path):
    """The fused kernels write rows in place during backward: a NaN gradient must be stopped
    before that (exit 8), leaving the pool at the previous step with nothing to roll back."""
    import torch

    from checkpointing import checkpoint_status, committed_state, state_digest
    from dlrm_cxl.errors import TrainingDivergedError
    from dlrm_cxl.model import PRESETS
    from dlrm_cxl.options import TrainOptions
    from dlrm_cxl.trainer import Trainer
    from memory_pool import MemoryPool

    for tier in ("shm", "power-sim"):
        path = tmp_path / tier
        tr = Trainer(TrainOptions(pool=str(path), steps=6, tier=tier, threads=1, progress=False), PRESETS["tiny"],
                     log=lambda s: None)
        assert tr.fused
        real = tr.model.forward_fused

        def poisoned(dense, plan):  # the pooled gradient becomes NaN at step 4; the loss stays finite
            logits, pooled = real(dense, plan)
            if tr.step == 3:
                pooled.register_hook(lambda g: torch.full_like(g, float("nan")))
            return logits, pooled

        tr.model.forward_fused = poisoned
        try:
            with pytest.raises(TrainingDivergedError) as ei:
                tr.run()
            assert ei.value.exit_code == 8 and "gradient of step 4 is not finite" in str(ei.value)
        finally:
            tr.close()
        with MemoryPool.open(path, read_only=True) as p:
            st = checkpoint_status(p)
            assert st["committed_step"] == 3 and not st["needs_recovery"], st
            step, dense = committed_state(p)
            rows_ok = all(bool(torch.isfinite(p.table(n).view()).all()) for n in p.tables())
            assert rows_ok
        # The pool equals a run that stopped cleanly at step 3.
        ref = Trainer(TrainOptions(pool=str(tmp_path / f"ref-{tier}"), steps=3, tier=tier, threads=1, progress=False),
                      PRESETS["tiny"], log=lambda s: None)
        ref.run()
        want = ref.digest()
        ref.close()
        with MemoryPool.open(path, read_only=True) as p:
            assert state_digest(p, committed_state(p)[1]) == want


def test_readers_beside_a_training_writer_refuse_or_see_a_committed_state(tmp_path):
    """inspect (with its digest), eval and export while `train` runs on the same pool: a clear
    refusal (exit 5), never a torn state reported as committed; `inspect --no-digest` answers."""
    pool = tmp_path / "pool"
    assert cli("train", "--pool", pool, *TINY, "--tier", "shm", "--steps", 2).returncode == 0
    writer = subprocess.Popen([sys.executable, "-m", "dlrm_cxl", "train", "--pool", str(pool), "--steps", "100000",
                               "--threads", "1", "--no-progress"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # until the writer holds the lock and trains
            code, out, err = _run_main("inspect", "--pool", pool, "--json", "--no-digest")
            if code == 0 and json.loads(out)["step"] > 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the writer never committed a step")
        for argv in (["inspect", "--pool", pool], ["eval", "--pool", pool, "--json"],
                     ["export", "--pool", pool, "--out", tmp_path / "x.pt"]):
            code, out, err = _run_main(*argv)
            assert code == 5, (argv, code, err)
            assert "is being trained" in err and "hint:" in err and "Traceback" not in err
        assert not (tmp_path / "x.pt").exists()
        code, out, _ = _run_main("inspect", "--pool", pool, "--no-digest")  # (_: stderr)
        assert code == 0 and "state_digest" not in out, (code, _)
    finally:
        writer.kill()
        writer.wait()
    # The writer was SIGKILLed mid-run: a reader now gets the recovered, committed state.
    assert _run_main("recover", "--pool", pool)[0] == 0
    code, out, _ = _run_main("inspect", "--pool", pool, "--json")
    assert code == 0 and json.loads(out)["state_digest"]


def _run_main(*argv):
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("case", ["dram-cache", "eval-every"])
def test_crash_with_cached_tables_or_periodic_eval_recovers_bit_exact(tmp_path, case):
    """Crash coverage beyond the default path: tables behind a DRAM row cache (the reference
    kernels, on shm: undo records restored into a cached table) and a run that evaluates every
    few steps (evaluation must not perturb what is resumed)."""
    extra = ["--dram-cache", "300000"] if case == "dram-cache" else ["--eval-every", "3"]
    ref = cli("train", "--pool", tmp_path / "ref", *TINY, "--tier", "shm", "--steps", 10, *extra)
    assert ref.returncode == 0, ref.stderr
    pool = tmp_path / "pool"
    p = cli("train", "--pool", pool, *TINY, "--tier", "shm", "--steps", 10, *extra, "--crash-at", "7:mid-update")
    assert p.returncode == -9 and "crash injection: SIGKILL at step 7 mid-update" in p.stderr, p.stderr[-2000:]
    rec = cli("recover", "--pool", pool, "--json")
    assert rec.returncode == 0, rec.stderr
    doc = json.loads(rec.stdout)
    # (recovery windows: back to the window's start, then the committed steps replayed)
    assert 7 in doc["rolled_back_steps"] and doc["rows_restored"] > 0 and doc["committed_step"] in (5, 6), doc
    p = cli("train", "--pool", pool, "--steps", 10, "--threads", 1, "--no-progress", *extra)
    assert p.returncode == 0, p.stderr
    assert digest_of(p) == digest_of(ref)
