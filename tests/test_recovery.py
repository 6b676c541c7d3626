"""Crash recovery end to end: real processes, real SIGKILL, real files, no mocks.

Every ``dlrm-cxl`` command here is a real process. Most run as children forked from one warm
interpreter (``tools/torture.py``'s :class:`ForkServer`: each child runs exactly what
``python -m dlrm_cxl ARGS`` runs, dies of a real SIGKILL, and reads and writes the real pool
files; the fork only saves the ~4 s interpreter and torch/torchrec start-up per command). The
tests that kill the trainer from outside use fresh ``python -m dlrm_cxl`` processes, and
``test_reference_digests_...`` checks that a fresh process and a forked child train to the same
digest. ``DLRM_CXL_TEST_FRESH=1`` runs every command as a fresh process instead (slower).

The references: one pool per journaled tier is advanced one step at a time (``train --steps 0``,
``1``, ... each run resuming the last), recording the ``state_digest`` after every step ``k``;
these are checked against uninterrupted runs (and the tier does not change the arithmetic, so
shm pools are checked against them too). A crash test then asserts that (a) right after
``recover`` the pool's digest is the reference digest of the step it committed, (b) the steps
after it were exactly the ones rolled back, and (c) resuming ends bit-exact at the uninterrupted
digest.

Where the state lives: the pool's journal (``<storage dir>/journal/seg-*.log``, see
``memory_pool.journal``): one transaction per recovery point, ``[UNDO...] [ROWS...] DENSE END``.
shm is a direct tier: a step's ``UNDO`` before-images precede its in-place update, and recovery
applies those of the unfinished steps. pmem (emulated) and power-sim are journaled tiers: a
step's rows reach durable media only in its committed transaction (``ROWS`` after-images), so an
unfinished step has nothing to restore (0 rows) and only its records to drop. Damage before the
newest ``END`` is refused (exit 4, nothing changed); damage in the unfinished tail is a torn tail
(journaled tiers always; shm only when no valid record follows it).
"""

from __future__ import annotations

import hashlib
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
from checkpointing.store import ckpt_dir, is_commit
from helpers import flip, tool
from memory_pool.errors import PoolCorruptError, RecoveryError
from memory_pool.journal import Journal, RecordType

REPO = Path(__file__).resolve().parents[1]
torture = tool("torture")

N = 8          # steps of every crash test's run
K = 5          # the step --crash-at kills
N_EXT = 60     # steps of the runs killed from outside
TIERS = ("pmem", "power-sim")              # the journaled tiers (copyable pools: their directory is all)
# (shm-inline: shm with the journal writer on the trainer's thread, --writer inline, which
# --writer auto picks on shm when no core is spare; the other columns run it on its own thread:
# --threads 1 leaves a core to spare on the 2-core machines this runs on)
CRASH_TIERS = ("pmem", "power-sim", "shm", "shm-inline")
# Phases before step K's commit starts. Commits are pipelined (step K computes while step K-1's
# transaction becomes durable), so a crash here may find K-1's commit still in flight: K-2.
PRE_COMMIT = ("before-log", "mid-log", "after-log", "mid-update", "after-update")
# Phases inside step K's commit: --crash-at waits for it, and for K-1's, first.
IN_COMMIT = ("before-commit", "mid-dense")


def flags(tier: str, *extra) -> list[str]:
    tier, writer = ("shm", ["--writer", "inline"]) if tier == "shm-inline" else (tier, [])
    # (--window 1: a full recovery point every step, what this matrix was written for; windows
    # with replay: tests/test_windows.py. A later --window in ``extra`` wins.)
    return ["--preset", "tiny", "--tier", tier, *writer, "--threads", "1", "--no-progress", "--window", "1",
            *map(str, extra)]


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


def storage_dir(pool: Path) -> Path:
    """Where a pool's journal and table files live (its shm region for tier shm)."""
    header = json.loads((Path(pool) / "pool.json").read_text())
    return Path(header["storage_dir"]) if header["tier"] == "shm" else Path(pool)


def journal_dir(pool: Path) -> Path:
    return storage_dir(pool) / "journal"


def pool_files(path: Path) -> dict[str, str]:
    """sha256 of every file of a pool (its shm region included) but its LOCK (which records the
    last writer's pid)."""
    out = {}
    for base in dict.fromkeys([Path(path), storage_dir(path)]):
        for p in sorted(base.rglob("*")):
            if p.is_file() and p.name != "LOCK":
                out[f"{base.name}/{p.relative_to(base)}"] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def copy_pool(src: Path, dst: Path) -> Path:
    """A pmem/power-sim pool is its directory: a copy is an independent pool."""
    shutil.copytree(src, dst)
    return dst


def read_journal(pool: Path) -> Journal:
    return Journal(journal_dir(pool), read_only=True)


def journal_layout(pool: Path) -> list[str]:
    """The journal's transactions and tail, for assertion messages."""
    j = read_journal(pool)
    out = [f"{t.tag}{'' if is_commit(t) else '(' + str(t.doc.get('kind')) + ')'}: "
           f"{sorted({(RecordType(r.type).name, r.tag) for r in t.records})}" for t in j.txns]
    return out + [f"tail: {sorted({(RecordType(r.type).name, r.tag) for r in j.tail})} torn {j.torn_bytes} "
                  f"damage {j.tail_damage}"]


def committed_steps(pool: Path) -> list[int]:
    return [t.tag for t in read_journal(pool).txns if is_commit(t)]


def check_clean_journal(pool: Path, c: int) -> None:
    """After a recovery: the newest commit is step c, with exactly one dense state, and nothing
    is left after it (no unfinished records, no torn bytes)."""
    j = read_journal(pool)
    commits = [t for t in j.txns if is_commit(t)]
    assert commits and commits[-1].tag == c and j.last is commits[-1], [t.tag for t in commits[-3:]]
    assert [r.type for r in commits[-1].records].count(RecordType.DENSE) == 1
    assert j.tail == [] and j.torn_bytes == 0 and j.tail_damage is None


def cut(path: Path, start: int, end: int) -> None:
    """Remove bytes [start, end) from a file (a record cut out of a segment)."""
    data = path.read_bytes()
    path.write_bytes(data[:start] + data[end:])


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
    out["uninterrupted"]["shm-N"] = digest_of(
        cli.run(["train", "--pool", root / "ref-full-shm", *flags("shm"), "--steps", N]))
    return out


@pytest.fixture(scope="module")
def ref_at(cli, root, ref):
    """``ref_at(tier, k)``: the digest of an uninterrupted run of k steps (stepped references
    for k <= N; beyond, an uninterrupted pmem run of k steps, made once and kept)."""
    extra = {}

    def at(tier: str, k: int) -> str:
        if k <= N:
            return R(ref, tier, k)
        if k not in extra:
            extra[k] = digest_of(cli.run(["train", "--pool", root / f"ref-at-{k}", *flags("pmem"), "--steps", k]))
        return extra[k]

    return at


def R(ref, tier: str, k: int) -> str:
    """Reference digest after step k (shm: the pmem references; the tier changes no arithmetic,
    see the reference test)."""
    return ref["stepped"]["pmem" if tier.startswith("shm") else tier][k]


# --------------------------------------------------------------------------- references


def test_reference_digests_resuming_step_by_step_is_bit_exact(ref):
    pm, ps = ref["stepped"]["pmem"], ref["stepped"]["power-sim"]
    # resuming a pool one step at a time ends where an uninterrupted run ends ...
    assert pm[N] == ref["uninterrupted"]["fresh-pmem-N"]      # (a fresh `python -m dlrm_cxl` process)
    assert ps[N] == ref["uninterrupted"]["power-sim-N"]
    # ... every step changes the state, and the tier does not change the arithmetic
    assert len(set(pm.values())) == len(pm)
    assert all(ps[k] == pm[k] for k in ps)
    assert ref["uninterrupted"]["shm-N"] == pm[N]


# --------------------------------------------------------------------------- 1. every phase, three tiers


@pytest.mark.parametrize("phase", checkpointing.PHASES)
@pytest.mark.parametrize("tier", CRASH_TIERS)
def test_crash_at_every_phase_then_recover_and_resume_is_bit_exact(cli, root, ref, tier, phase):
    pool = root / f"crash-{tier}-{phase}"
    crash = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N, "--crash-at", f"{K}:{phase}"])
    assert killed(crash), (crash.returncode, crash.stderr[-3000:])
    assert "crash injection: SIGKILL at step" in crash.stderr
    status = as_json(cli.run(["inspect", "--pool", pool, "--json", "--no-digest"]))["checkpoint"]

    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    c, rolled = rep["committed_step"], rep["rolled_back_steps"]
    direct = tier.startswith("shm")
    assert c == status["committed_step"]
    # right after recovery the pool is exactly an uninterrupted run stopped at the committed step
    assert rep["state_digest"] == R(ref, tier, c), (c, rolled)
    # exactly the steps that had records after the newest commit were rolled back, newest first
    assert rolled == sorted(status["steps_to_roll_back"], reverse=True), (rolled, status)
    assert rolled == (list(range(rolled[0], c, -1)) if rolled else []), (c, rolled)
    if phase == "after-commit":
        assert c == K and rolled == []
    elif phase in IN_COMMIT:
        # (mid-dense on power-sim: nothing of step K was synced yet, and the emulated power
        # loss took its records back, memory_pool/fileio.py: nothing left to roll back)
        assert c == K - 1 and rolled == ([] if (phase, tier) == ("mid-dense", "power-sim") else [K])
    elif phase in PRE_COMMIT:
        # (inline, step K-1 was durable before step K began: nothing but the step in flight is lost)
        assert c in ((K - 1,) if tier == "shm-inline" else (K - 1, K - 2)), c
        if direct and phase != "before-log":
            # step K's undo records were appended (after step K-1's commit, by the same writer)
            assert c == K - 1 and rolled == [K]
        else:
            # no record of step K yet (journaled tiers write a step's rows at its commit);
            # step K-1 is rolled back only if its commit was still in flight
            assert set(rolled) <= {K - 1} and (c == K - 2 or rolled == [])
    else:  # random: some moment of step K (or just after it)
        assert c < N
    if direct:
        assert (rep["rows_restored"] > 0) == bool(rolled)
    else:  # the rows of unfinished steps never reached durable media: nothing to restore
        assert rep["rows_restored"] == 0
        assert all("never reached durable media" in a for a in rep["actions"] if a.startswith("rolled back"))
    assert rep["needed"] == bool(rolled)
    if rolled:  # the unfinished transaction (mid-dense: its dense state too) is dropped
        assert any(a.startswith("dropped") and "unfinished journal records" in a for a in rep["actions"]), \
            rep["actions"]
    check_clean_journal(pool, c)
    assert not list(ckpt_dir(storage_dir(pool)).glob(".*.tmp"))

    # the same command without --crash-at continues from the committed step
    res = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N])
    assert f"step {c} -> {N}" in res.stdout, res.stdout
    assert ("journal writer inline" in res.stdout) == (tier == "shm-inline"), res.stdout
    assert digest_of(res) == R(ref, tier, N)


# --------------------------------------------------------------------------- 2. killed from outside


def _kill_from_outside_under_way(cli, pool: Path, tier: str, attempt: int) -> dict | None:
    """Run ``train`` in a fresh process, SIGKILL it once a step after 0 is committed (a random
    short moment later), recover: the recovery report; None when the run ended before the kill
    (60 steps take 0.4 s: on a loaded machine the poll may not see a commit before the end)."""
    cmd = torture.cli_cmd("train", "--pool", pool, *flags(tier), "--steps", N_EXT)
    run = torture._Train(cmd)   # a fresh `python -m dlrm_cxl` process
    try:
        assert run.wait_banner(300), run.stderr
        # once training is under way (a step after 0 committed), a random short moment later
        deadline = time.monotonic() + 120
        while run.proc.poll() is None and time.monotonic() < deadline:
            try:
                if max(committed_steps(pool), default=-1) >= 2:
                    break
            except Exception:  # the journal is being appended to: be tolerant while polling
                pass
            time.sleep(0.005)
        time.sleep(random.Random(f"external-{tier}-{attempt}").uniform(0.0, 0.1))
    finally:
        run.proc.send_signal(signal.SIGKILL)
        run.wait(120)
    if run.proc.returncode == 0:
        return None
    assert run.proc.returncode == -signal.SIGKILL, (run.proc.returncode, run.stderr[-2000:])
    return as_json(cli.run(["recover", "--pool", pool, "--json"]))


@pytest.mark.parametrize("tier", TIERS)
def test_sigkill_from_outside_while_training_then_resume_is_bit_exact(cli, root, ref_at, tier):
    # (On a loaded machine -- the suite on every core -- the poll once saw its first commit only
    # as the run was closing, after its last step: the kill then lands in the close, which the
    # recovery must also survive bit-exactly; or it saw none before the run ended. The mid-run
    # kill is tried again then, up to four times in all.)
    rep = None
    for attempt in range(4):
        pool = root / f"external-{tier}-{attempt}"
        got = _kill_from_outside_under_way(cli, pool, tier, attempt)
        if got is None:
            continue
        rep, c = got, got["committed_step"]
        assert rep["state_digest"] == ref_at(tier, c)
        if c < N_EXT:
            break
    assert rep is not None, "every run ended before its kill"
    assert 2 <= c < N_EXT, rep
    assert rep["state_digest"] == ref_at(tier, c)
    assert all(s > c for s in rep["rolled_back_steps"])
    check_clean_journal(pool, c)

    res = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N_EXT])  # the same command again
    assert f"step {c} -> {N_EXT}" in res.stdout, res.stdout
    assert digest_of(res) == ref_at("pmem", N_EXT)


# --------------------------------------------------------------------------- 3. recovery is crash-safe


def _multi_step_crash(cli, pool: Path, tier: str) -> None:
    """Kill at step 7 with --window 4: steps 5, 6, 7 after the commit of step 4. (On the
    journaled tiers at step 8's commit, once steps 5-8's records are synced and before their END:
    what a power loss keeps. The records of steps 5-7 alone are never synced, and the emulated
    power loss of those tiers takes them back: nothing would be left to roll back.)"""
    at = "7:after-update" if tier == "shm" else "8:before-commit"
    r = cli.run(["train", "--pool", pool, *flags(tier, "--window", 4), "--steps", N,
                 "--crash-at", at])
    assert killed(r), r.stderr[-3000:]


@pytest.fixture(scope="module")
def multi_step_crash(cli, root):
    """Per journaled tier: a pool killed at step 7 with --window 4 (several steps after the
    commit), and the report of a clean recovery of a copy of it, which stops at the window's start
    (--no-replay: what is tested here is the rollback; the replay: tests/test_windows.py). (An shm pool cannot be copied:
    its region is named after the pool. The shm cases crash two pools the same way instead.)"""
    out = {}
    for tier in TIERS:
        pool = root / f"multi-{tier}"
        _multi_step_crash(cli, pool, tier)
        clean = copy_pool(pool, root / f"multi-{tier}-clean")
        out[tier] = (pool, as_json(cli.run(["recover", "--pool", clean, "--json", "--no-replay"])))
        assert out[tier][1]["committed_step"] == 4 and out[tier][1]["rolled_back_steps"], \
            (tier, out[tier][1], journal_layout(pool))
    return out


@pytest.mark.parametrize("tier,rphase", [("shm", "mid-rollback"), ("shm", "before-invalidate"),
                                         ("pmem", "before-invalidate"), ("power-sim", "before-invalidate")])
def test_crash_during_recovery_then_recover_again_equals_a_clean_recovery(cli, root, ref, multi_step_crash,
                                                                          tier, rphase):
    """(mid-rollback kills after the first undo record is applied: only the direct tier applies
    any; on the journaled tiers recovery restores no rows, and drops the records at the end.)"""
    if tier == "shm":
        clean_pool = root / f"rcrash-{tier}-{rphase}-clean"
        _multi_step_crash(cli, clean_pool, tier)
        clean = as_json(cli.run(["recover", "--pool", clean_pool, "--json", "--no-replay"]))
        assert clean["committed_step"] == 4 and clean["rolled_back_steps"] == [7, 6, 5], clean
        assert clean["rows_restored"] > 0
        pool = root / f"rcrash-{tier}-{rphase}"
        _multi_step_crash(cli, pool, tier)
    else:
        src, clean = multi_step_crash[tier]
        pool = copy_pool(src, root / f"rcrash-{tier}-{rphase}")
    r = cli.run(["recover", "--pool", pool, "--crash-at", rphase, "--no-replay"])
    assert killed(r), (r.returncode, r.stderr)
    assert "crash injection: SIGKILL at recovery" in r.stderr
    status = as_json(cli.run(["inspect", "--pool", pool, "--json", "--no-digest"]))["checkpoint"]
    # (the steps committed after the window's start are in the journal still: rolled back again
    # by the second recovery, as the clean one did)
    # (direct tiers: those steps' undo records are rolled back; journaled: they have none)
    assert set(status["steps_to_roll_back"]) <= set(clean["rolled_back_steps"]) \
        <= set(status["steps_to_roll_back"]) | set(status["replay_steps"])
    if tier == "shm":
        assert status["needs_recovery"]

    again = as_json(cli.run(["recover", "--pool", pool, "--json", "--no-replay"]))
    assert again["committed_step"] == clean["committed_step"]
    assert again["rolled_back_steps"] == clean["rolled_back_steps"]
    assert again["rows_restored"] == clean["rows_restored"]
    assert again["state_digest"] == clean["state_digest"] == R(ref, tier, clean["committed_step"])
    check_clean_journal(pool, clean["committed_step"])

    # idempotent: a second recovery finds nothing to do and changes nothing
    before = pool_files(pool)
    twice = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert twice["needed"] is False and twice["rolled_back_steps"] == [] and twice["rows_restored"] == 0
    assert twice["committed_step"] == clean["committed_step"] and twice["state_digest"] == clean["state_digest"]
    assert pool_files(pool) == before


# --------------------------------------------------------------------------- 4. damage


def crashed_mid_update(cli, pool: Path, tier: str = "shm") -> Path:
    """A pool killed in the middle of step K's in-place update. On shm the journal's tail holds
    step K's undo records (which recovery must apply: some of its rows have changed)."""
    r = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N, "--crash-at", f"{K}:mid-update"])
    assert killed(r), r.stderr[-3000:]
    return pool


def damage(pool: Path, kind: str) -> str:
    """Damage ``pool``'s journal one way; returns what the error message must name."""
    j = read_journal(pool)
    commits = [t for t in j.txns if is_commit(t)]
    newest, older = commits[-1], commits[-2]
    undo = [r for r in j.tail if r.type == RecordType.UNDO]
    assert len(undo) >= 2 and newest.tag == K - 1, "the crash left no unfinished step with undo records"
    if kind == "undo-payload-bit-flip":        # an undo record of the unfinished step, valid ones after it
        _flip_payload(undo[0])
        return f"record {undo[0].seq}"
    if kind == "undo-header-bit-flip":         # its header (the seq field), valid records after it
        flip(undo[0].segment, undo[0].offset + 9, 0x01)
        return f"at byte {undo[0].offset}"
    if kind == "dense-bit-flip":               # the dense state of the newest commit
        (d,) = [r for r in newest.records if r.type == RecordType.DENSE]
        _flip_payload(d)
        return f"dense state of step {newest.tag}"
    if kind == "dense-cut-out":                # ... removed from the journal
        (d,) = [r for r in newest.records if r.type == RecordType.DENSE]
        cut(d.segment, d.offset, d.payload_offset + d.length)
        return f"at byte {d.offset}"
    if kind == "end-header-bit-flip":          # a commit record that is not the newest
        flip(older.end.segment, older.end.offset + 17, 0x01)
        return f"at byte {older.end.offset}"
    if kind == "end-payload-bit-flip":         # its commit document
        _flip_payload(older.end)
        return f"at byte {older.end.offset}"
    if kind == "newest-end-cut-out":           # the newest commit record removed: a hole before undo records
        cut(newest.end.segment, newest.end.offset, newest.end.payload_offset + newest.end.length)
        return f"at byte {newest.end.offset}"
    if kind == "segment-header-bit-flip":
        flip(newest.end.segment, 12, 0x01)
        return newest.end.segment.name
    raise AssertionError(kind)


def _flip_payload(ref) -> None:
    flip(ref.segment, ref.payload_offset + ref.length // 2)


DAMAGE = ["undo-payload-bit-flip", "undo-header-bit-flip", "dense-bit-flip", "dense-cut-out",
          "end-header-bit-flip", "end-payload-bit-flip", "newest-end-cut-out", "segment-header-bit-flip"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_damage_is_detected_with_a_clear_error_and_changes_nothing(cli, root, kind):
    pool = crashed_mid_update(cli, root / f"damage-{kind}")
    name = damage(pool, kind)
    before = pool_files(pool)

    r = cli.run(["recover", "--pool", pool, "--json"])
    assert r.returncode == 4, (r.returncode, r.stdout, r.stderr)
    assert "error" in r.stderr and name in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert pool_files(pool) == before

    dry = cli.run(["recover", "--pool", pool, "--dry-run"])
    assert dry.returncode == 4 and name in dry.stderr, (dry.returncode, dry.stderr)

    with pytest.raises(PoolCorruptError) as e:
        checkpointing.recover(pool)
    assert name in str(e.value) and e.value.exit_code == 4
    assert pool_files(pool) == before

    # and the trainer refuses too (instead of training on top of the damage)
    t = cli.run(["train", "--pool", pool, *flags("shm"), "--steps", N])
    assert t.returncode == 4, (t.returncode, t.stderr[-3000:])
    assert name in t.stderr and "Traceback" not in t.stderr, t.stderr
    assert pool_files(pool) == before


@pytest.mark.parametrize("tier,phase,how", [("shm", "mid-log", "truncated"), ("pmem", "mid-dense", "truncated"),
                                            ("power-sim", "before-commit", "truncated"),
                                            ("power-sim", "before-commit", "bit-flip")])
def test_damage_only_in_the_unfinished_tail_is_a_torn_tail(cli, root, ref, tier, phase, how):
    """A crash tears the unfinished transaction's records in any order: its end cut off (any
    tier), or a bad record with valid ones after it (journaled tiers: none of it was ever
    needed). Recovery succeeds at the newest commit and training resumes bit-exact. (shm at
    mid-log: step K's rows have not changed yet, so a lost undo record loses nothing.)"""
    pool = root / f"torn-{tier}-{phase}-{how}"
    r = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N, "--crash-at", f"{K}:{phase}"])
    assert killed(r), r.stderr[-3000:]
    j = read_journal(pool)
    assert j.last.tag == K - 1 and len(j.tail) >= (2 if how == "bit-flip" else 1) and {r.tag for r in j.tail} == {K}
    if how == "truncated":  # inside the last record of the unfinished transaction
        last = j.tail[-1]
        os.truncate(last.segment, last.payload_offset + last.length // 2)
    else:
        first = j.tail[0]
        flip(first.segment, first.payload_offset + first.length // 2)

    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert rep["committed_step"] == K - 1 and rep["state_digest"] == R(ref, tier, K - 1), rep
    assert set(rep["rolled_back_steps"]) <= {K}
    check_clean_journal(pool, K - 1)
    res = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N])
    assert f"step {K - 1} -> {N}" in res.stdout, res.stdout
    assert digest_of(res) == R(ref, tier, N)


def test_damage_to_records_recovery_never_reads_is_harmless(cli, root, ref):
    """shm: undo records of committed steps are never applied again: damage there changes no
    outcome."""
    pool = root / "damage-committed-undo"
    assert digest_of(cli.run(["train", "--pool", pool, *flags("shm"), "--steps", N])) == R(ref, "shm", N)
    j = read_journal(pool)
    old = [r for t in j.txns if is_commit(t) and 0 < t.tag < N for r in t.records if r.type == RecordType.UNDO]
    assert old
    _flip_payload(old[0])
    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert rep["committed_step"] == N and not rep["needed"] and rep["state_digest"] == R(ref, "shm", N)


def test_damage_to_committed_rows_of_a_journaled_tier_is_refused(cli, root, ref):
    """pmem: the rows of committed steps exist durably only in the journal until compaction:
    they are replayed at every open, so a bad one is refused (exit 4), nothing changed."""
    pool = copy_pool(root / "ref-fresh", root / "damage-committed-rows")  # N steps, cleanly finished
    j = read_journal(pool)
    rows = [r for t in j.txns if is_commit(t) for r in t.records if r.type == RecordType.ROWS]
    assert rows
    victim = rows[len(rows) // 2]
    _flip_payload(victim)
    before = pool_files(pool)
    for argv in (["recover", "--pool", pool], ["inspect", "--pool", pool],
                 ["train", "--pool", pool, *flags("pmem"), "--steps", N + 2]):
        r = cli.run(argv)
        assert r.returncode == 4, (argv, r.returncode, r.stderr[-2000:])
        assert f"record {victim.seq}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert pool_files(pool) == before


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


def test_train_on_a_crashed_shm_pool_recovers_first_and_says_so(cli, root, ref):
    pool = root / "train-recovers-shm"
    r = cli.run(["train", "--pool", pool, *flags("shm"), "--steps", N, "--crash-at", f"{K}:after-update"])
    assert killed(r)
    status = as_json(cli.run(["inspect", "--pool", pool, "--json"]))["checkpoint"]
    assert status["needs_recovery"] and status["steps_to_roll_back"] == [K]
    c = status["committed_step"]

    res = cli.run(["train", "--pool", pool, *flags("shm"), "--steps", N])
    log = res.stdout
    assert "needs recovery" in log and "recovering" in log and f"recovered to step {c}" in log, log
    assert f"step {c} -> {N}" in log
    assert digest_of(res) == R(ref, "shm", N)


@pytest.mark.parametrize("tier", TIERS)
def test_train_on_a_crashed_journaled_pool_drops_the_unfinished_step_and_resumes(cli, root, ref, tier):
    """Killed inside step K's commit: the journal ends with step K's records and no END. The
    next train resumes at K-1 (reporting what it rolled back, if it had to recover: 0 rows), and
    step K's records never end up inside a later transaction."""
    pool = root / f"train-recovers-{tier}"
    r = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N, "--crash-at", f"{K}:mid-dense"])
    assert killed(r)
    status = as_json(cli.run(["inspect", "--pool", pool, "--json"]))["checkpoint"]
    assert status["committed_step"] == K - 1 and status["steps_to_roll_back"] == [K]

    doc = as_json(cli.run(["train", "--pool", pool, *flags(tier), "--steps", N, "--json"]))
    assert doc["start_step"] == K - 1 and doc["end_step"] == N
    assert doc["state_digest"] == R(ref, tier, N)
    if doc["recovered"] is not None:
        assert doc["recovered"]["committed_step"] == K - 1
        assert doc["recovered"]["rolled_back_steps"] == [K] and doc["recovered"]["rows_restored"] == 0
    check_clean_journal(pool, N)
    # every step from K-1 on was committed once, by the resumed run
    steps = committed_steps(pool)
    assert steps[steps.index(K - 1):] == list(range(K - 1, N + 1)), steps


# --------------------------------------------------------------------------- 8. dry run


@pytest.mark.parametrize("tier,phase", [("shm", "mid-update"), ("power-sim", "before-commit")])
def test_dry_run_changes_nothing_and_reports_what_it_would_roll_back(cli, root, ref, tier, phase):
    pool = root / f"dry-run-{tier}"
    r = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N, "--crash-at", f"{K}:{phase}"])
    assert killed(r), r.stderr[-3000:]
    before = pool_files(pool)
    status = as_json(cli.run(["inspect", "--pool", pool, "--json"]))["checkpoint"]
    assert status["steps_to_roll_back"] == [K]
    if tier == "shm":
        assert status["needs_recovery"]

    dry = as_json(cli.run(["recover", "--pool", pool, "--dry-run", "--json"]))
    assert dry["dry_run"] is True and dry["needed"] is True
    assert dry["rolled_back_steps"] == sorted(status["steps_to_roll_back"], reverse=True)
    if tier == "shm":
        assert dry["rows_restored"] > 0 and dry["state_digest"] is None
    else:
        assert dry["rows_restored"] == 0
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
    assert real["state_digest"] == R(ref, tier, real["committed_step"])
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


def test_pool_killed_before_its_first_commit_gives_a_clear_error(cli, root, ref):
    pool = root / "no-first-commit"
    digest_of(cli.run(["train", "--pool", pool, *flags("pmem"), "--steps", 0]))
    # what a kill between pool creation and the commit of step 0 leaves: step 0's records
    # without their END
    first = next(t for t in read_journal(pool).txns if is_commit(t))
    assert first.tag == 0
    os.truncate(first.end.segment, first.end.offset)
    assert committed_steps(pool) == []
    r = cli.run(["train", "--pool", pool, *flags("pmem"), "--steps", 2])
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "before the first commit" in r.stderr and "--fresh" in r.stderr, r.stderr[-2000:]
    fresh = cli.run(["train", "--pool", pool, *flags("pmem"), "--steps", 2, "--fresh"])
    assert digest_of(fresh) == R(ref, "pmem", 2)
