"""The checkpointer: its on-media formats (the dense-state record of ``checkpointing.store``; the
journal itself is tested in test_journal.py), the Python API (``checkpointing.recover``,
``UndoLogCheckpointer`` and its ``with ckpt.step(k)`` protocol) and the journal's bounded size
under training. (The torture tool, ``tools/torture.py --quick``, is run by test_torture.py.)

CLI runs are real processes forked from one warm interpreter (``tools/torture.py``'s
:class:`ForkServer`; ``DLRM_CXL_TEST_FRESH=1`` makes each a fresh ``python -m dlrm_cxl``). The
runs that need an environment variable use fresh processes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpointing
from checkpointing import Step, UndoLogCheckpointer, checkpoint_status, committed_state, recover, state_digest
from checkpointing.store import DensePacker, commit_doc, is_commit, unpack_dense
from dlrm_cxl.data import Prefetcher
from helpers import flip, tool
from memory_pool import MemoryPool, PoolCorruptError, PoolFormatError
from memory_pool.pool import RowGather
from memory_pool.errors import RecoveryError
from memory_pool.journal import Journal, RecordType
from memory_pool.records import Fill, decode_row_set, materialize

REPO = Path(__file__).resolve().parents[1]
torture = tool("torture")


def _baselines():
    """tools/baselines.py, the benchmarks' baseline checkpointers (not part of the packages),
    imported as the tools import it: ``baselines`` with tools/ on ``sys.path``."""
    tools = str(REPO / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import baselines
    return baselines


def flags(tier="pmem", *extra) -> list[str]:
    # (--window 1: a recovery point every step, unless ``extra`` gives another --window)
    return ["--preset", "tiny", "--tier", tier, "--threads", "1", "--no-progress", "--window", "1", *map(str, extra)]


def ok_json(proc) -> dict:
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def storage_dir(pool: Path) -> Path:
    """Where a pool's journal and table files live (the shm region for tier shm)."""
    header = json.loads((Path(pool) / "pool.json").read_text())
    return Path(header["storage_dir"]) if header["tier"] == "shm" else Path(pool)


def pool_files(pool: Path) -> dict[str, str]:
    """sha256 of every file of a pool (its shm region included), but its LOCK."""
    out = {}
    for base in dict.fromkeys([Path(pool), storage_dir(pool)]):
        for p in sorted(base.rglob("*")):
            if p.is_file() and p.name != "LOCK":
                out[f"{base.name}/{p.relative_to(base)}"] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def pool_state(pool: Path) -> dict[str, str]:
    """What a failed recovery must not change: every file byte for byte -- but on a journaled
    tier the table images, which every writable open brings up to date with the journal's
    committed rows (an idempotent replay that changes no row's value), by their rows' values."""
    files = pool_files(pool)
    with MemoryPool.open(pool, read_only=True) as p:
        if not p.journaled:
            return files
        files = {k: v for k, v in files.items() if "/tables/" not in k}
        for name in p.tables():
            t = p.table(name)
            rows = t.read(torch.arange(t.num_embeddings))
            files[f"rows:{name}"] = hashlib.sha256(rows.view(torch.uint8).numpy().tobytes()).hexdigest()
    return files


# --------------------------------------------------------------------------- the dense-state record (store.py)


def _dense_state() -> dict:
    """A dense state shaped like the trainer's, with every kind of leaf the record must carry."""
    g = torch.Generator().manual_seed(0)
    return {
        "step": 7,
        "model": {
            "bottom.0.weight": torch.randn(4, 3, generator=g, requires_grad=True),  # a live parameter
            "bottom.0.bias": torch.randn(4, generator=g),
            "f16": torch.randn(5, generator=g).half(),
            "bf16": torch.randn(2, 3, generator=g).bfloat16(),
            "f64": torch.randn(3, dtype=torch.float64, generator=g),
            "nan": torch.tensor([float("nan"), float("-inf"), -0.0]),
            "i64": torch.tensor(12345678901, dtype=torch.int64),  # 0-d
            "i32": torch.arange(6, dtype=torch.int32).view(2, 3),
            "mask": torch.tensor([True, False, True]),
            "u8": torch.arange(250, 256, dtype=torch.uint8),
            "empty": torch.empty(0, 8),
            "empty_i64": torch.empty(3, 0, dtype=torch.int64),
            "transposed": torch.arange(12.0).view(3, 4).t(),  # not contiguous
        },
        "optimizer": {"state": {0: {"sum": torch.full((4, 3), 0.1), "step": torch.tensor(3.0)}, 1: {}},
                      "param_groups": [{"lr": 0.01, "eps": 1e-10, "params": [0, 1], "betas": (0.9, 0.999),
                                        "maximize": False, "foreach": None}]},
        "data_position": {"batch": 7, "file": "x.tsv", "offsets": [0, 128, 4096]},
        "rng": {"torch": torch.Generator().manual_seed(9).get_state(), "python": random.Random(4).getstate(),
                "numpy": np.random.RandomState(3).get_state()},
        "floats": [float("inf"), -0.0, 1e-300, 0.1],
        "np_scalars": (np.int64(5), np.float32(0.5)),
        "nothing": None,
    }


def same(a, b, where="state") -> None:
    """Exact equality: types (tuple vs list, int keys), dtypes, shapes and raw bytes (NaN, -0.0)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and b.dtype == a.dtype and b.shape == a.shape, where
        assert not b.requires_grad, where
        a, b = a.detach().contiguous(), b.contiguous()
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and b.dtype == a.dtype and b.shape == a.shape, where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(b) == list(a), (where, list(a), list(b))
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        assert type(b) is type(a) and len(b) == len(a), (where, type(a), type(b))
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, (np.integer, np.floating)):  # numpy scalars come back as the numbers they hold
        assert type(b) in (int, float) and b == a.item(), where
    elif isinstance(a, float):
        assert type(b) is float and (a == b and math.copysign(1, a) == math.copysign(1, b)), where
    else:
        assert type(b) is type(a) and b == a, where


def _payload(parts) -> bytearray:
    return materialize(parts)


def test_dense_record_round_trips_a_real_dense_state_exactly():
    state = _dense_state()
    parts, n = DensePacker().pack(state)
    payload = _payload(parts)
    assert len(payload) == n
    back = unpack_dense(payload)
    same(state, back)
    # the RNG states still work as RNG states, and draw what the originals draw
    r, ref = random.Random(), random.Random(4)
    r.setstate(back["rng"]["python"])
    assert [r.random() for _ in range(3)] == [ref.random() for _ in range(3)]
    rs = np.random.RandomState()
    rs.set_state(back["rng"]["numpy"])
    assert np.array_equal(rs.random_sample(4), np.random.RandomState(3).random_sample(4))
    tg = torch.Generator()
    tg.set_state(back["rng"]["torch"])
    assert torch.equal(torch.rand(4, generator=tg), torch.rand(4, generator=torch.Generator().manual_seed(9)))
    # the tensors are copies: the payload buffer may be reused
    w = back["model"]["bottom.0.bias"].clone()
    payload[:] = b"\0" * len(payload)
    assert torch.equal(back["model"]["bottom.0.bias"], w)


def test_dense_record_copies_the_tensors_when_it_is_written_not_when_it_is_packed(tmp_path):
    # pack() takes the document now and the tensor bytes when the journal writes the record,
    # straight into its place (one copy): the writer thread relies on update() not changing
    # them in between (test_the_dense_state_packed_off_thread_is_the_committed_one_even_...).
    w = torch.zeros(1000)
    parts, n = DensePacker().pack({"w": w, "step": 1})
    w += 1
    j = Journal(tmp_path / "j")
    ref = j.append(RecordType.DENSE, 1, parts)
    j.end(1, commit_doc(1))
    w += 1                                   # after the write: the record keeps what it got
    assert ref.length == n
    assert torch.equal(unpack_dense(j.read(ref))["w"], torch.ones(1000))


def test_dense_record_refuses_keys_it_cannot_carry():
    with pytest.raises(TypeError, match="keys must be str or int"):
        DensePacker().pack({"model": {(1, 2): torch.zeros(1)}})


@pytest.mark.parametrize("how", ["not-json", "short-tensor-bytes", "missing-table"])
def test_a_malformed_dense_record_is_a_pool_corrupt_error(how):
    parts, _ = DensePacker().pack({"w": torch.arange(10.0), "s": {"x": torch.ones(3, dtype=torch.int64)}})
    payload = bytes(_payload(parts))
    if how == "not-json":
        bad = payload[:4] + b"{" * (len(payload) - 4)
    elif how == "short-tensor-bytes":  # a writer that wrote fewer bytes than its table says
        bad = payload[:-5]
    else:
        (hlen,) = np.frombuffer(payload[:4], dtype=np.uint32)
        doc = json.loads(payload[4:4 + hlen])
        doc.pop("tensors")
        head = json.dumps(doc).encode()
        bad = len(head).to_bytes(4, "little") + head + payload[4 + hlen:]
    with pytest.raises(PoolCorruptError, match="dense state record is malformed"):
        unpack_dense(bad)


def test_commit_documents_name_their_step():
    assert commit_doc(12) == {"kind": "commit", "step": 12}

    class T:
        doc = commit_doc(3)

    class P:
        doc = {"kind": "persist"}

    assert is_commit(T) and not is_commit(P)


# --------------------------------------------------------------------------- the step protocol (API)


class Dense:
    """A stand-in for Trainer._dense_state: a tiny 'model' whose weight counts committed steps."""

    def __init__(self):
        self.w = torch.zeros(3)

    def __call__(self, step: int) -> dict:
        return {"step": step, "model": {"w": self.w.clone()}, "optimizer": {"state": {}, "param_groups": []},
                "data_position": None,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}


def _pool_with_table(path, tier):
    pool = MemoryPool.create(path, tier=tier)
    t = pool.create_table("t", 64, 4, init="uniform", seed=3)
    s = pool.create_table("t.adagrad", 64, 1, init="zeros")
    return pool, t, s


API_TIERS = ["shm", "pmem", "power-sim"]


@pytest.mark.parametrize("tier", API_TIERS)
def test_step_context_manager_restores_the_touched_rows_when_the_block_raises(tmp_pool_dir, tier):
    pool, t, s = _pool_with_table(tmp_pool_dir, tier)
    dense = Dense()
    ck = UndoLogCheckpointer(pool, dense)
    ck.checkpoint_now(0)
    rows = torch.tensor([2, 5, 11, 40])
    all_before = t.view().clone(), s.view().clone()
    d0 = state_digest(pool, dense(0))

    # an exception after update(): the rows go back to their before-images, in memory
    with pytest.raises(RuntimeError, match="boom"):
        with ck.step(1) as st:
            assert isinstance(st, Step) and st.k == 1 and st is ck.current  # the step, not the checkpointer
            ck.log_before_image([(t, rows), (s, rows)])
            ck.persist()
            ck.update(lambda: (t.write(rows, t.read(rows) + 1.0), s.write(rows, s.read(rows) + 2.0)))
            assert st.updated and [tb.name for tb, _ in st.touched] == [t.name, s.name]
            assert not torch.equal(t.view(), all_before[0])
            raise RuntimeError("boom")
    if pool.journaled:
        # A journaled tier keeps no before-images: the changed rows exist only in this process's
        # working copy, never on media. The checkpointer refuses to go on, and a reopened pool is
        # at the last commit.
        with pytest.raises(RuntimeError, match="reopen the pool"):
            ck.begin_step(1)
        ck.close()
        pool.close()
        pool = MemoryPool.open(tmp_pool_dir)
        t, s = pool.table("t"), pool.table("t.adagrad")
        ck = UndoLogCheckpointer(pool, dense)
    assert torch.equal(t.view(), all_before[0]) and torch.equal(s.view(), all_before[1])
    assert state_digest(pool, dense(0)) == d0

    # an exception before update(): nothing changed, nothing to restore
    with pytest.raises(ValueError):
        with ck.step(1):
            ck.log_before_image([(t, rows)])
            raise ValueError("before the update")
    assert torch.equal(t.view(), all_before[0])

    # a block that finishes commits the step
    with ck.step(1, final=True):
        ck.log_before_image([(t, rows), (s, rows)])
        ck.persist()
        ck.update(lambda: t.write(rows, torch.full((4, 4), 7.0)))
        dense.w += 1
    ck.close()
    d1 = state_digest(pool, dense(1))
    last = pool.journal.last
    assert is_commit(last) and last.tag == 1 and last.doc["step"] == 1
    assert [r.type for r in last.records].count(RecordType.DENSE) == 1
    assert committed_state(pool)[0] == 1 and torch.equal(committed_state(pool)[1]["model"]["w"], torch.ones(3))
    pool.close()

    rep = recover(tmp_pool_dir)
    assert rep.committed_step == 1 and not rep.needed and rep.rolled_back_steps == []
    assert rep.state_digest == d1
    with MemoryPool.open(tmp_pool_dir, read_only=True) as p:
        assert torch.equal(p.table("t").read(rows), torch.full((4, 4), 7.0))


def test_every_checkpointer_yields_its_step_from_the_step_block(tmp_pool_dir):
    from checkpointing import NoCheckpointer
    FullSaveCheckpointer = _baselines().FullSaveCheckpointer

    pool, t, _ = _pool_with_table(tmp_pool_dir, "pmem")
    dense = Dense()
    try:
        for ck in (NoCheckpointer(pool, dense), FullSaveCheckpointer(pool, dense, every=1)):
            assert ck.current is None and ck.window == 1   # (the trainer's summary reports it)
            with ck.step(1, final=True) as st:
                assert isinstance(st, Step) and st.k == 1 and st is ck.current
                ck.log_before_image([(t, torch.tensor([1, 2]))])
                ck.persist()
                ck.update(lambda: None)
            assert ck.current is None
            ck.close()
    finally:
        pool.close()


def test_crash_plans_are_asked_not_compared_and_know_every_phase_name():
    from checkpointing.crash import COMMIT_PHASES, PHASES, RANDOM, RECOVERY_PHASES, STEP_PHASES, CrashPlan

    assert set(COMMIT_PHASES) <= set(STEP_PHASES) and PHASES == STEP_PHASES + (RANDOM,)
    plan = CrashPlan(4, "mid-dense")
    assert plan.at(4, "mid-dense") and plan.at(4, *COMMIT_PHASES)
    assert not plan.at(3, "mid-dense") and not plan.at(4, "mid-log")
    plan.hit(3, "mid-dense")  # another step: no kill
    plan.hit(4, "after-log")  # another phase: no kill
    plan.hit_recovery("mid-rollback")  # a training plan never kills recovery
    with pytest.raises(ValueError, match="unknown crash phase"):
        plan.at(4, "mid-dens")
    with pytest.raises(ValueError, match="unknown crash phase"):
        CrashPlan(4, "no-such-phase")
    rec = CrashPlan.recovery("before-invalidate")
    assert not any(rec.at(rec.step, p) for p in PHASES)
    rec.hit_recovery("mid-rollback")  # another moment of recovery: no kill
    with pytest.raises(ValueError):
        CrashPlan.recovery("mid-dense")
    with pytest.raises(ValueError):
        rec.hit_recovery("mid-dense")
    assert set(RECOVERY_PHASES) == {"mid-rollback", "before-invalidate"}


def test_a_random_crash_kills_even_when_the_run_ends_before_its_timer_fires():
    """``--crash-at K:random`` arms a timer at step K; a run whose remaining steps take less
    than the delay drawn (seen in CI: the timer thread starved on a busy machine) must still be
    killed when it ends (``await_armed``), never finish as if no crash had been asked for."""
    code = textwrap.dedent("""
        import sys
        from checkpointing.crash import CrashPlan
        plan = CrashPlan(3, "random", seed=1, expected_step_seconds=0.4)
        plan.arm_random(2)          # another step: nothing armed, nothing to wait for
        plan.await_armed()
        plan.arm_random(3)          # a delay of up to 0.4 s: the "run" below ends at once
        plan.await_armed()
        print("the run ended without the crash it was asked for")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    assert "crash injection: SIGKILL at step 3 random" in proc.stderr
    assert "ended without" not in proc.stdout


def test_a_random_crash_whose_moment_outlasts_its_step_kills_as_the_next_step_begins():
    """The delay is drawn from the previous step's time: when step K is faster (or the timer
    thread is starved), the kill must not land in a later step (a test then saw more steps
    committed than the crash step): the next step's begin kills first."""
    code = textwrap.dedent("""
        import sys, time
        from checkpointing.crash import CrashPlan
        plan = CrashPlan(3, "random", seed=1, expected_step_seconds=30.0)
        plan.arm_random(3)          # a delay of up to 30 s; step 3 "ends" at once
        print("step 3 done", flush=True)
        plan.arm_random(4)          # step 4 begins: killed here
        print("step 4 began", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    # (the timer itself, drawn at 10.3 s with this seed, would have let step 4 begin)
    assert "step 3 done" in proc.stdout and "step 4 began" not in proc.stdout
    assert "SIGKILL at step 3 random (at its end" in proc.stderr


@pytest.mark.parametrize("tier", API_TIERS)
def test_an_updated_step_that_never_commits_is_rolled_back_by_recover(tmp_pool_dir, tier):
    """What a crash after update() leaves. Direct tier (shm): the step's undo records, its rows
    changed in place. Journaled tiers: its rows changed only in the process's working copy,
    which never reached durable media, and no record of the step."""
    pool, t, s = _pool_with_table(tmp_pool_dir, tier)
    dense = Dense()
    ck = UndoLogCheckpointer(pool, dense)
    ck.checkpoint_now(0)
    d0 = state_digest(pool, dense(0))
    rows = torch.tensor([0, 63, 7])
    ck.begin_step(1)
    ck.log_before_image([(t, rows)])
    ck.persist()
    ck.update(lambda: t.write(rows, torch.zeros(3, 4)))
    ck.close()
    pool.close()    # no commit(1)

    direct = tier == "shm"
    dry = recover(tmp_pool_dir, dry_run=True)
    assert dry.needed == direct and dry.committed_step == 0
    assert dry.rolled_back_steps == ([1] if direct else []) and dry.rows_restored == (3 if direct else 0)
    assert dry.state_digest is None if direct else dry.state_digest == d0
    rep = recover(tmp_pool_dir)
    assert rep.committed_step == 0 and rep.rolled_back_steps == dry.rolled_back_steps and rep.state_digest == d0
    again = recover(tmp_pool_dir)
    assert not again.needed and again.state_digest == d0
    with MemoryPool.open(tmp_pool_dir, read_only=True) as p:
        assert not torch.equal(p.table("t").read(rows), torch.zeros(3, 4))


@pytest.mark.parametrize("tier", API_TIERS)
def test_a_failed_step_right_after_a_commit_leaves_the_media_at_that_commit(tmp_pool_dir, tier):
    """commit(k) returns before step k is durable (the writer thread makes it so while step k+1
    computes), and step k+1 changes the same rows at once. The journal must hold step k's
    values, not k+1's; when k+1 then fails, the pool is at step k on media (and, on the direct
    tier, in memory)."""
    pool, t, s = _pool_with_table(tmp_pool_dir, tier)
    dense = Dense()
    ck = UndoLogCheckpointer(pool, dense)
    ck.checkpoint_now(0)
    rows = torch.tensor([1, 2, 3])
    with ck.step(1):                        # not final: its transaction is written in the background
        ck.log_before_image([(t, rows)])
        ck.persist()
        ck.update(lambda: t.write(rows, torch.full((3, 4), 1.0)))
        dense.w += 1
    d1 = state_digest(pool, dense(1))
    with pytest.raises(RuntimeError, match="the step fails"):
        with ck.step(2):
            ck.log_before_image([(t, rows)])
            ck.persist()
            ck.update(lambda: t.write(rows, torch.full((3, 4), 2.0)))
            raise RuntimeError("the step fails")
    if pool.journaled:  # no before-images: refuses to go on (see the context-manager test)
        with pytest.raises(RuntimeError, match="reopen the pool"):
            ck.begin_step(2)
    else:
        assert state_digest(pool, dense(1)) == d1  # in memory: restored
    ck.close()
    pool.close()  # the process ends (or dies) without another checkpoint
    rep = recover(tmp_pool_dir)
    assert rep.committed_step == 1 and rep.state_digest == d1
    with MemoryPool.open(tmp_pool_dir, read_only=True) as p:
        assert torch.equal(p.table("t").read(rows), torch.full((3, 4), 1.0))


def _newest_dense(pool_dir: Path):
    """(DENSE record of the newest commit, its step), read from the journal files."""
    j = Journal(storage_dir(pool_dir) / "journal", read_only=True)
    txn = [t for t in j.txns if is_commit(t)][-1]
    (ref,) = [r for r in txn.records if r.type == RecordType.DENSE]
    return ref, txn.tag


@pytest.mark.parametrize("tier", ["shm", "power-sim"])
def test_a_damaged_dense_record_is_detected_at_recovery_and_changes_nothing(tmp_pool_dir, tier):
    pool, t, s = _pool_with_table(tmp_pool_dir, tier)
    ck = UndoLogCheckpointer(pool, Dense())
    ck.checkpoint_now(0)
    with ck.step(1, final=True):
        ck.log_before_image([(t, torch.tensor([4]))])
        ck.persist()
        ck.update(lambda: t.write([4], torch.ones(1, 4)))
    ck.close()
    pool.close()
    ref, step = _newest_dense(tmp_pool_dir)
    assert step == 1
    flip(ref.segment, ref.payload_offset + ref.length // 2)
    before = pool_state(tmp_pool_dir)
    for dry_run in (True, False):
        with pytest.raises(RecoveryError, match="dense state of step 1") as e:
            recover(tmp_pool_dir, dry_run=dry_run)
        assert e.value.exit_code == 4 and "checksum" in str(e.value)
    with MemoryPool.open(tmp_pool_dir, read_only=True) as p:
        with pytest.raises(RecoveryError, match="dense state of step 1"):
            committed_state(p)
        assert checkpoint_status(p)["committed_step"] == 1  # the commit record itself is fine
    assert pool_state(tmp_pool_dir) == before


def test_a_commit_without_a_dense_state_is_refused(tmp_pool_dir):
    pool, t, s = _pool_with_table(tmp_pool_dir, "shm")
    ck = UndoLogCheckpointer(pool, Dense())
    ck.checkpoint_now(0)
    ck.close()
    pool.journal.end(1, commit_doc(1))  # a commit record whose transaction holds no DENSE record
    pool.close()
    before = pool_files(tmp_pool_dir)
    with pytest.raises(RecoveryError, match="step 1 holds no dense state"):
        recover(tmp_pool_dir)
    assert pool_files(tmp_pool_dir) == before


# --------------------------------------------------------------------------- recover() on a trained pool


def test_api_recover_of_a_crashed_training_pool(cli, root):
    pool = root / "api"
    r = cli.run(["train", "--pool", pool, *flags("shm"), "--steps", 6, "--crash-at", "4:after-update"])
    assert r.returncode == -9, r.stderr[-2000:]
    with MemoryPool.open(pool, read_only=True) as p:
        status = checkpoint_status(p)
    assert status["needs_recovery"] and 4 in status["steps_to_roll_back"]

    rep = checkpointing.recover(pool)
    assert isinstance(rep, checkpointing.RecoveryReport)
    assert rep.committed_step == status["committed_step"] < 4
    assert rep.rolled_back_steps == sorted(status["steps_to_roll_back"], reverse=True)
    assert rep.needed and rep.rows_restored > 0 and rep.state_digest
    assert rep.as_dict()["committed_step"] == rep.committed_step

    again = checkpointing.recover(pool)
    assert not again.needed and again.committed_step == rep.committed_step
    assert again.state_digest == rep.state_digest
    inspect = ok_json(cli.run(["inspect", "--pool", pool, "--json"]))
    assert inspect["state_digest"] == rep.state_digest and inspect["step"] == rep.committed_step
    assert inspect["checkpoint"]["steps_to_roll_back"] == [] and inspect["checkpoint"]["torn_bytes"] == 0
    (root / "api-empty").mkdir()
    with pytest.raises(PoolFormatError, match="api-empty"):  # not a pool
        checkpointing.recover(root / "api-empty")


def test_recover_takes_one_pool_and_recover_path_a_pool_or_a_job(tmp_path):
    """``recover``: one pool (a job is refused, one rank of a job alone too); ``recover_path``
    (what ``dlrm-cxl recover`` calls): whatever the path holds."""
    from checkpointing.job import write_job_file

    job = tmp_path / "job"
    job.mkdir()
    write_job_file(job, {"world_size": 1})
    with MemoryPool.create(job / "rank-0", tier="pmem") as pool:
        pool.create_table("t", 8, 4)
    with pytest.raises(PoolFormatError, match="job of several ranks") as e:
        checkpointing.recover(job)
    assert "recover_path" in e.value.hint
    for fn in (checkpointing.recover, checkpointing.recover_path):
        with pytest.raises(RecoveryError, match="one rank of the job"):
            fn(job / "rank-0")
    rep = checkpointing.recover_path(job)
    assert isinstance(rep, checkpointing.JobRecoveryReport) and rep.committed_step is None and not rep.needed
    single = tmp_path / "single"
    with MemoryPool.create(single, tier="pmem") as pool:
        pool.create_table("t", 8, 4)
    rep = checkpointing.recover_path(single)
    assert isinstance(rep, checkpointing.RecoveryReport) and rep.committed_step is None


# --------------------------------------------------------------------------- 6. bounded journal


def _journal_state(pool: Path) -> tuple[int, list[int], int, int]:
    """(live bytes, first seq of every segment, START, bytes of every journal file) of a pool's
    journal. Live bytes are the valid records (a recycled segment's file also holds the stale
    bytes of its previous life); the files (segments and the free ones kept for reuse) are
    what the journal occupies."""
    d = storage_dir(pool) / "journal"
    segs = sorted(d.glob("seg-*.log"))
    start = int((d / "START").read_text()) if (d / "START").exists() else 0
    j = Journal(d, read_only=True)
    footprint = sum(p.stat().st_size for p in [*segs, *d.glob("free-*.log")])
    return j.live_bytes, [int(p.stem[4:], 16) for p in segs], start, footprint


# (a direct tier with a recovery point every step, a journaled one with windows of 10: each is
# ~25 s of the suite, and the other two pairs ran the same code paths)
@pytest.mark.parametrize("tier,window", [("shm", 1), ("power-sim", 10)])
def test_the_journal_does_not_grow_with_the_number_of_steps(root, tier, window):
    """Once the live journal passes the compaction threshold (DLRM_CXL_COMPACT_MB=1 here), the
    segments before the newest recovery point are compacted (journaled tiers: written back into
    the table images) and dropped. So the live journal stays within the threshold plus what a
    few recovery intervals append, however many steps run; and what is left still recovers to
    the same state."""
    pool = root / f"bounded-{tier}-{window}"
    # (a window of 10 makes about a third of the bytes durable: the same test at a third of the
    # threshold)
    mb = 1.0 if window == 1 else 0.34
    env = {**os.environ, "DLRM_CXL_COMPACT_MB": str(mb), "PYTHONPATH": str(REPO)}
    thr = int(mb * (1 << 20))
    live, files = [], []
    for steps in (40, 80):  # the second run reopens the pool: its journal must not keep the first's
        proc = subprocess.run(torture.cli_cmd("train", "--pool", pool, *flags(tier), "--window", window,
                                              "--steps", steps, "--json"),
                              capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
        doc = ok_json(proc)
        ck = doc["checkpoint"]
        assert ck["last_commit_step"] == steps and ck["checkpoints"] >= 2
        appended = ck["bytes_durable_per_step"] * ck["steps"]
        assert appended > 2 * thr, "the run must append well past the threshold for the test to mean anything"
        n, firsts, start, footprint = _journal_state(pool)
        live.append(n)
        files.append(footprint)
        # The threshold, plus what is appended while a background compaction runs (at most about
        # another threshold's worth), plus a few recovery intervals.
        bound = 2 * thr + 3 * window * ck["bytes_durable_per_step"] + (256 << 10)
        assert n <= bound, (steps, n, bound, firsts)
        assert start > 0 and firsts and firsts[0] == start and len(firsts) <= 8, (start, firsts)
        # what is left is a consistent pool at the last step
        info = ok_json(subprocess.run(torture.cli_cmd("inspect", "--pool", pool, "--json"), capture_output=True,
                                      text=True, timeout=600, cwd=REPO, env=env))
        assert info["step"] == steps and info["state_digest"] == doc["state_digest"]
        assert not info["checkpoint"]["needs_recovery"]
    # (2 MiB: the threshold plus what a compaction still running at the end lets through, as in
    # the bound above; whether the last one finished before the run closed is timing. Keeping the
    # first run's journal would add its ~6 MB.)
    assert live[1] < 2 * max(live[0], 2 * thr), live
    assert files[1] < 2 * max(files[0], thr), files  # recycled segments: the files do not grow either


def test_a_long_window_rolls_back_every_step_since_its_start_then_replays_them(cli, root):
    """--window larger than the run: the only recovery point is step 0. A crash rolls back every
    step since (shm: each from the undo records of the rows it touched first), exactly; the
    steps committed before the crash are then replayed from their records."""
    pool, ref = root / "long-interval", root / "long-interval-ref"
    r = cli.run(["train", "--pool", pool, *flags("shm"), "--window", 1000, "--steps", 30,
                 "--crash-at", "26:after-update"])
    assert r.returncode == -9, r.stderr[-2000:]
    rep = ok_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert rep["restored_step"] == 0 and rep["rolled_back_steps"] == list(range(26, 0, -1))
    assert rep["rows_restored"] > 0
    c = rep["committed_step"]
    assert c in (24, 25) and rep["replayed"] == c and rep["replay_steps"] == list(range(1, c + 1))
    ref_c = torture.parse_digest(cli.run(["train", "--pool", ref, *flags("shm"), "--steps", c]).stdout)
    assert rep["state_digest"] == ref_c
    a = torture.parse_digest(cli.run(["train", "--pool", pool, *flags("shm"), "--window", 1000,
                                      "--steps", 30]).stdout)
    b = torture.parse_digest(cli.run(["train", "--pool", ref, *flags("shm"), "--steps", 30]).stdout)
    assert a == b and a is not None


@pytest.mark.parametrize("tier", ["shm", "power-sim"])
def test_an_inline_checkpointer_makes_each_step_durable_before_commit_returns(tmp_pool_dir, tier):
    """``inline=True`` (what ``tools/bench_durability.py --inline`` measures) runs the writer's
    work on the caller's thread: the commit is in the journal when ``commit`` returns, with no
    writer thread, and the pool recovers to it as to a threaded one's."""
    pool, t, s = _pool_with_table(tmp_pool_dir, tier)
    dense = Dense()
    writers = {th for th in threading.enumerate() if th.name.startswith("journal-writer")}
    ck = UndoLogCheckpointer(pool, dense, inline=True)
    ck.checkpoint_now(0)
    rows = torch.tensor([1, 9, 30])
    for k in (1, 2):
        with ck.step(k):
            ck.log_before_image([(t, rows), (s, rows)])
            ck.persist()
            ck.update(lambda: t.write(rows, t.read(rows) + 1.0))
            dense.w += 1
        assert pool.journal.last.tag == k and is_commit(pool.journal.last)
    assert {th for th in threading.enumerate() if th.name.startswith("journal-writer")} == writers
    expected = t.view().clone()
    ck.close()
    pool.close()
    assert recover(tmp_pool_dir).committed_step == 2
    with MemoryPool.open(tmp_pool_dir) as again:
        assert torch.equal(again.table("t").view(), expected)


def test_an_inline_writer_logs_before_images_at_the_barrier_and_nothing_for_a_step_failing_before_it(tmp_pool_dir):
    """An inline writer gathers and appends a step's before-images in ``persist`` (the
    write-ahead barrier, after the forward has read the rows), not when ``log_before_image``
    hands it the rows; a step that fails before its barrier changed no row and logs nothing, and
    its rows count as untouched in the window (the next step logs every one of them)."""
    pool, t, s = _pool_with_table(tmp_pool_dir, "shm")
    j = pool.journal
    ck = UndoLogCheckpointer(pool, Dense(), inline=True, window=4)
    ck.checkpoint_now(0)
    rows = torch.tensor([1, 9, 30])
    undo = lambda: [r for r in j.tail if r.type == RecordType.UNDO]  # noqa: E731 (this step's)
    ck.begin_step(1)
    ck.log_before_image([(t, rows), (s, rows)])
    assert undo() == []                  # (handed over, not run)
    ck.abort()                           # (the step failed before its barrier)
    assert not any(r.type == RecordType.UNDO for txn in j.txns for r in txn.records)
    ck.begin_step(1)
    ck.log_before_image([(t, rows), (s, rows)])
    assert undo() == []
    ck.persist()
    logged = undo()
    assert logged and sum(r.length for r in logged) >= 3 * (t.config.row_bytes + s.config.row_bytes)
    ck.update(lambda: t.write(rows, t.read(rows) + 1.0))
    ck.commit(1)
    ck.close()
    pool.close()


def _slow_writer_gathers(monkeypatch, seconds: float) -> None:
    """Make every copy of rows the journal writer thread does slow (the race windows certain).
    It copies them with ``RowGather.into``, straight to where a record is written or into a
    buffer."""
    into = RowGather.into

    def slow(self, out):
        if threading.current_thread().name.startswith("journal-writer"):
            time.sleep(seconds)
        return into(self, out)

    monkeypatch.setattr(RowGather, "into", slow)


def test_after_images_gathered_off_thread_are_the_committed_ones_even_when_rows_change_at_once(tmp_pool_dir,
                                                                                           monkeypatch):
    """On a journaled tier ``commit(k)`` hands the rows to the writer thread, which gathers their
    after-images while step k+1 computes; a fused backward changes rows in place right after
    ``persist()`` of step k+1, which must wait until they are gathered. A slow gather makes the
    race certain: without the wait, step k's ROWS record would hold step k+1's values."""
    pool, t, s = _pool_with_table(tmp_pool_dir, "power-sim")
    ck = UndoLogCheckpointer(pool, Dense())
    ck.checkpoint_now(0)
    _slow_writer_gathers(monkeypatch, 0.3)
    rows = torch.tensor([3, 4, 17])
    after = {}
    for k in (1, 2, 3):
        with ck.step(k):
            ck.log_before_image([(t, rows)])
            ck.persist()
            t.write(rows, t.read(rows) + 1.0)  # in place, as fbgemm's fused backward does
            ck.mark_updated()
            after[k] = t.read(rows).clone()
    ck.close()
    logged = {}
    for txn in pool.journal.txns:
        for ref in txn.records:
            if ref.type == RecordType.ROWS:
                [(name, ids, raw)] = decode_row_set(pool.journal.read(ref))
                logged[txn.tag] = raw.view(torch.float32).view(len(ids), -1).clone()
    pool.close()
    assert sorted(logged) == [1, 2, 3]
    for k, got in logged.items():
        assert torch.equal(got, after[k]), (k, got - after[k])


def test_the_background_threads_run_torch_ops_on_one_thread_each_and_leave_the_default_alone(tmp_pool_dir):
    """The journal writer, the compactor and the prefetch thread each get one intra-op thread: a
    thread that starts a parallel torch op gets its own OpenMP team, whose workers spin on the
    cores the trainer's GEMMs use. The trainer's own count is left alone, and so is the default
    a thread started afterwards adopts (which ``torch.set_num_threads`` also sets)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)

    def in_a_new_thread(fn):
        got = []
        th = threading.Thread(target=lambda: got.append(fn()))
        th.start()
        th.join()
        return got[0]

    try:
        pool, t, s = _pool_with_table(tmp_pool_dir, "pmem")
        ck = UndoLogCheckpointer(pool, Dense())
        assert ck._writer.submit(torch.get_num_threads).result() == 1
        assert in_a_new_thread(torch.get_num_threads) == 2
        assert pool._compaction.run(torch.get_num_threads, wait=False).result() == 1
        assert in_a_new_thread(torch.get_num_threads) == 2
        ck.close()
        pool.close()
        with Prefetcher(torch.get_num_threads() for _ in range(3)) as produced:
            assert list(produced) == [1, 1, 1]
        assert in_a_new_thread(torch.get_num_threads) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_before_images_gathered_off_thread_are_the_rows_before_the_update(tmp_pool_dir, monkeypatch):
    """On a direct tier (shm) ``log_before_image`` only hands the rows over; the writer thread
    gathers their before-images while the forward runs. ``persist()`` must wait for them, and
    an update that fails afterwards is rolled back from them."""
    pool, t, s = _pool_with_table(tmp_pool_dir, "shm")
    ck = UndoLogCheckpointer(pool, Dense())
    ck.checkpoint_now(0)
    _slow_writer_gathers(monkeypatch, 0.3)
    rows = torch.tensor([2, 5, 11])
    before = t.read(rows).clone()
    with pytest.raises(RuntimeError, match="after the update"):
        with ck.step(1):
            ck.log_before_image([(t, rows)])
            ck.persist()
            t.write(rows, t.read(rows) + 1.0)
            ck.mark_updated()
            raise RuntimeError("a failure after the update")
    assert torch.equal(t.read(rows), before)
    with ck.step(1):  # (the reference path's optimizer starts from the before-images)
        ck.log_before_image([(t, rows)])
        assert torch.equal(ck.before_images()["t"], before)
        ck.persist()
    ck.close()
    pool.close()


@pytest.mark.parametrize("tier", ["shm", "power-sim"])
def test_the_dense_state_packed_off_thread_is_the_committed_one_even_when_update_follows_at_once(
        tmp_pool_dir, tier):
    """``commit(k)`` hands the dense state's *live* tensors to the writer thread, which packs
    them while step k+1 computes; ``update`` of step k+1 must wait until they are packed. A slow
    packer makes the race certain: without the wait, step k's recovery point would hold step
    k+1's weights."""
    pool, t, s = _pool_with_table(tmp_pool_dir, tier)
    w = torch.zeros(4)
    live = lambda k: {"step": k, "model": {"w": w}, "optimizer": {"state": {}, "param_groups": []},  # noqa: E731
                      "data_position": None, "rng": {"torch": torch.get_rng_state()}}
    ck = UndoLogCheckpointer(pool, live)
    ck.checkpoint_now(0)
    pack = ck._packer.pack

    def slow_pack(state):
        # slow where the tensors are read: the copy into the record, as the journal writes it
        (head, fill), n = pack(state)
        return [head, Fill(fill.nbytes, lambda dest: (time.sleep(0.3), fill.fn(dest)))], n

    ck._packer.pack = slow_pack
    rows = torch.tensor([3, 4])
    for k in (1, 2):
        with ck.step(k):
            ck.log_before_image([(t, rows)])
            ck.persist()
            ck.update(lambda: w.add_(1.0))  # the dense optimizer step: w is k after step k
    ck.close()
    pool.close()
    with MemoryPool.open(tmp_pool_dir, read_only=True) as p:
        for k in (1, 2):
            step, state = committed_state(p, k)
            assert step == k and torch.equal(state["model"]["w"], torch.full((4,), float(k))), (k, state["model"]["w"])


@pytest.mark.parametrize("window", [1, 4])
@pytest.mark.parametrize("tier", ["shm", "pmem"])
def test_the_bytes_floor_moves_the_bytes_of_an_undo_recovery_point_and_writes_nothing(tmp_path, tier, window):
    """tools/bench_train.py's ``floor`` variant is the undo log's physical floor: the same row
    and dense bytes copied and checksummed (a recovery point every step, or each row once per
    window of 4), nothing written to the journal."""
    BytesFloorCheckpointer = _baselines().BytesFloorCheckpointer
    from dlrm_cxl.model import PRESETS

    bench = tool("bench_train")
    cfg = PRESETS["tiny"]
    batches = bench.make_batches(cfg, 4)
    undo = bench.PoolVariant("undo", cfg, batches, tmp_path, tier=tier, checkpoint="undo", window=window)
    floor = bench.PoolVariant("floor", cfg, batches, tmp_path, tier=tier, live_dense=True,
                              ckpt_factory=lambda pool, ds: BytesFloorCheckpointer(pool, ds, window=window))
    steps = 3 if window == 1 else 8
    moved = {}
    try:
        for v in (undo, floor):
            v.setup()
            assert v.trainer.ckpt.window == window
            before = v.stats.as_dict()
            records = v.trainer.pool.journal.next_seq
            v.steps(steps)
            after = v.stats.as_dict()
            moved[v.name] = {k: after[k] - before[k] for k in ("log_bytes", "table_bytes_persisted", "dense_bytes",
                                                                   "checkpoints")}
            moved[v.name]["records"] = v.trainer.pool.journal.next_seq - records
    finally:
        undo.close()
        floor.close()
    rows = moved["undo"]["log_bytes"] + moved["undo"]["table_bytes_persisted"]
    assert rows > 0 and moved["floor"]["log_bytes"] + moved["floor"]["table_bytes_persisted"] == rows
    # The undo log's dense record also holds the state's description (JSON): a few KB a step.
    assert 0 < moved["undo"]["dense_bytes"] - moved["floor"]["dense_bytes"] < 3 * 16384
    assert moved["undo"]["records"] > 0 and moved["floor"]["records"] == 0
    # (the dense state once per window: at steps 4 and 8 with a window of 4)
    assert moved["undo"]["checkpoints"] == moved["floor"]["checkpoints"] == steps // window
