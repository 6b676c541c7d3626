"""Recovery windows with deterministic replay (checkpointing.policy, dlrm_cxl.replay), end to end.

Real processes (forked from one warm interpreter, tools/torture.py), real SIGKILL, real pools.
The window here is fixed (``--window 4``: recovery points at steps 0, 4, 8, 12; the steps in
between leave only their commit record), so every crash lands at a known place of a window:
its first step (5), the middle (6) or its last step (8). The reference is a pool stepped one
step at a time with ``--window 1`` (a recovery point every step, as before windows existed).
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch

import checkpointing
from checkpointing.policy import FIXED_SHARE, REPLAY_FACTOR, WindowConfig, WindowPolicy
from checkpointing.store import is_commit
from helpers import tool
from memory_pool.journal import Journal

REPO = Path(__file__).resolve().parents[1]
torture = tool("torture")

N = 12
W = 4
DATA = REPO / "tests" / "data"


def flags(tier: str, *extra) -> list[str]:
    return ["--preset", "tiny", "--tier", tier, "--threads", "1", "--no-progress", *map(str, extra)]


def digest_of(proc) -> str:
    d = torture.parse_digest(proc.stdout)
    assert proc.returncode == 0 and d, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return d


def as_json(proc, rc: int = 0) -> dict:
    assert proc.returncode == rc, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout)


def killed(proc) -> bool:
    return proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)


def journal_of(pool: Path) -> Journal:
    header = json.loads((pool / "pool.json").read_text())
    return Journal(Path(header["storage_dir"]) / "journal", read_only=True)


@pytest.fixture(scope="module")
def ref(cli, root) -> dict[int, str]:
    """Digest after each step k = 0..N of a pool stepped one step at a time, a recovery point
    every step (--window 1); checked against an uninterrupted run with windows."""
    pool = root / "ref"
    out = {k: digest_of(cli.run(["train", "--pool", pool, *flags("pmem", "--window", 1), "--steps", k]))
           for k in range(N + 1)}
    whole = digest_of(cli.run(["train", "--pool", root / "ref-whole", *flags("shm", "--window", W), "--steps", N]))
    assert whole == out[N]
    return out


def crash_recover_resume(cli, root, ref, tier: str, k: int, phase: str, name: str) -> dict:
    """Kill step k in phase, recover (restore + replay), check the digest against the reference
    at the recovered step and that at most the step in flight and the one before it are lost;
    resume to N and check the final digest. Returns recover's report."""
    pool = root / name
    r = cli.run(["train", "--pool", pool, *flags(tier, "--window", W), "--steps", N, "--crash-at", f"{k}:{phase}"])
    assert killed(r), (r.returncode, r.stderr[-3000:])
    status = as_json(cli.run(["inspect", "--pool", pool, "--json", "--no-digest"]))["checkpoint"]
    s = status["committed_step"]
    assert s % W == 0 and s <= k, status   # the newest recovery point is a window's start
    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    c = rep["committed_step"]
    assert rep["restored_step"] == s, rep
    assert rep["replay_steps"] == status["replay_steps"] == list(range(s + 1, c + 1)), (rep, status)
    assert rep["replayed"] == c - s
    assert k - 2 <= c <= k, (k, c)         # only the step in flight and the one before it are lost
    assert rep["state_digest"] == ref[c], (c, rep["actions"])
    again = as_json(cli.run(["inspect", "--pool", pool, "--json", "--no-digest"]))["checkpoint"]
    assert again["committed_step"] == c and not again["needs_recovery"] and again["replay_steps"] == []
    res = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N])
    assert f"step {c} -> {N}" in res.stdout, res.stdout
    assert digest_of(res) == ref[N]
    return rep


# ---------------------------------------------------------------------------- crashes in a window


@pytest.mark.parametrize("phase", checkpointing.PHASES)
def test_crash_mid_window_at_every_phase_replays_bit_exact(cli, root, ref, phase):
    # shm, a direct tier: rows logged at their first touch in the window only
    crash_recover_resume(cli, root, ref, "shm", 6, phase, f"mid-{phase}")


@pytest.mark.parametrize("tier", ["shm", "pmem", "power-sim"])
@pytest.mark.parametrize("where,k", [("first", 5), ("last", 8)])
@pytest.mark.parametrize("phase", ["mid-update", "before-commit"])
def test_crash_at_a_windows_first_and_last_step_replays_bit_exact(cli, root, ref, tier, where, k, phase):
    rep = crash_recover_resume(cli, root, ref, tier, k, phase, f"{where}-{tier}-{phase}")
    if where == "last" and phase == "before-commit":
        # step 8 closes the window: its recovery point was not durable, steps 5-7 are replayed
        assert rep["restored_step"] == 4 and rep["committed_step"] == 7


@pytest.mark.parametrize("tier", ["pmem", "shm"])
def test_crash_during_the_replay_then_recover_again_is_bit_exact(cli, root, ref, tier):
    pool = root / f"replay-crash-{tier}"
    assert killed(cli.run(["train", "--pool", pool, *flags(tier, "--window", W), "--steps", N,
                           "--crash-at", "8:before-commit"]))
    r = cli.run(["recover", "--pool", pool, "--crash-at", "mid-replay"])
    assert killed(r), (r.returncode, r.stderr[-2000:])
    assert "mid-replay" in r.stderr
    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert rep["committed_step"] == 7 and rep["state_digest"] == ref[7], rep
    twice = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert twice["committed_step"] == 7 and twice["replayed"] == 0 and twice["state_digest"] == ref[7]
    assert digest_of(cli.run(["train", "--pool", pool, *flags(tier), "--steps", N])) == ref[N]


def test_train_resumes_by_replaying_the_committed_steps(cli, root, ref):
    pool = root / "train-replays"
    assert killed(cli.run(["train", "--pool", pool, *flags("power-sim", "--window", W), "--steps", N,
                           "--crash-at", "7:after-update"]))
    todo = as_json(cli.run(["inspect", "--pool", pool, "--json", "--no-digest"]))["checkpoint"]["replay_steps"]
    assert todo in ([5], [5, 6]), todo   # (step 6's commit may still have been in flight)
    res = cli.run(["train", "--pool", pool, *flags("power-sim"), "--steps", N, "--json"])
    out = as_json(res)
    assert f"replaying steps 5..{todo[-1]}" in res.stderr, res.stderr[-2000:]
    assert out["replayed_steps"] == len(todo) and out["start_step"] == 4 and out["state_digest"] == ref[N]


def test_no_replay_stops_at_the_windows_start_and_training_goes_on_from_there(cli, root, ref):
    pool = root / "no-replay"
    assert killed(cli.run(["train", "--pool", pool, *flags("pmem", "--window", W), "--steps", N,
                           "--crash-at", "7:after-update"]))
    r = cli.run(["recover", "--pool", pool, "--no-replay"])
    # ("steps 5" or "steps 5..6": step 6's commit may still have been in flight at the kill)
    assert r.returncode == 0 and "dropped the records of committed steps 5" in r.stdout, r.stdout
    assert "(--no-replay): the pool stays at step 4" in r.stdout, r.stdout
    st = as_json(cli.run(["inspect", "--pool", pool, "--json"]))
    assert st["checkpoint"]["committed_step"] == 4 and st["checkpoint"]["replay_steps"] == []
    assert st["state_digest"] == ref[4]
    # (deterministic training: the dropped steps are trained again, to the same state)
    assert digest_of(cli.run(["train", "--pool", pool, *flags("pmem"), "--steps", N])) == ref[N]


# ---------------------------------------------------------------------------- what stops a replay


def _tsv_pool(cli, root, name: str) -> tuple[Path, Path]:
    data = root / f"{name}.tsv"
    shutil.copy(DATA / "criteo_sample_100.tsv", data)
    pool = root / name
    r = cli.run(["train", "--pool", pool, *flags("pmem", "--window", W), "--data", data, "--steps", N,
                 "--crash-at", "8:before-commit"])
    assert killed(r), r.stderr[-2000:]
    return pool, data


def test_a_changed_data_file_stops_recovery_at_the_windows_start(cli, root):
    pool, data = _tsv_pool(cli, root, "changed")
    data.write_text(data.read_text() + data.read_text().splitlines()[0] + "\n")
    r = cli.run(["recover", "--pool", pool])
    assert r.returncode == 12, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "changed since steps 5..7 read it" in r.stderr and "stays at step 4" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    st = as_json(cli.run(["inspect", "--pool", pool, "--json", "--no-digest"]))["checkpoint"]
    assert st["committed_step"] == 4 and st["replay_steps"] == [5, 6, 7]   # nothing lost: kept for a retry
    t = cli.run(["train", "--pool", pool, "--threads", "1", "--no-progress", "--steps", N])
    assert t.returncode == 12 and "changed since" in t.stderr


def test_a_missing_data_file_stops_recovery_at_the_windows_start(cli, root):
    pool, data = _tsv_pool(cli, root, "missing")
    moved = data.rename(data.with_suffix(".moved"))
    r = cli.run(["recover", "--pool", pool])
    assert r.returncode == 12 and "is gone" in r.stderr and "stays at step 4" in r.stderr, r.stderr[-2000:]
    moved.rename(data)   # put back as it was: the replay goes on
    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert rep["committed_step"] == 7 and rep["replayed"] == 3


def test_a_replay_under_another_mkl_cbwr_stops_at_the_windows_start_and_goes_on_under_the_runs_own(cli, root):
    # The run records the mode MKL ran in (dlrm_cxl/arithmetic.py: pinned to AUTO,STRICT unless
    # MKL_CBWR says otherwise; MKL's GEMMs give other bits under another mode, and no process can
    # switch once MKL has started). A recover or train whose process has another stops at the
    # window's start, the records kept. (Those processes get their own fork server: MKL reads
    # the setting once per process.)
    pool = root / "mkl"
    assert killed(cli.run(["train", "--pool", pool, *flags("pmem", "--window", W), "--steps", N,
                           "--crash-at", "8:before-commit"]))
    other = torture.Cli(env={"MKL_CBWR": "COMPATIBLE"})   # (the run's: AUTO,STRICT, dlrm-cxl's own)
    try:
        r = other.run(["recover", "--pool", pool])
        assert r.returncode == 12, (r.returncode, r.stdout, r.stderr[-2000:])
        assert "ran with MKL_CBWR" in r.stderr and "stays at step 4" in r.stderr and "Traceback" not in r.stderr
        t = other.run(["train", "--pool", pool, "--threads", "1", "--no-progress", "--steps", N])
        assert t.returncode == 12 and "ran with MKL_CBWR" in t.stderr, t.stderr[-2000:]
    finally:
        other.close()
    st = as_json(cli.run(["inspect", "--pool", pool, "--json", "--no-digest"]))["checkpoint"]
    assert st["committed_step"] == 4 and st["replay_steps"] == [5, 6, 7]
    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert rep["committed_step"] == 7 and rep["replayed"] == 3


def test_a_non_deterministic_step_gives_a_typed_error_and_the_last_step_that_agreed(root, ref, monkeypatch,
                                                                                      capsys, cli):
    pool = root / "nondet"
    assert killed(cli.run(["train", "--pool", pool, *flags("pmem", "--window", W), "--steps", N,
                           "--crash-at", "8:before-commit"]))
    # The second replayed step (6) computes a loss one ulp away from its record.
    import dlrm_cxl.step as step_mod
    from dlrm_cxl.cli import main

    real = step_mod.F.binary_cross_entropy_with_logits
    calls = {"n": 0}

    def bce(*a, **kw):
        loss = real(*a, **kw)
        calls["n"] += 1
        return torch.nextafter(loss, torch.tensor(1e9)) if calls["n"] == 2 else loss

    monkeypatch.setattr(step_mod.F, "binary_cross_entropy_with_logits", bce)
    assert main(["recover", "--pool", str(pool)]) == 11
    err = capsys.readouterr().err
    assert "replay of step 6: its loss differs" in err and "stays at step 5" in err, err
    monkeypatch.undo()
    st = as_json(cli.run(["inspect", "--pool", pool, "--json"]))
    assert st["checkpoint"]["committed_step"] == 5 and st["state_digest"] == ref[5]


# ---------------------------------------------------------------------------- W = 1, the policy


def test_window_1_writes_a_full_recovery_point_every_step(cli, root, ref):
    pool = root / "w1"
    out = as_json(cli.run(["train", "--pool", pool, *flags("pmem", "--window", 1), "--steps", 6, "--json"]))
    assert out["state_digest"] == ref[6] and out["window"] == 1
    txns = journal_of(pool).txns
    assert [t.tag for t in txns if is_commit(t)][-6:] == [1, 2, 3, 4, 5, 6]
    assert not [t for t in txns if t.doc.get("kind") == "step"]   # no step record: each step is a commit
    assert out["checkpoint"]["checkpoints"] == 7   # (step 0, the initial state, included)


def test_a_window_makes_fewer_bytes_durable_per_step(cli, root, ref):
    one = as_json(cli.run(["train", "--pool", root / "bytes-1", *flags("shm", "--window", 1), "--steps", N, "--json"]))
    eight = as_json(cli.run(["train", "--pool", root / "bytes-8", *flags("shm", "--window", 8), "--steps", N,
                             "--json"]))
    assert one["state_digest"] == eight["state_digest"] == ref[N]
    b1, b8 = one["checkpoint"]["bytes_durable_per_step"], eight["checkpoint"]["bytes_durable_per_step"]
    assert b8 < 0.6 * b1, (b1, b8)
    j = journal_of(root / "bytes-8")
    kinds = [t.doc.get("kind") for t in j.txns if t.tag > 0]
    assert kinds.count("step") >= N - 3 and all("loss" in t.doc for t in j.txns if t.doc.get("kind") == "step")


def test_the_budget_chooses_the_window_from_the_step_time():
    p = WindowPolicy(WindowConfig(recovery_budget=1.0))
    assert p.length == 1 and p.next_window() == 1   # no step measured yet
    for _ in range(50):
        p.observe(0.05)
    assert abs(p.step_seconds - 0.05) < 1e-9
    expect = int(1.0 * (1 - FIXED_SHARE) / (p.step_seconds * REPLAY_FACTOR))
    assert p.next_window() == expect and 5 <= expect <= 64
    assert not p.ends(10 + expect - 1, 10) and p.ends(10 + expect, 10)
    for _ in range(50):
        p.observe(5.0)   # steps longer than the budget: a recovery point every step
    assert p.next_window() == 1
    assert WindowPolicy(WindowConfig(window=7)).next_window() == 7

    class Two:   # several ranks: each window is the smallest any rank chose
        def global_min(self, v):
            return min(v, 3)

    budget = WindowPolicy(WindowConfig(recovery_budget=1.0), coordinator=Two())
    budget.observe(0.01)
    assert budget.next_window() == 3
    assert WindowPolicy(WindowConfig(window=7), coordinator=Two()).next_window() == 7  # (the same on every rank)
    with pytest.raises(ValueError, match="window must be an integer >= 1, got 0"):
        WindowConfig(window=0)
    with pytest.raises(ValueError, match="recovery_budget must be > 0"):
        WindowConfig(recovery_budget=0)


def test_bad_window_flags_are_refused_with_exit_2(cli, root):
    r = cli.run(["train", "--pool", root / "bad-w", *flags("shm", "--window", 0), "--steps", 2])
    assert r.returncode == 2 and "--window must be an integer >= 1" in r.stderr, r.stderr[-1000:]
    r = cli.run(["train", "--pool", root / "bad-b", *flags("shm", "--recovery-budget", -1), "--steps", 2])
    assert r.returncode == 2 and "--recovery-budget" in r.stderr, r.stderr[-1000:]


class _T:
    """A table as WindowRows sees it (a name and a row count)."""

    def __init__(self, name: str, n: int):
        self.name, self.num_embeddings = name, n


def _steps_of_rows(seed: int, sizes, steps: int):
    """Random steps of distinct sorted rows per table, in both forms: per pair, and in one
    numbering (memory_pool.TouchedRows with global_rows), as the fused plan gives them."""
    from memory_pool import TouchedRows

    g = torch.Generator().manual_seed(seed)
    tables = [_T(f"t{i}", n) for i, n in enumerate(sizes)]
    states = [_T(f"s{i}", n) for i, n in enumerate(sizes)]
    base = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0)), dtype=torch.int64)
    out = []
    for _ in range(steps):
        rows = [torch.unique(torch.randint(0, n, (max(1, n // 3),), generator=g)) for n in sizes]
        pairs, member = [], []
        for f, (t, s) in enumerate(zip(tables, states)):
            pairs += [(t, rows[f]), (s, rows[f])]
            member += [f, f]
        glob = torch.cat([r + base[f] for f, r in enumerate(rows)])
        out.append((pairs, TouchedRows(pairs, global_rows=glob, base=base, member=member)))
    return out


def _as_sets(pairs):
    return {(t.name, int(i)) for t, ids in pairs for i in ids}


def test_first_touch_in_one_numbering_gives_the_same_rows_as_per_table():
    """The fused path's one-bitmap first-touch bookkeeping (checkpointing.window) against the
    per-table bitmaps, over windows of random steps: the same rows first touched at every step,
    the same rows for the window's after-images, and the same after a reset."""
    from checkpointing.window import WindowRows

    per_table, one = WindowRows(), WindowRows()
    steps = _steps_of_rows(0, [50, 7, 300, 1], 12)
    differed = 0
    for k, (pairs, touched) in enumerate(steps):
        a, ca = per_table.first_touch(pairs)
        b, cb = one.first_touch(touched)
        assert _as_sets(a) == _as_sets(b) and ca == cb
        assert [t.name for t, _ in a] == [t.name for t, _ in b]
        differed += _as_sets(a) != _as_sets(pairs)
        assert _as_sets(per_table.touched_rows()) == _as_sets(one.touched_rows())
        if k % 5 == 4:
            per_table.reset()
            one.reset()
    assert differed >= 6  # (later steps of a window touch fewer rows first: the check is not vacuous)


def test_marking_a_windows_rows_keeps_the_same_rows_as_asking_for_their_first_touches():
    """A journaled tier's writer only marks each step's rows (WindowRows.mark, no answer): the
    window's rows at its end must be those the first-touch bookkeeping keeps, in either form."""
    from checkpointing.window import WindowRows

    ref, one, per_table = WindowRows(), WindowRows(), WindowRows()
    steps = _steps_of_rows(2, [60, 5, 200], 9)
    for k, (pairs, touched) in enumerate(steps):
        ref.first_touch(pairs)
        one.mark(touched)
        per_table.mark(pairs)
        want = _as_sets(ref.touched_rows())
        assert _as_sets(one.touched_rows()) == want == _as_sets(per_table.touched_rows())
        if k == 4:
            for w in (ref, one, per_table):
                w.reset()
            assert not one.touched_rows()
    assert want > _as_sets(steps[-1][0])  # (the window's 4 steps, not its last step's rows alone)


def test_first_touch_moves_to_per_table_bitmaps_when_a_step_comes_without_one_numbering():
    from checkpointing.window import WindowRows

    ref, mixed = WindowRows(), WindowRows()
    steps = _steps_of_rows(1, [40, 9, 120], 6)
    for k, (pairs, touched) in enumerate(steps):
        a, _ = ref.first_touch(pairs)
        b, _ = mixed.first_touch(touched if k % 2 == 0 else pairs)
        assert _as_sets(a) == _as_sets(b)
        assert _as_sets(ref.touched_rows()) == _as_sets(mixed.touched_rows())


def test_first_touches_keep_one_numbering_and_gather_the_same_rows_as_pair_by_pair(tmp_pool_dir):
    """The fused plan's rows and a window's first touches of them, in one numbering, gathered
    from a real pool (memory_pool.gather: the arena's rows found with three array operations)
    against the same pairs as a plain list (one add per pair): the same ids, the same bytes;
    and the plan's distinct rows against torch.unique."""
    from checkpointing.window import WindowRows
    from dlrm_cxl.model import PRESETS
    from dlrm_cxl.options import TrainOptions
    from dlrm_cxl.trainer import Trainer
    from memory_pool import TouchedRows, distinct_sorted
    from memory_pool.gather import row_gathers

    ids = torch.tensor([7, 3, 3, 2**31 + 5, 0, 7], dtype=torch.int64)
    assert torch.equal(distinct_sorted(ids), torch.unique(ids))
    assert torch.equal(distinct_sorted(ids[ids < 2**31], narrow=True), torch.tensor([0, 3, 7]))
    assert distinct_sorted(ids[:0]).numel() == 0
    tr = Trainer(TrainOptions(pool=str(tmp_pool_dir), steps=0, tier="shm", threads=1, progress=False,
                              fresh=True), PRESETS["tiny"], log=lambda s: None)
    try:
        assert tr.fused
        win = WindowRows()
        partial = 0
        for k in range(4):
            plan = tr.plan(tr.source.batch(k))
            touched = tr.sparse_opt.touched(plan)
            assert isinstance(touched, TouchedRows) and touched.global_rows is not None
            first, complete = win.first_touch(touched)
            partial += not complete
            for pairs in (touched, first, win.touched_rows()):
                assert isinstance(pairs, TouchedRows)
                fast, slow = row_gathers(tr.pool._arena, pairs), row_gathers(tr.pool._arena, list(pairs))
                assert [g.idx for g in fast] == [g.idx for g in slow] and len(fast) == 2
                for f, s in zip(fast, slow):
                    assert torch.equal(f.ids, s.ids)
                for idx, got in tr.pool.gather_row_groups(pairs):
                    want = torch.cat([pairs[i][0].view()[pairs[i][1]].reshape(-1) for i in idx])
                    assert torch.equal(got.reshape(-1), want)
        assert partial >= 2  # (later steps of the window touch fewer rows first)
    finally:
        tr.close()


def test_the_replay_settings_check_names_the_mode_to_export_for_a_run_in_mkls_default_or_another():
    # (the message and hint of the stop above, for both kinds of record; this process runs pinned)
    from dlrm_cxl.arithmetic import PINNED, mkl_mode
    from dlrm_cxl.errors import ReplaySourceError
    from dlrm_cxl.replay_source import check_replay_settings

    assert mkl_mode() == PINNED
    check_replay_settings({"mkl_cbwr": PINNED}, first=5, last=7, step=4)   # the same: goes on
    check_replay_settings({"threads": 1}, first=5, last=7, step=4)         # recorded none: not checked
    with pytest.raises(ReplaySourceError) as e:
        check_replay_settings({"mkl_cbwr": None}, first=5, last=7, step=4)
    assert "steps 5..7 ran with MKL_CBWR MKL's default mode" in str(e.value) and "stays at step 4" in str(e.value)
    assert e.value.hint.startswith("export MKL_CBWR= (empty") and e.value.exit_code == 12
    with pytest.raises(ReplaySourceError) as e:
        check_replay_settings({"mkl_cbwr": "COMPATIBLE"}, first=5, last=5, step=4)
    assert "step 5 ran with MKL_CBWR 'COMPATIBLE'" in str(e.value)
    assert e.value.hint.startswith("export MKL_CBWR=COMPATIBLE before")
