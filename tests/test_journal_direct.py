"""Direct journal writes (``memory_pool.journal``, "Direct writes"): on a disk (the emulated pmem
and power-sim tiers) records are built in an aligned buffer and written with O_DIRECT, whole
blocks at a time: the last partial block is written again with each append, and the bytes after
the records up to the block's end are zeros. They must read back exactly as buffered writes do,
reopened journals must append after their records (not after the padding), segments written
without direct writes must stay valid, and torn records, damage, a process killed mid-write and
a full file system are handled as everywhere else."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

from helpers import flip, journal_writer, kill_writer_and_check_journal
from memory_pool import NeedsRecoveryError
from memory_pool.journal import BLOCK, SEG, SEG_RECYCLED, Journal, JournalCorruptError, RecordType



def payload(seq: int, n: int = 300) -> bytes:
    return bytes((seq * 31 + k * 7) % 256 for k in range(n))


def write(j: Journal, txns: int, per_txn: int = 3, n: int = 300) -> None:
    for tag in range(txns):
        j.append_many([(RecordType.UNDO, tag, [payload(j.next_seq + i, n + 997 * i)]) for i in range(per_txn)])
        j.append(RecordType.DENSE, tag, [payload(j.next_seq, n // 2), payload(j.next_seq + 1, 5000)])
        j.end(tag, {"step": tag, "kind": "commit"})


def contents(d: Path) -> list:
    j = Journal(d, read_only=True)
    return [(t.tag, t.doc, [bytes(p) for _, p in j.read_many(t.records)]) for t in j.txns]


def seg_flags(path: Path) -> int:
    return SEG.unpack(path.read_bytes()[:SEG.size])[3]


@pytest.fixture
def direct_dir(tmp_path):
    """A directory on a file system that takes O_DIRECT (the test's subject)."""
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        pytest.skip("the temporary directory's file system does not take O_DIRECT")
    finally:
        os.close(fd)
        probe.unlink()
    return tmp_path


def test_a_direct_journal_reads_back_exactly_as_a_buffered_one(direct_dir):
    for name, direct in (("buffered", False), ("direct", True)):
        j = Journal(direct_dir / name, segment_bytes=16384, direct=direct)
        write(j, 12)
        if direct:
            assert j.direct and fcntl.fcntl(j._fd, fcntl.F_GETFL) & os.O_DIRECT, "appends bypass the page cache"
        j.close()
    assert contents(direct_dir / "direct") == contents(direct_dir / "buffered") != []
    segs = sorted((direct_dir / "direct").glob("seg-*.log"))
    assert len(segs) > 1, "the test needs several segments"
    # Whole blocks, padded after the records (flagged: what follows them is not the log's).
    # (a segment started after the last END holds its header alone, not yet written directly)
    assert all(seg_flags(p) & SEG_RECYCLED and p.stat().st_size % BLOCK in (0, SEG.size) for p in segs)
    assert sum(p.stat().st_size % BLOCK == 0 for p in segs) >= len(segs) - 1
    assert not any(seg_flags(p) & SEG_RECYCLED for p in (direct_dir / "buffered").glob("seg-*.log"))
    back = Journal(direct_dir / "direct")
    assert back.tail == [] and back.torn_bytes == 0 and back.tail_damage is None
    back.close()


def test_a_reopened_direct_journal_appends_after_its_records_and_keeps_the_block_it_rewrites(direct_dir):
    j = Journal(direct_dir, direct=True)
    write(j, 2)
    j.close()
    before = contents(direct_dir)
    for extra in range(3):  # each reopen rewrites the last partial block: its records must survive
        j = Journal(direct_dir, direct=True)
        write(j, 1, n=100 + extra)
        j.close()
    got = contents(direct_dir)
    assert got[:2] == before and [t[0] for t in got] == [0, 1, 0, 0, 0]
    seg = sorted(direct_dir.glob("seg-*.log"))[-1]
    j = Journal(direct_dir, read_only=True)
    end = j.last.end.payload_offset + j.last.end.length
    assert seg.stat().st_size == -(-end // BLOCK) * BLOCK > end, "the records end inside the last block"


def test_a_segment_written_without_direct_writes_is_sealed_and_appends_go_to_a_new_one(direct_dir):
    j = Journal(direct_dir)                       # an older writer: no padding allowed after its records
    write(j, 2)
    j.close()
    old = sorted(direct_dir.glob("seg-*.log"))
    size = old[0].stat().st_size
    j = Journal(direct_dir, direct=True)
    write(j, 2)
    j.close()
    assert old[0].stat().st_size == size, "the unflagged segment is not written to"
    assert len(sorted(direct_dir.glob("seg-*.log"))) == 2
    assert [t[0] for t in contents(direct_dir)] == [0, 1, 0, 1]
    again = Journal(direct_dir)
    assert again.tail == [] and again.torn_bytes == 0


def test_a_torn_record_in_a_direct_segment_is_a_torn_tail_and_appends_go_on_after_recovery(direct_dir):
    j = Journal(direct_dir, direct=True)
    write(j, 3)
    refs = j.append_many([(RecordType.UNDO, 3, [payload(k)]) for k in range(3)])
    j.close()
    flip(refs[-1].segment, refs[-1].payload_offset + 7)
    back = Journal(direct_dir, direct=True)
    assert [r.seq for r in back.tail] == [r.seq for r in refs[:-1]] and back.tail_damage is None
    with pytest.raises(NeedsRecoveryError):
        back.append(RecordType.UNDO, 4, [b"x"])
    back.truncate_tail()
    write(back, 1)
    back.close()
    assert [t[0] for t in contents(direct_dir)] == [0, 1, 2, 0]


def test_damage_before_the_newest_end_of_a_direct_segment_is_refused(direct_dir):
    j = Journal(direct_dir, direct=True)
    write(j, 3)
    rec = j.txns[1].records[0]
    j.close()
    flip(rec.segment, rec.payload_offset + 11)
    with pytest.raises(JournalCorruptError, match="fails its checksum"):
        Journal(direct_dir, read_only=True).read(rec)
    flip(rec.segment, rec.payload_offset + 11)
    flip(rec.segment, rec.offset + 9)  # its header's sequence number
    with pytest.raises(JournalCorruptError, match="before a durable transaction end"):
        Journal(direct_dir, read_only=True)


KILLER = journal_writer("direct=True, segment_bytes=4 << 20", (1 << 20, 300001, 700003))


@pytest.mark.parametrize("trial", range(3))
def test_a_process_killed_while_writing_directly_leaves_its_commits_and_a_clean_or_torn_tail(direct_dir, trial):
    kill_writer_and_check_journal(KILLER, direct_dir, 0.1 + 0.17 * trial, [1 << 20, 300001, 700003],
                                  direct=True, segment_bytes=4 << 20)


def test_a_full_file_system_under_direct_writes_is_pool_full_and_keeps_what_was_committed(direct_dir, run_py):
    proc = run_py("""
        import json, resource, signal, sys
        from pathlib import Path
        from memory_pool import PoolFullError
        from memory_pool.journal import Journal, RecordType
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG, as on a full disk
        d = Path(sys.argv[1])
        j = Journal(d, direct=True)
        j.append(RecordType.UNDO, 0, [b"x" * 100])
        j.end(0, {})
        # An unaligned limit: O_DIRECT refuses the write cut short at it (EINVAL); the journal
        # writes the same bytes through the page cache, which then reports the real error.
        resource.setrlimit(resource.RLIMIT_FSIZE, ((1 << 20) + 1000, resource.RLIM_INFINITY))
        try:
            j.append(RecordType.DENSE, 1, [b"y" * (2 << 20)])
            print(json.dumps("no error"))
        except PoolFullError as e:
            print(json.dumps(str(e)))
    """, direct_dir)
    msg = json.loads(proc.stdout)
    assert "appending to journal" in msg and "File too large" in msg, msg
    # nothing committed is lost; the failed append left a torn tail at most
    j = Journal(direct_dir, direct=True)
    assert [t.tag for t in j.txns] == [0] and j.tail_damage is None
    if j.tail or j.torn_bytes:
        j.truncate_tail()
    write(j, 1)
    j.close()
    assert [t[0] for t in contents(direct_dir)] == [0, 0]
