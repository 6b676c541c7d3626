"""Mapped journal segments (``memory_pool.journal``, "Mapped segments"): on tmpfs (the shm tier)
records are copied into a shared mapping of a segment that was sized up front, instead of
written with ``pwrite``. They must read back exactly as written ones do; the bytes after the
valid records must read as the end of the log; a torn record, damage, and a process killed at
any moment in the middle of copying a record are handled as in a written segment; and a full
file system is a :class:`PoolFullError`, not a SIGBUS."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import flip, journal_writer, kill_writer_and_check_journal
from memory_pool import NeedsRecoveryError
from memory_pool.journal import SEG, SEG_RECYCLED, Journal, JournalCorruptError, RecordType

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def shm_dir():
    d = Path(tempfile.mkdtemp(prefix="dlrm-cxl-test-journal-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def payload(seq: int, n: int = 300) -> bytes:
    return bytes((seq * 31 + k * 7) % 256 for k in range(n))


def write(j: Journal, txns: int, per_txn: int = 3, n: int = 300) -> None:
    for tag in range(txns):
        j.append_many([(RecordType.UNDO, tag, [payload(j.next_seq + i, n)]) for i in range(per_txn)])
        j.append(RecordType.DENSE, tag, [payload(j.next_seq, n // 2), payload(j.next_seq + 1, n // 3)])
        j.end(tag, {"step": tag, "kind": "commit"})


def contents(d: Path) -> list:
    j = Journal(d, read_only=True)
    return [(t.tag, t.doc, [bytes(p) for _, p in j.read_many(t.records)]) for t in j.txns]


def seg_flags(path: Path) -> int:
    return SEG.unpack(path.read_bytes()[:SEG.size])[3]


def test_a_mapped_journal_reads_back_exactly_as_a_written_one(shm_dir):
    for name, mapped in (("written", False), ("mapped", True)):
        j = Journal(shm_dir / name, sync=False, mapped=mapped, segment_bytes=4096)
        write(j, 12)
        j.close()
    assert contents(shm_dir / "mapped") == contents(shm_dir / "written") != []
    back = Journal(shm_dir / "mapped")
    assert back.tail == [] and back.torn_bytes == 0 and back.tail_damage is None
    segs = sorted((shm_dir / "mapped").glob("seg-*.log"))
    assert len(segs) > 1, "the test needs several segments"
    # Sized up front (flagged: what follows the records is not the log's), unlike a written one.
    assert all(seg_flags(p) & SEG_RECYCLED and p.stat().st_size > 4096 for p in segs)
    assert not any(seg_flags(p) & SEG_RECYCLED for p in (shm_dir / "written").glob("seg-*.log"))
    # ... and a reopened mapped journal appends after its records, not at the end of the file.
    back.close()
    j = Journal(shm_dir / "mapped", sync=False, mapped=True, segment_bytes=4096)
    write(j, 1)
    j.close()
    assert [t[0] for t in contents(shm_dir / "mapped")] == list(range(12)) + [0]


def test_a_record_larger_than_the_segment_grows_the_mapping(shm_dir):
    j = Journal(shm_dir, sync=False, mapped=True, segment_bytes=4096)
    big = os.urandom(3 << 20)
    j.append(RecordType.DENSE, 1, [big[:1000], big[1000:]])
    j.end(1, {})
    j.append(RecordType.DENSE, 2, [big[:5000]])
    j.end(2, {})
    j.close()
    got = contents(shm_dir)
    assert got == [(1, {}, [big]), (2, {}, [big[:5000]])]


def test_a_torn_record_in_a_mapped_segment_is_a_torn_tail_and_appends_go_on_after_recovery(shm_dir):
    j = Journal(shm_dir, sync=False, mapped=True)
    write(j, 3)
    refs = j.append_many([(RecordType.UNDO, 3, [payload(k)]) for k in range(3)])
    j.close()
    flip(refs[-1].segment, refs[-1].payload_offset + 7)
    back = Journal(shm_dir, mapped=True, sync=False)
    assert [r.seq for r in back.tail] == [r.seq for r in refs[:-1]] and back.tail_damage is None
    with pytest.raises(NeedsRecoveryError):
        back.append(RecordType.UNDO, 4, [b"x"])
    back.truncate_tail()
    write(back, 1)
    back.close()
    assert [t[0] for t in contents(shm_dir)] == [0, 1, 2, 0]


def test_damage_before_the_newest_end_of_a_mapped_segment_is_refused(shm_dir):
    j = Journal(shm_dir, sync=False, mapped=True)
    write(j, 3)
    rec = j.txns[1].records[0]
    j.close()
    flip(rec.segment, rec.offset + 9)  # its header's sequence number
    with pytest.raises(JournalCorruptError, match="before a durable transaction end"):
        Journal(shm_dir, read_only=True)


KILLER = journal_writer("sync=False, mapped=True, segment_bytes=1 << 20", (1 << 20, 300000, 700000))


@pytest.mark.parametrize("trial", range(4))
def test_a_process_killed_while_copying_records_leaves_its_commits_and_a_clean_or_torn_tail(shm_dir, trial):
    kill_writer_and_check_journal(KILLER, shm_dir, 0.05 + 0.11 * trial, [1 << 20, 300000, 700000],
                                  sync=False, mapped=True, segment_bytes=1 << 20)


def test_a_full_file_system_is_pool_full_not_a_crash(shm_dir, run_py):
    proc = run_py("""
        import json, resource, signal, sys
        from pathlib import Path
        from memory_pool import PoolFullError
        from memory_pool.journal import MAP_SLACK, Journal, RecordType
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG, as on a full tmpfs
        out = []
        d = Path(sys.argv[1])
        j = Journal(d / "new", sync=False, mapped=True, segment_bytes=4 << 20)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        try:
            j.append(RecordType.UNDO, 0, [b"x" * 100])     # the segment is sized up front: 4 MiB
        except PoolFullError as e:
            out.append(str(e))
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        j = Journal(d / "grow", sync=False, mapped=True, segment_bytes=4096)
        j.append(RecordType.UNDO, 0, [b"x" * 100])
        j.end(0, {})
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        try:
            j.append(RecordType.DENSE, 1, [b"y" * (MAP_SLACK + (2 << 20))])  # past the segment's size: grows
        except PoolFullError as e:
            out.append(str(e))
        print(json.dumps(out))
    """, shm_dir)
    msgs = json.loads(proc.stdout)
    assert len(msgs) == 2, msgs
    assert "creating journal segment" in msgs[0] and "File too large" in msgs[0]
    assert "growing journal segment" in msgs[1]
    # nothing committed is lost: the second journal still holds its transaction
    assert [t[0] for t in contents(shm_dir / "grow")] == [0]


APPENDER = """
import sys, time
from pathlib import Path
from memory_pool.journal import Journal, RecordType
j = Journal(Path(sys.argv[1]), sync=False, mapped=True, segment_bytes=256 << 10)
big = bytes(range(256)) * 256
tag = 0
while True:
    j.append_many([(RecordType.UNDO, tag, [big]), (RecordType.ROWS, tag, [big[:30001]])])
    j.end(tag, {"step": tag})
    if tag % 40 == 39:  # segments dropped and recycled while readers look
        j.rotate()
        j.reclaim(j.txns[-1].first_seq)
    if tag == 0:
        print("committed", flush=True)
    tag += 1
    time.sleep(0.001)  # a step a millisecond (a trainer's is ~100): the journal always in motion
"""


def test_a_reader_beside_a_live_writer_never_mistakes_an_append_in_progress_for_damage(shm_dir):
    # `inspect --no-digest` opens a pool's journal read-only while a trainer appends to it. A
    # scan that meets a record whose header is not written yet, and then finds later records
    # (and an END) that were written meanwhile, or a START that moved while segments were being
    # listed, has seen a journal in motion, not damage: it looks again.
    proc = subprocess.Popen([sys.executable, "-c", APPENDER, str(shm_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "committed"
        seen = []
        deadline = time.time() + 4
        while time.time() < deadline:
            j = Journal(shm_dir, read_only=True)
            seen.append(j.last.tag if j.last else -1)
        assert len(seen) > 20 and seen[-1] > seen[0], "the writer was appending all along"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_the_chunk_a_mapped_segment_prepares_is_faulted_in_before_the_appends_store_into_it(shm_dir):
    import re
    import resource

    if tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2]) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    j = Journal(shm_dir, sync=False, mapped=True)
    rec = bytes(range(256)) * 4096  # 1 MiB
    j.append(RecordType.UNDO, 0, [rec])  # prepares the segment's first chunk (8 MiB)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(4):  # 4 MiB more, inside that chunk
        j.append(RecordType.UNDO, 0, [rec])
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    j.end(0, {"step": 0, "kind": "commit"})
    j.close()
    # (1,024 pages stored to: one fault each, had they not been faulted in with one call)
    assert faults < 100, faults
    assert [t.tag for t in Journal(shm_dir, read_only=True).txns] == [0]
