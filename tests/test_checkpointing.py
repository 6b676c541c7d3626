"""The checkpointer: on-media formats, the Python API (``checkpointing.recover``,
``UndoLogCheckpointer`` and its ``with ckpt.step(k)`` protocol), the undo log's bounded size,
and the torture tool (``tools/torture.py --quick``: SIGKILL from outside, recover, resume).

CLI runs are real processes forked from one warm interpreter (``tools/torture.py``'s
:class:`ForkServer`; ``DLRM_CXL_TEST_FRESH=1`` makes each a fresh ``python -m dlrm_cxl``). The
torture tool uses fresh processes only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpointing
from checkpointing import UndoLogCheckpointer, checkpoint_status, recover, state_digest
from checkpointing.store import (PAYLOAD_OFFSET, SEAL, UndoRecord, ckpt_dir, read_commit, read_dense, read_slot,
                                 scan_slots, write_commit, write_dense, write_slot)
from memory_pool import MemoryPool, PoolCorruptError, PoolFormatError

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("dlrm_cxl_torture", REPO / "tools" / "torture.py")
torture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torture)


def flags(tier="pmem", *extra) -> list[str]:
    return ["--preset", "tiny", "--tier", tier, "--threads", "1", "--no-progress", *map(str, extra)]


def ok_json(proc) -> dict:
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)




# --------------------------------------------------------------------------- formats (store.py)


def _records(seed=0, n=5, dim=4):
    g = torch.Generator().manual_seed(seed)
    return [UndoRecord("a", torch.tensor([3, 1, 4, 9, 7][:n]), torch.rand(n, dim, generator=g)),
            UndoRecord("a.adagrad", torch.tensor([3, 1, 4, 9, 7][:n]), torch.rand(n, 1, generator=g)),
            UndoRecord("empty", torch.empty(0, dtype=torch.int64), torch.empty(0, dim))]


def test_undo_slot_round_trip_and_reuse_by_a_shorter_step(tmp_path):
    path = tmp_path / "slot-0000.log"
    recs = _records(0)
    n = write_slot(path, 7, recs)
    (info,) = scan_slots(tmp_path)
    assert (info.state, info.step, info.payload_len, info.n_records) == ("sealed", 7, n, 3)
    back = read_slot(info)
    for r, b in zip(recs, back):
        assert b.table == r.table and torch.equal(b.ids, r.ids)
        assert torch.equal(b.before.view(r.before.dtype).view(r.before.shape), r.before)
    # reused for a later step with fewer rows: the stale tail after the new payload is ignored
    write_slot(path, 12, _records(1, n=2))
    (info,) = scan_slots(tmp_path)
    assert info.step == 12 and [r.ids.tolist() for r in read_slot(info)][0] == [3, 1]


def test_undo_slot_states_empty_sealed_damaged(tmp_path):
    (tmp_path / "slot-0000.log").write_bytes(b"")                       # created, never written
    (tmp_path / "slot-0001.log").write_bytes(b"\0" * (PAYLOAD_OFFSET + 100))  # payload, no seal yet
    write_slot(tmp_path / "slot-0002.log", 3, _records())
    write_slot(tmp_path / "slot-0003.log", 4, _records())
    with open(tmp_path / "slot-0003.log", "r+b") as f:                  # a flipped bit in the seal
        f.seek(9)
        b = f.read(1)
        f.seek(9)
        f.write(bytes([b[0] ^ 4]))
    write_slot(tmp_path / "slot-0004.log", 5, _records())
    os.truncate(tmp_path / "slot-0004.log", SEAL.size - 20)             # cut inside the seal
    states = [(s.path.name, s.state) for s in scan_slots(tmp_path)]
    assert states == [("slot-0000.log", "empty"), ("slot-0001.log", "empty"), ("slot-0002.log", "sealed"),
                      ("slot-0003.log", "damaged"), ("slot-0004.log", "damaged")]
    assert all(s.path.name in s.problem for s in scan_slots(tmp_path) if s.state == "damaged")


@pytest.mark.parametrize("where", ["record", "truncate", "stray"])
def test_damaged_sealed_payload_raises_naming_the_slot(tmp_path, where):
    path = tmp_path / "slot-0000.log"
    n = write_slot(path, 2, _records())
    if where == "record":
        with open(path, "r+b") as f:
            f.seek(PAYLOAD_OFFSET + n // 2)
            b = f.read(1)
            f.seek(PAYLOAD_OFFSET + n // 2)
            f.write(bytes([b[0] ^ 1]))
    elif where == "truncate":
        os.truncate(path, PAYLOAD_OFFSET + n - 1)
    (info,) = scan_slots(tmp_path)
    if where == "stray":  # a seal that claims more records than the payload holds
        info.n_records -= 1
    with pytest.raises(PoolCorruptError, match="slot-0000.log"):
        read_slot(info)


def test_dense_snapshot_and_commit_record_detect_damage(tmp_path):
    state = {"step": 3, "model": {"w": torch.arange(6.0)}, "optimizer": {}, "data_position": None, "rng": {}}
    name, crc, nbytes = write_dense(tmp_path, 3, state)
    assert name == "dense-000000000003.pt" and (tmp_path / name).stat().st_size == nbytes
    assert torch.equal(read_dense(tmp_path / name, crc)["model"]["w"], state["model"]["w"])
    with pytest.raises(PoolCorruptError, match=name):
        read_dense(tmp_path / name, crc ^ 1)            # not the snapshot COMMIT names
    raw = bytearray((tmp_path / name).read_bytes())
    raw[len(raw) // 2] ^= 0x20
    (tmp_path / name).write_bytes(bytes(raw))
    with pytest.raises(PoolCorruptError, match=name):
        read_dense(tmp_path / name)
    assert read_commit(tmp_path) is None
    write_commit(tmp_path, 3, name, crc)
    assert read_commit(tmp_path)["step"] == 3 and not list(tmp_path.glob(".*.tmp"))
    doc = json.loads((tmp_path / "COMMIT").read_text())
    doc["step"] = 4                                      # valid JSON, wrong checksum
    (tmp_path / "COMMIT").write_text(json.dumps(doc))
    with pytest.raises(PoolCorruptError, match="COMMIT"):
        read_commit(tmp_path)
    (tmp_path / "COMMIT").write_text('{"step": 3, "dense')  # torn
    with pytest.raises(PoolCorruptError, match="COMMIT"):
        read_commit(tmp_path)


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


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
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
            assert st is ck
            ck.log_before_image([(t, rows), (s, rows)])
            ck.persist()
            ck.update(lambda: (t.write(rows, t.read(rows) + 1.0), s.write(rows, s.read(rows) + 2.0)))
            assert not torch.equal(t.view(), all_before[0])
            raise RuntimeError("boom")
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
    assert read_commit(ckpt_dir(pool.storage_dir))["step"] == 1
    pool.close()

    rep = recover(tmp_pool_dir)
    assert rep.committed_step == 1 and not rep.needed and rep.rolled_back_steps == []
    assert rep.state_digest == d1
    with MemoryPool.open(tmp_pool_dir, read_only=True) as p:
        assert torch.equal(p.table("t").read(rows), torch.full((4, 4), 7.0))


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_an_updated_step_that_never_commits_is_rolled_back_by_recover(tmp_pool_dir, tier):
    """What a crash after update() leaves: the step's sealed undo records, its rows changed."""
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
    pool.persist()  # the changed rows reach the media, as the kernel or a checkpoint may do
    ck.close()
    pool.close()    # no commit(1)

    dry = recover(tmp_pool_dir, dry_run=True)
    assert dry.needed and dry.rolled_back_steps == [1] and dry.rows_restored == 3 and dry.state_digest is None
    rep = recover(tmp_pool_dir)
    assert rep.committed_step == 0 and rep.rolled_back_steps == [1] and rep.state_digest == d0
    again = recover(tmp_pool_dir)
    assert not again.needed and again.state_digest == d0


def test_a_failed_step_leaves_the_media_at_the_previous_step(tmp_pool_dir):
    """power-sim: only persisted stores survive. A checkpoint running in the background may
    persist rows a later step has already changed (allowed: that step's undo records cover
    them). If that step then fails, the pool must end up at the previous step *on media* too."""
    pool, t, s = _pool_with_table(tmp_pool_dir, "power-sim")
    dense = Dense()
    ck = UndoLogCheckpointer(pool, dense)
    ck.checkpoint_now(0)
    d0 = state_digest(pool, dense(0))
    rows = torch.tensor([1, 2, 3])
    with pytest.raises(RuntimeError):
        with ck.step(1):
            ck.log_before_image([(t, rows)])
            ck.persist()
            ck.update(lambda: t.write(rows, torch.zeros(3, 4)))
            pool.persist()  # what the background checkpoint of an earlier step may do meanwhile
            raise RuntimeError("the step fails")
    assert state_digest(pool, dense(0)) == d0  # in memory: restored
    ck.close()
    pool.close()  # the process ends (or dies) without another checkpoint
    rep = recover(tmp_pool_dir)
    assert rep.committed_step == 0 and rep.state_digest == d0


# --------------------------------------------------------------------------- recover() on a trained pool


def test_api_recover_of_a_crashed_training_pool(cli, root):
    pool = root / "api"
    r = cli.run(["train", "--pool", pool, *flags(), "--steps", 6, "--crash-at", "4:after-update"])
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
    (root / "api-empty").mkdir()
    with pytest.raises(PoolFormatError, match="api-empty"):  # not a pool
        checkpointing.recover(root / "api-empty")


# --------------------------------------------------------------------------- 6. bounded undo log


def _slots(pool: Path) -> list[Path]:
    return sorted((ckpt_dir(pool) / "undo").glob("slot-*.log"))


@pytest.mark.parametrize("dense_every", [1, 10])
def test_the_undo_log_does_not_grow_with_the_number_of_steps(cli, root, dense_every):
    """One slot per step that is not yet covered by a durable COMMIT, reused afterwards.

    How many steps that is depends on how long a checkpoint takes compared with a step (a
    checkpoint runs while later steps compute and a due one is skipped while the previous one
    is still being written): ``max_commit_lag``, which the trainer reports. So the bound checked
    is that lag (+2), the log's capacity (64 slots), and -- the point -- that the count does not
    follow the number of steps."""
    pool = root / f"bounded-{dense_every}"
    lags = []
    for steps in (30, 60):  # the second run reopens the pool: its slots must be reused, not added to
        doc = ok_json(cli.run(["train", "--pool", pool, *flags(), "--dense-every", dense_every, "--steps", steps,
                               "--json"]))
        ck = doc["checkpoint"]
        lags.append(ck["max_commit_lag"])
        n = len(_slots(pool))
        assert n <= max(lags) + 2, (n, lags)
        assert n <= 66
        assert ck["last_commit_step"] == steps and ck["checkpoints"] >= 2
        assert len(list(ckpt_dir(pool).glob("dense-*.pt"))) == 1 and not list(ckpt_dir(pool).glob(".*.tmp"))
    assert max(lags) >= dense_every
    assert n < 30, f"{n} undo slots for 60 steps: slots are not being reused"


def test_a_checkpoint_is_forced_when_the_undo_log_is_full(cli, root):
    """--dense-every larger than the undo log (64 slots): the log forces a recovery point
    instead of growing, and a crash after it recovers to exactly that point."""
    pool, ref = root / "forced", root / "forced-ref"
    r = cli.run(["train", "--pool", pool, *flags(), "--dense-every", 1000, "--steps", 70,
                 "--crash-at", "66:after-update"])
    assert r.returncode == -9, r.stderr[-2000:]
    assert len(_slots(pool)) <= 66
    rep = ok_json(cli.run(["recover", "--pool", pool, "--json"]))
    c = rep["committed_step"]
    assert 60 <= c < 66 and rep["rolled_back_steps"] == list(range(66, c, -1))
    ref_c = torture.parse_digest(cli.run(["train", "--pool", ref, *flags(), "--steps", c]).stdout)
    assert rep["state_digest"] == ref_c
    a = torture.parse_digest(cli.run(["train", "--pool", pool, *flags(), "--dense-every", 1000, "--steps", 70]).stdout)
    b = torture.parse_digest(cli.run(["train", "--pool", ref, *flags(), "--steps", 70]).stdout)
    assert a == b and a is not None


# --------------------------------------------------------------------------- the torture tool


def test_torture_quick_is_bit_exact():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "torture.py"), "--quick"], capture_output=True,
                          text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "3/3 trials bit-exact" in proc.stdout, proc.stdout
    trials = [line for line in proc.stdout.splitlines() if line.startswith("trial ")]
    assert len(trials) == 3 and all("bit-exact" in line for line in trials), proc.stdout
    assert "MISMATCH" not in proc.stdout and "final:" in proc.stdout, proc.stdout
