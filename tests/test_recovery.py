"""Crash recovery end to end: real processes, real SIGKILL, real files, no mocks.

Every ``dlrm-cxl`` command here is a real process. Most run as children forked from one warm
interpreter (``tools/torture.py``'s :class:`ForkServer`: each child runs exactly what
``python -m dlrm_cxl ARGS`` runs, dies of a real SIGKILL, and reads and writes the real pool
files; the fork only saves the ~4 s interpreter and torch/torchrec start-up per command). The
tests that kill the trainer from outside use fresh ``python -m dlrm_cxl`` processes, and
``test_reference_digests_...`` checks that a fresh process and a forked child train to the same
digest. ``DLRM_CXL_TEST_FRESH=1`` runs every command as a fresh process instead (slower).

The references: one pool per tier is advanced one step at a time (``train --steps 0``, ``1``,
... each run resuming the last), recording the ``state_digest`` after every step ``k``; these are
checked against uninterrupted runs. A crash test then asserts that (a) right after ``recover``
the pool's digest is the reference digest of the step it committed, (b) the steps after it were
exactly the ones rolled back, and (c) resuming ends bit-exact at the uninterrupted digest.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import checkpointing
from checkpointing.store import PAYLOAD_OFFSET, ckpt_dir, read_commit, scan_slots
from memory_pool.errors import RecoveryError

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("dlrm_cxl_torture", REPO / "tools" / "torture.py")
torture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torture)

N = 8          # steps of every crash test's run
K = 5          # the step --crash-at kills
N_EXT = 60     # steps of the runs killed from outside
TIERS = ("pmem", "power-sim")
BEFORE_COMMIT = ("before-log", "mid-log", "after-log", "mid-update", "after-update", "before-commit", "mid-dense")
NOT_LOGGED = ("before-log", "mid-log")   # step K's undo slot is not sealed yet: nothing of K to roll back


def flags(tier: str, *extra) -> list[str]:
    return ["--preset", "tiny", "--tier", tier, "--threads", "1", "--no-progress", *map(str, extra)]


def digest_of(proc: subprocess.CompletedProcess) -> str:
    d = torture.parse_digest(proc.stdout)
    assert proc.returncode == 0 and d, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return d


def as_json(proc: subprocess.CompletedProcess, rc: int = 0) -> dict:
    assert proc.returncode == rc, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def killed(proc) -> bool:
    """Died of SIGKILL: -9 from subprocess, 137 from a shell."""
    return proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)


def pool_files(path: Path) -> dict[str, str]:
    """sha256 of every file of a pool but its LOCK (which records the last writer's pid)."""
    out = {}
    for p in sorted(Path(path).rglob("*")):
        if p.is_file() and p.name != "LOCK":
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def copy_pool(src: Path, dst: Path) -> Path:
    """A pmem/power-sim pool is its directory: a copy is an independent pool."""
    shutil.copytree(src, dst)
    return dst




@pytest.fixture(scope="module")
def ref(cli, root):
    """Reference digests: ``ref["stepped"][tier][k]`` after step k (k = 0..N) of a pool stepped
    one step at a time, plus uninterrupted runs to compare them with."""
    out = {"stepped": {}, "uninterrupted": {}}
    for tier in TIERS:
        pool = root / f"ref-stepped-{tier}"
        out["stepped"][tier] = {k: digest_of(cli.run(["train", "--pool", pool, *flags(tier), "--steps", k]))
                                for k in range(N + 1)}
    out["uninterrupted"]["fresh-pmem-N"] = digest_of(subprocess.run(
        torture.cli_cmd("train", "--pool", root / "ref-fresh", *flags("pmem"), "--steps", N),
        capture_output=True, text=True, timeout=300, cwd=REPO))
    out["uninterrupted"]["power-sim-N"] = digest_of(
        cli.run(["train", "--pool", root / "ref-full-ps", *flags("power-sim"), "--steps", N]))
    return out


@pytest.fixture(scope="module")
def ref_at(cli, root, ref):
    """``ref_at(tier, k)``: the digest of an uninterrupted run of k steps (stepped references
    for k <= N; beyond, an uninterrupted pmem run of k steps, made once and kept)."""
    extra = {}

    def at(tier: str, k: int) -> str:
        if k in ref["stepped"][tier]:
            return ref["stepped"][tier][k]
        if k not in extra:
            extra[k] = digest_of(cli.run(["train", "--pool", root / f"ref-at-{k}", *flags("pmem"), "--steps", k]))
        return extra[k]

    return at


def R(ref, tier: str, k: int) -> str:
    return ref["stepped"][tier][k]


# --------------------------------------------------------------------------- references


def test_reference_digests_resuming_step_by_step_is_bit_exact(ref):
    pm, ps = ref["stepped"]["pmem"], ref["stepped"]["power-sim"]
    # resuming a pool one step at a time ends where an uninterrupted run ends ...
    assert pm[N] == ref["uninterrupted"]["fresh-pmem-N"]      # (a fresh `python -m dlrm_cxl` process)
    assert ps[N] == ref["uninterrupted"]["power-sim-N"]
    # ... every step changes the state, and the tier does not change the arithmetic
    assert len(set(pm.values())) == len(pm)
    assert all(ps[k] == pm[k] for k in ps)


# --------------------------------------------------------------------------- 1. every phase, two tiers


@pytest.mark.parametrize("phase", checkpointing.PHASES)
@pytest.mark.parametrize("tier", TIERS)
def test_crash_at_every_phase_then_recover_and_resume_is_bit_exact(cli, root, ref, tier, phase):
    pool = root / f"crash-{tier}-{phase}"
    crash = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N, "--crash-at", f"{K}:{phase}"])
    assert killed(crash), (crash.returncode, crash.stderr[-3000:])
    assert "crash injection: SIGKILL at step" in crash.stderr

    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    c, rolled = rep["committed_step"], rep["rolled_back_steps"]
    # right after recovery the pool is exactly an uninterrupted run stopped at the committed step
    assert rep["state_digest"] == R(ref, tier, c), (c, rolled)
    # steps after the committed one, and only those, were rolled back, newest first
    assert all(s > c for s in rolled) and rolled == sorted(rolled, reverse=True)
    if phase == "after-commit":
        assert c == K and rolled == []
    elif phase in BEFORE_COMMIT:
        assert c < K
        last_logged = K - 1 if phase in NOT_LOGGED else K
        assert rolled == list(range(last_logged, c, -1)), (c, rolled)
    else:  # random: some moment of step K (or just after it)
        assert c < N
        assert rolled == (list(range(rolled[0], c, -1)) if rolled else [])
    assert (rep["rows_restored"] > 0) == bool(rolled)
    assert rep["needed"] == bool(rolled)
    if phase == "mid-dense":  # the snapshot being written when it died is cleaned up
        assert any(a.startswith("removed unfinished .dense-") for a in rep["actions"]), rep["actions"]
    assert not list(ckpt_dir(pool).glob(".*.tmp"))
    assert [p.name for p in ckpt_dir(pool).glob("dense-*.pt")] == [f"dense-{c:012d}.pt"]

    # the same command without --crash-at continues from the committed step
    res = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N])
    assert f"step {c} -> {N}" in res.stdout, res.stdout
    assert digest_of(res) == R(ref, tier, N)


# --------------------------------------------------------------------------- 2. killed from outside


@pytest.mark.parametrize("tier", TIERS)
def test_sigkill_from_outside_while_training_then_resume_is_bit_exact(cli, root, ref_at, tier):
    pool = root / f"external-{tier}"
    cmd = torture.cli_cmd("train", "--pool", pool, *flags(tier), "--steps", N_EXT)
    run = torture._Train(cmd)   # a fresh `python -m dlrm_cxl` process
    try:
        assert run.wait_banner(300), run.stderr
        # once training is under way (a step after 0 committed), a random short moment later
        deadline = time.monotonic() + 120
        while run.proc.poll() is None and time.monotonic() < deadline:
            try:
                if read_commit(ckpt_dir(pool))["step"] >= 2:
                    break
            except Exception:  # COMMIT is replaced atomically, but be tolerant while polling
                pass
            time.sleep(0.005)
        time.sleep(random.Random(f"external-{tier}").uniform(0.0, 0.1))
    finally:
        run.proc.send_signal(signal.SIGKILL)
        run.wait(120)
    assert run.proc.returncode == -signal.SIGKILL, f"the run ended before the kill:\n{run.stdout}"

    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    c = rep["committed_step"]
    assert 2 <= c < N_EXT, rep
    assert rep["state_digest"] == ref_at(tier, c)
    assert all(s > c for s in rep["rolled_back_steps"])

    res = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N_EXT])  # the same command again
    assert f"step {c} -> {N_EXT}" in res.stdout, res.stdout
    assert digest_of(res) == ref_at("pmem", N_EXT)


# --------------------------------------------------------------------------- 3. recovery is crash-safe


@pytest.fixture(scope="module")
def multi_step_crash(cli, root):
    """Per tier: a pool killed at step 7 with --dense-every 4 (several steps to roll back), and
    the report of a clean recovery of a copy of it."""
    out = {}
    for tier in TIERS:
        pool = root / f"multi-{tier}"
        r = cli.run(["train", "--pool", pool, *flags(tier, "--dense-every", 4), "--steps", N,
                     "--crash-at", "7:after-update"])
        assert killed(r), r.stderr[-3000:]
        clean = copy_pool(pool, root / f"multi-{tier}-clean")
        out[tier] = (pool, as_json(cli.run(["recover", "--pool", clean, "--json"])))
        assert len(out[tier][1]["rolled_back_steps"]) >= 2, out[tier][1]
    return out


@pytest.mark.parametrize("rphase", ["mid-rollback", "before-invalidate"])
@pytest.mark.parametrize("tier", TIERS)
def test_crash_during_recovery_then_recover_again_equals_a_clean_recovery(cli, root, ref, multi_step_crash,
                                                                          tier, rphase):
    src, clean = multi_step_crash[tier]
    pool = copy_pool(src, root / f"rcrash-{tier}-{rphase}")
    r = cli.run(["recover", "--pool", pool, "--crash-at", rphase])
    assert killed(r), (r.returncode, r.stderr)
    assert "crash injection: SIGKILL at recovery" in r.stderr
    status = as_json(cli.run(["inspect", "--pool", pool, "--json", "--no-digest"]))["checkpoint"]
    assert status["needs_recovery"] and status["steps_to_roll_back"] == sorted(clean["rolled_back_steps"])

    again = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert again["committed_step"] == clean["committed_step"]
    assert again["rolled_back_steps"] == clean["rolled_back_steps"]
    assert again["state_digest"] == clean["state_digest"] == R(ref, tier, clean["committed_step"])

    # idempotent: a second recovery finds nothing to do and changes nothing
    before = pool_files(pool)
    twice = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert twice["needed"] is False and twice["rolled_back_steps"] == [] and twice["rows_restored"] == 0
    assert twice["committed_step"] == clean["committed_step"] and twice["state_digest"] == clean["state_digest"]
    assert pool_files(pool) == before


# --------------------------------------------------------------------------- 4. damage


@pytest.fixture(scope="module")
def uncommitted(cli, root):
    """A pmem pool killed in the middle of step K's in-place update: step K's undo slot is sealed
    and not committed, and some of its rows have changed."""
    pool = root / "uncommitted"
    r = cli.run(["train", "--pool", pool, *flags("pmem"), "--steps", N, "--crash-at", f"{K}:mid-update"])
    assert killed(r), r.stderr[-3000:]
    return pool


def _newest_uncommitted_slot(pool: Path):
    d = ckpt_dir(pool)
    c = read_commit(d)["step"]
    slots = [s for s in scan_slots(d / "undo") if s.state == "sealed" and s.step > c]
    assert slots, "the crash left no uncommitted sealed slot"
    return max(slots, key=lambda s: s.step)


def _flip(path: Path, offset: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def damage(pool: Path, kind: str) -> str:
    """Damage ``pool`` one way; returns the name of the damaged file."""
    d = ckpt_dir(pool)
    if kind in ("record-bit-flip", "slot-truncated", "seal-cut-off", "seal-bit-flip"):
        s = _newest_uncommitted_slot(pool)
        if kind == "record-bit-flip":    # inside the before-image bytes of the last record
            _flip(s.path, PAYLOAD_OFFSET + s.payload_len - 5)
        elif kind == "slot-truncated":   # half of the payload gone
            os.truncate(s.path, PAYLOAD_OFFSET + s.payload_len // 2)
        elif kind == "seal-cut-off":     # the file cut inside its seal
            os.truncate(s.path, 20)
        else:                            # a bit of the step number in the seal
            _flip(s.path, 8, 0x01)
        return s.path.name
    if kind == "dense-bit-flip":
        name = read_commit(d)["dense_file"]
        _flip(d / name, (d / name).stat().st_size // 2)
        return name
    if kind == "dense-missing":
        name = read_commit(d)["dense_file"]
        (d / name).unlink()
        return name
    if kind == "commit-bit-flip":
        raw = (d / "COMMIT").read_bytes()
        _flip(d / "COMMIT", raw.index(b"\"step\": ") + 8, 0x01)  # a digit of the step number
        return "COMMIT"
    if kind == "commit-missing":
        (d / "COMMIT").unlink()
        return "COMMIT"
    raise AssertionError(kind)


DAMAGE = ["record-bit-flip", "slot-truncated", "seal-cut-off", "seal-bit-flip", "dense-bit-flip",
          "dense-missing", "commit-bit-flip", "commit-missing"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_damage_is_detected_with_a_clear_error_and_changes_nothing(cli, root, uncommitted, kind):
    pool = copy_pool(uncommitted, root / f"damage-{kind}")
    name = damage(pool, kind)
    before = pool_files(pool)

    r = cli.run(["recover", "--pool", pool, "--json"])
    assert r.returncode == 4, (r.returncode, r.stdout, r.stderr)
    assert "error" in r.stderr and name in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert pool_files(pool) == before

    dry = cli.run(["recover", "--pool", pool, "--dry-run"])
    assert dry.returncode == 4 and name in dry.stderr, (dry.returncode, dry.stderr)

    with pytest.raises(RecoveryError) as e:
        checkpointing.recover(pool)
    assert name in str(e.value)
    assert pool_files(pool) == before

    # and the trainer refuses too (instead of training on top of the damage)
    t = cli.run(["train", "--pool", pool, *flags("pmem"), "--steps", N])
    assert t.returncode == 4, (t.returncode, t.stderr[-3000:])
    assert name in t.stderr and "Traceback" not in t.stderr, t.stderr
    assert pool_files(pool) == before


def test_damage_to_a_committed_steps_slot_is_harmless(cli, root, ref):
    """Records of steps at or before COMMIT are never read: damage there changes no outcome."""
    pool = copy_pool(root / "ref-fresh", root / "damage-committed-slot")  # N steps, cleanly finished
    c = read_commit(ckpt_dir(pool))["step"]
    old = [s for s in scan_slots(ckpt_dir(pool) / "undo") if s.state == "sealed"]
    assert c == N and old and all(s.step <= c for s in old)
    _flip(old[0].path, PAYLOAD_OFFSET + old[0].payload_len - 5)
    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert rep["committed_step"] == c and not rep["needed"] and rep["state_digest"] == ref["stepped"]["pmem"][c]


# --------------------------------------------------------------------------- 5. --checkpoint none


def test_checkpoint_none_killed_mid_run_is_refused_not_resumed(cli, root):
    pool = root / "none-killed"
    cmd = torture.cli_cmd("train", "--pool", pool, *flags("pmem"), "--steps", 400, "--checkpoint", "none")
    run = torture._Train(cmd)
    marker = ckpt_dir(pool) / "RUNNING-WITHOUT-UNDO"
    try:
        assert run.wait_banner(300), run.stderr
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and run.proc.poll() is None:
            time.sleep(0.01)
        assert marker.exists(), "the run never started a step"
        time.sleep(0.3)  # rows are being changed in place now
    finally:
        run.proc.send_signal(signal.SIGKILL)
        run.wait(120)
    assert run.proc.returncode == -signal.SIGKILL, f"the run ended before the kill:\n{run.stdout}"
    before = pool_files(pool)

    st = as_json(cli.run(["inspect", "--pool", pool, "--json"]))
    assert st["checkpoint"]["needs_recovery"] and st["checkpoint"]["trained_without_undo"]
    assert st["state_digest"] is None
    for argv in (["recover", "--pool", pool], ["recover", "--pool", pool, "--dry-run"],
                 ["train", "--pool", pool, *flags("pmem"), "--steps", 400, "--checkpoint", "none"],
                 ["train", "--pool", pool, *flags("pmem"), "--steps", 400]):
        r = cli.run(argv)
        assert r.returncode == 4, (argv, r.returncode, r.stderr[-2000:])
        assert "--checkpoint none" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert pool_files(pool) == before
    with pytest.raises(RecoveryError, match="--checkpoint none"):
        checkpointing.recover(pool)


def test_checkpoint_none_clean_runs_resume_bit_exact(cli, root, ref):
    pool = root / "none-clean"
    assert digest_of(cli.run(["train", "--pool", pool, *flags("pmem"), "--steps", 4, "--checkpoint", "none"])) \
        == ref["stepped"]["pmem"][4]
    rep = checkpointing.recover(pool)
    assert rep.committed_step == 4 and not rep.needed and rep.state_digest == ref["stepped"]["pmem"][4]
    res = cli.run(["train", "--pool", pool, *flags("pmem"), "--steps", N, "--checkpoint", "none"])
    assert f"step 4 -> {N}" in res.stdout
    assert digest_of(res) == ref["stepped"]["pmem"][N]


# --------------------------------------------------------------------------- 7. train recovers first


@pytest.mark.parametrize("tier,as_json_output", [("pmem", False), ("power-sim", True)])
def test_train_on_a_crashed_pool_recovers_first_and_says_so(cli, root, ref, tier, as_json_output):
    pool = root / f"train-recovers-{tier}"
    r = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N, "--crash-at", f"{K}:after-update"])
    assert killed(r)
    status = as_json(cli.run(["inspect", "--pool", pool, "--json"]))["checkpoint"]
    assert status["needs_recovery"] and K in status["steps_to_roll_back"]
    c = status["committed_step"]

    res = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N, *(["--json"] if as_json_output else [])])
    log = res.stderr if as_json_output else res.stdout
    assert "needs recovery" in log and "recovering" in log and f"recovered to step {c}" in log, log
    if as_json_output:
        doc = as_json(res)
        assert doc["recovered"]["committed_step"] == c
        assert doc["recovered"]["rolled_back_steps"] == sorted(status["steps_to_roll_back"], reverse=True)
        assert doc["start_step"] == c and doc["end_step"] == N
        assert doc["state_digest"] == R(ref, tier, N)
    else:
        assert digest_of(res) == R(ref, tier, N)


# --------------------------------------------------------------------------- 8. dry run


def test_dry_run_changes_nothing_and_reports_what_it_would_roll_back(cli, root, ref, uncommitted):
    pool = copy_pool(uncommitted, root / "dry-run")
    before = pool_files(pool)
    status = as_json(cli.run(["inspect", "--pool", pool, "--json"]))["checkpoint"]
    assert status["needs_recovery"] and status["steps_to_roll_back"]

    dry = as_json(cli.run(["recover", "--pool", pool, "--dry-run", "--json"]))
    assert dry["dry_run"] is True and dry["needed"] is True
    assert dry["rolled_back_steps"] == sorted(status["steps_to_roll_back"], reverse=True)
    assert dry["rows_restored"] > 0 and dry["state_digest"] is None
    assert all("would roll back" in a for a in dry["actions"])
    text = cli.run(["recover", "--pool", pool, "--dry-run"])
    assert text.returncode == 0 and "would be consistent at step" in text.stdout, text.stdout
    api = checkpointing.recover(pool, dry_run=True)
    assert api.rolled_back_steps == dry["rolled_back_steps"] and api.rows_restored == dry["rows_restored"]
    assert pool_files(pool) == before
    assert as_json(cli.run(["inspect", "--pool", pool, "--json"]))["checkpoint"] == status

    real = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert real["rolled_back_steps"] == dry["rolled_back_steps"]
    assert real["rows_restored"] == dry["rows_restored"]
    assert real["committed_step"] == dry["committed_step"] == status["committed_step"]
    assert real["state_digest"] == ref["stepped"]["pmem"][real["committed_step"]]
    # on a consistent pool a dry run reports the digest inspect reports
    healthy = as_json(cli.run(["recover", "--pool", pool, "--dry-run", "--json"]))
    assert healthy["needed"] is False
    assert healthy["state_digest"] == as_json(cli.run(["inspect", "--pool", pool, "--json"]))["state_digest"]


# --------------------------------------------------------------------------- edge cases of crash injection and creation


def test_crash_at_fires_with_checkpoint_none(cli, root):
    r = cli.run(["train", "--pool", root / "none-crash-at", *flags("pmem"), "--steps", 4, "--checkpoint", "none",
                 "--crash-at", "2:after-update"])
    assert killed(r), r.returncode


def test_mid_update_fires_with_a_single_table_model(cli, root, tmp_path):
    cfg = tmp_path / "one.json"
    cfg.write_text(json.dumps({"feature_names": ["c1"], "num_embeddings": [100]}))
    r = cli.run(["train", "--pool", root / "one-table", *flags("pmem"), "--config", cfg, "--steps", 4,
                 "--crash-at", "2:mid-update"])
    assert killed(r), r.returncode


def test_pool_killed_before_its_first_commit_gives_a_clear_error(cli, root):
    pool = root / "no-first-commit"
    digest_of(cli.run(["train", "--pool", pool, *flags("pmem"), "--steps", 0]))
    (ckpt_dir(pool) / "COMMIT").unlink()  # what a kill between pool creation and COMMIT 0 leaves
    r = cli.run(["train", "--pool", pool, *flags("pmem"), "--steps", 2])
    assert r.returncode in (0, 3, 4) and "Traceback" not in r.stderr, r.stderr[-2000:]
