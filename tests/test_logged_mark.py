"""The per-step logged mark (issue 25, defect 12): a damaged undo record after a crash.

On a direct tier (shm, real pmem) a step's rows change in place, so its before-images (``UNDO``
records) must be durable first. The checkpointer then makes a ``LOGGED`` mark durable, and only
after it does any row change (TrainingCXL's persistent flag). Recovery reads the unfinished tail
with it:

* a bad record *before a valid mark* was durable when the step's rows began to change: it is
  **damage**. ``recover`` exits 4 and changes nothing (before the fix it dropped the record as a
  torn tail, restored half the rows and said "consistent");
* a bad record of a step whose mark never became durable belongs to a step that changed no
  row: dropping the tail is right, and the pool recovers bit-exactly to the previous step.

The CLI tests are real: ``dlrm-cxl`` processes (forked from one warm interpreter, see
``tools/torture.py``) killed by a real SIGKILL through ``--crash-at``, a real byte flipped in the
real journal segment (in the shm region), then ``recover``.
"""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

import pytest
import torch

from helpers import flip, tool
from memory_pool import MemoryPool
from memory_pool.journal import REC, Journal, RecordType, encode_row_set

torture = tool("torture")

N = 8      # steps of every run
K = 5      # the step --crash-at kills
LOGGED = getattr(RecordType, "LOGGED", 5)


def flags(tier: str) -> list[str]:
    tier, writer = ("shm", ["--writer", "inline"]) if tier == "shm-inline" else (tier, [])
    return ["--preset", "tiny", "--tier", tier, *writer, "--threads", "1", "--no-progress", "--window", "1"]


def killed(proc) -> bool:
    return proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)


def as_json(proc, rc: int = 0) -> dict:
    assert proc.returncode == rc, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout)


def digest_of(proc) -> str:
    d = torture.parse_digest(proc.stdout)
    assert proc.returncode == 0 and d, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return d


def storage_dir(pool: Path) -> Path:
    header = json.loads((pool / "pool.json").read_text())
    return Path(header["storage_dir"]) if header["tier"] == "shm" else pool


def journal(pool: Path) -> Journal:
    return Journal(storage_dir(pool) / "journal", read_only=True)


def pool_hash(pool: Path) -> dict[str, str]:
    """sha256 of every file of the pool directory and of its shm region (all but the content of
    LOCK, which names the last process that took it)."""
    out = {}
    for base in dict.fromkeys([pool, storage_dir(pool)]):
        for p in sorted(base.rglob("*")):
            if p.is_file():
                out[f"{base}/{p.relative_to(base)}"] = "" if p.name == "LOCK" else \
                    hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def crash(cli, pool: Path, tier: str, phase: str) -> None:
    r = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N, "--crash-at", f"{K}:{phase}"])
    assert killed(r), (r.returncode, r.stderr[-3000:])
    assert f"SIGKILL at step {K} {phase}" in r.stderr


def tail_of_step_k(pool: Path):
    """(undo records, logged mark) of step K in the journal's unfinished tail, which must hold
    exactly them (the crash came after step K-1's commit and before step K's commit began)."""
    j = journal(pool)
    assert j.last.tag == K - 1 and j.tail_damage is None and j.torn_bytes == 0
    assert {r.tag for r in j.tail} == {K}
    undo = [r for r in j.tail if r.type == RecordType.UNDO]
    marks = [r for r in j.tail if r.type == LOGGED]
    assert len(undo) >= 2, "tiny writes two undo records a step (rows and their Adagrad state)"
    assert len(marks) == 1 and j.tail[-1] == marks[0], \
        f"the step's logged mark must follow its undo records: {[(r.type, r.seq) for r in j.tail]}"
    assert [r.seq for r in undo] == list(range(undo[0].seq, marks[0].seq))
    return undo, marks[0]


@pytest.fixture(scope="module")
def ref(cli, root) -> dict[int, str]:
    """The digests of uninterrupted shm runs to step K-1 and to step N."""
    return {k: digest_of(cli.run(["train", "--pool", root / f"ref-{k}", *flags("shm"), "--steps", k]))
            for k in (K - 1, N)}


# --------------------------------------------------------------------------- after the mark


@pytest.mark.parametrize("tier", ["shm", "shm-inline"])
def test_the_same_crash_undamaged_recovers_bit_exact(cli, root, ref, tier):
    """The control for the damage tests: a crash mid-update, nothing damaged, recovers every
    row of step K to step K-1, bit-exact, and resumes bit-exact."""
    pool = root / f"clean-{tier}"
    crash(cli, pool, tier, "mid-update")
    undo, mark = tail_of_step_k(pool)
    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert rep["committed_step"] == K - 1 and rep["rolled_back_steps"] == [K]
    assert rep["state_digest"] == ref[K - 1], rep
    assert rep["rows_restored"] > 0
    res = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N])
    assert f"step {K - 1} -> {N}" in res.stdout and digest_of(res) == ref[N]


@pytest.mark.parametrize("where", ["last-undo-payload", "last-undo-header", "first-undo-payload"])
@pytest.mark.parametrize("tier", ["shm", "shm-inline"])
def test_a_bad_undo_record_before_a_durable_logged_mark_is_damage_and_changes_nothing(cli, root, ref, tier,
                                                                                        where):
    """The issue's repro: killed mid-update (step K's rows have begun to change), one byte of
    the last UNDO record flipped. Before the fix ``recover`` exited 0, "consistent at step
    K-1", with only the first record's rows restored."""
    pool = root / f"after-mark-{tier}-{where}"
    crash(cli, pool, tier, "mid-update")
    undo, mark = tail_of_step_k(pool)
    victim = undo[0] if where.startswith("first") else undo[-1]
    if where.endswith("payload"):
        flip(victim.segment, victim.payload_offset + victim.length // 2)
    else:  # its sequence number: the header fails its checksum
        flip(victim.segment, victim.offset + 9, 0x01)
    before = pool_hash(pool)

    r = cli.run(["recover", "--pool", pool, "--json"])
    assert r.returncode == 4, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "error" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "damaged" in r.stderr and "logged mark" in r.stderr, r.stderr
    assert pool_hash(pool) == before, "a refused recovery changes nothing"

    dry = cli.run(["recover", "--pool", pool, "--dry-run"])
    assert dry.returncode == 4, (dry.returncode, dry.stderr[-2000:])
    status = as_json(cli.run(["inspect", "--pool", pool, "--json", "--no-digest"]))["checkpoint"]
    assert status["damaged"] and status["needs_recovery"], status
    # the trainer refuses too, instead of training on top of a half-restored step
    t = cli.run(["train", "--pool", pool, *flags(tier), "--steps", N])
    assert t.returncode == 4 and "Traceback" not in t.stderr, (t.returncode, t.stderr[-3000:])
    assert pool_hash(pool) == before


# --------------------------------------------------------------------------- before the mark


def _unwrite(ref) -> None:
    """Zero a record's bytes: what the shm journal's mapping holds past the records stored so
    far (a crash just before this record was stored)."""
    with open(ref.segment, "r+b") as f:
        f.seek(ref.offset)
        f.write(bytes(REC.size + ref.length))


@pytest.mark.parametrize("how", ["first-undo-flipped", "last-undo-flipped", "mark-never-written"])
def test_damage_before_the_logged_mark_is_a_torn_tail_and_recovers_bit_exact(cli, root, ref, how):
    """Killed at after-log (step K's before-images durable, no row changed yet), with the mark
    taken away: the state of a crash between the records' barrier and the mark's store. Then
    one of the step's records is damaged. The step never changed a row, so recovery drops its
    records and the pool is exactly step K-1. (first-undo-flipped: a bad record with a valid
    one after it, which the old rule refused as damage.)"""
    pool = root / f"before-mark-{how}"
    crash(cli, pool, "shm", "after-log")
    undo, mark = tail_of_step_k(pool)
    _unwrite(mark)
    if how == "first-undo-flipped":
        flip(undo[0].segment, undo[0].payload_offset + undo[0].length // 2)
    elif how == "last-undo-flipped":
        flip(undo[-1].segment, undo[-1].payload_offset + undo[-1].length // 2)

    status = as_json(cli.run(["inspect", "--pool", pool, "--json", "--no-digest"]))["checkpoint"]
    assert status["damaged"] == [] and status["steps_to_roll_back"] == [K], status
    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert rep["committed_step"] == K - 1 and rep["rolled_back_steps"] == [K], rep
    assert rep["state_digest"] == ref[K - 1], rep
    j = journal(pool)
    assert j.last.tag == K - 1 and j.tail == [] and j.torn_bytes == 0 and j.tail_damage is None
    if how == "first-undo-flipped":
        res = cli.run(["train", "--pool", pool, *flags("shm"), "--steps", N])
        assert f"step {K - 1} -> {N}" in res.stdout and digest_of(res) == ref[N]


def test_a_crash_mid_log_with_its_record_damaged_recovers_bit_exact(cli, root, ref):
    """Killed mid-log (half of step K's undo records written, no mark), its record damaged."""
    pool = root / "mid-log"
    crash(cli, pool, "shm", "mid-log")
    j = journal(pool)
    assert j.last.tag == K - 1 and j.tail and all(r.type == RecordType.UNDO for r in j.tail)
    flip(j.tail[-1].segment, j.tail[-1].payload_offset + j.tail[-1].length // 2)
    rep = as_json(cli.run(["recover", "--pool", pool, "--json"]))
    assert rep["committed_step"] == K - 1 and rep["state_digest"] == ref[K - 1], rep


# --------------------------------------------------------------------------- the rules, in a journal


def _undo(tag: int, group: int | None, n: int = 3) -> list:
    from memory_pool.records import encode_row_set as enc
    ids = torch.arange(n)
    rows = torch.full((n, 4), float(tag))
    return enc([("t", ids)], rows, undo_group=group) if group is not None else enc([("t", ids)], rows)


def _write(d: Path, tail: list) -> list:
    """A journal with a commit of step 1 and then ``tail``: ``[(type, tag, parts)]``."""
    j = Journal(d, sync=False)
    j.append(RecordType.UNDO, 1, _undo(1, None))
    j.end(1, {"kind": "commit", "step": 1})
    refs = j.append_many(tail)
    j.close()
    return refs


def _verdict(d: Path):
    from checkpointing.recovery import tail_damage
    return tail_damage(Journal(d, read_only=True))


def _bad(ref) -> None:
    flip(ref.segment, ref.payload_offset + ref.length - 1)


def test_the_rules_for_a_bad_record_in_the_unfinished_tail(tmp_path):
    from memory_pool.records import encode_logged_mark

    def case(name, tail, bad):
        d = tmp_path / name
        refs = _write(d, tail)
        for i in bad:
            _bad(refs[i])
        return _verdict(d)

    g = 2  # the tail's first sequence number: the commit before it is UNDO (0), END (1)
    mark = (LOGGED, 2, encode_logged_mark(g, 2))
    u = [(RecordType.UNDO, 2, _undo(2, g)), (RecordType.UNDO, 2, _undo(2, g))]
    assert case("clean", u + [mark], []) is None
    # after the mark: damage, wherever the bad record is
    assert "logged mark" in case("last-before-mark", u + [mark], [1])
    assert "logged mark" in case("first-before-mark", u + [mark], [0])
    # the mark itself bad, nothing after it: torn (every undo record it vouched for is whole
    # and is applied; if the step never changed a row, they restore what is there)
    assert case("mark-bad", u + [mark], [2]) is None
    # no mark: the step changed no row, whatever of its records is bad
    assert case("no-mark-last", u, [1]) is None
    assert case("no-mark-first", u, [0]) is None
    # a writer without marks (records without an undo group): the old rule, a bad record with
    # a valid record after it is damage
    old = [(RecordType.UNDO, 2, _undo(2, None)), (RecordType.UNDO, 2, _undo(2, None))]
    assert case("old-last", old, [1]) is None
    assert case("old-first", old, [0]) is not None
    # records of another undo group after the bad one: that group began after the bad record's
    # step had changed its rows (a step's records are written after the previous step's update)
    later = [(RecordType.UNDO, 3, _undo(3, g + 3))]
    assert case("later-group", u + [mark] + later, [0]) is not None
    # a mark that vouches for records the journal does not hold
    assert "vouches" in case("short-mark", u[:1] + [(LOGGED, 2, encode_logged_mark(g, 2))], [])


def test_undo_records_with_a_group_read_the_same_for_a_reader_that_does_not_know_groups():
    from memory_pool.records import decode_logged_mark, decode_row_set, encode_logged_mark, undo_group_of
    ids = torch.tensor([5, 1, 9])
    rows = torch.randn(3, 8)
    for tables in ([("emb", ids)], [("a", ids[:1]), ("bb", ids[1:])]):
        plain = bytearray(b"".join(bytes(p) for p in encode_row_set(tables, rows)))
        grouped = bytearray(b"".join(bytes(p) for p in encode_row_set(tables, rows, undo_group=1234)))
        assert undo_group_of(plain) is None and undo_group_of(grouped) == 1234
        for (n0, i0, r0), (n1, i1, r1) in zip(decode_row_set(plain), decode_row_set(grouped)):
            assert n0 == n1 and torch.equal(i0, i1) and torch.equal(r0, r1)
        # what a reader that predates groups does: the ids at the header's offset, names before
        import struct
        ids_at = struct.unpack_from("<4sIIIQ", grouped)[3]
        assert torch.equal(torch.frombuffer(bytearray(grouped[ids_at:ids_at + 24]), dtype=torch.int64), ids)
    assert undo_group_of(bytes(encode_row_set([("e", ids[:0])], rows[:0], undo_group=7)[0])) == 7
    assert decode_logged_mark(b"".join(encode_logged_mark(99, 2))) == (99, 2)
    with pytest.raises(ValueError):
        decode_logged_mark(b"LOGD" + bytes(3))


class _Spy:
    """The pool's journal, recording what the writer thread does in which order."""

    def __init__(self, j, sync: bool):
        self._j, self.sync, self.events = j, sync, []

    def __getattr__(self, name):
        return getattr(self._j, name)

    def append_many(self, recs):
        self.events.append(("append", [RecordType(r[0]).name for r in recs]))
        return self._j.append_many(recs)

    def append(self, rtype, tag, parts):
        return self.append_many([(rtype, tag, parts)])[0]

    def flush(self):
        self.events.append(("flush",))
        self._j.flush()


@pytest.mark.parametrize("sync", [False, True])
def test_the_mark_follows_the_records_barrier_and_is_durable_before_persist_returns(tmp_pool_dir, sync):
    """Where a store is durable as it is made (a mapped journal, no sync: shm), the mark is the
    last record of the undo records' own write: no extra system call. Where durability is a sync
    (real pmem), the mark is written after the records' sync and synced itself, before the
    barrier lets any row change."""
    from checkpointing import UndoLogCheckpointer
    pool = MemoryPool.create(tmp_pool_dir, tier="shm")
    try:
        t = pool.create_table("t", 64, 4, init="uniform", seed=3)
        s = pool.create_table("t.adagrad", 64, 1, init="zeros")
        ck = UndoLogCheckpointer(pool, lambda k: {"step": k})
        ck.checkpoint_now(0)
        real = pool.journal
        spy = ck.journal = pool.journal = _Spy(real, sync)   # (the step's Transaction writes through the pool's)
        ck.begin_step(1)
        ck.log_before_image([(t, torch.tensor([1, 2])), (s, torch.tensor([1, 2]))])
        ck.persist()
        events = list(spy.events)
        ck.update(lambda: t.write(torch.tensor([1]), torch.zeros(1, 4)))
        ck.commit(1)
        ck.close()
        pool.journal = real
        if sync:
            assert events == [("append", ["UNDO", "UNDO"]), ("flush",), ("append", ["LOGGED"]), ("flush",)], events
        else:
            assert events[0] == ("append", ["UNDO", "UNDO", "LOGGED"]), events
    finally:
        pool.close()
