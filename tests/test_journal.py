"""The persistence journal (``memory_pool.journal``) on real files: records and transactions,
segments and their sequence numbers, reclaiming, the torn tail of an unfinished transaction
(ignored, truncated) versus damage before the newest ``END`` (refused, nothing changed), and
the pool's use of it (replay at open, compaction) including a SIGKILL in the middle of both."""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import threading
import time
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch

from helpers import flip
from memory_pool import records
from memory_pool import MemoryPool, NeedsRecoveryError, PoolCorruptError
from memory_pool.journal import (REC, SEG, Journal, JournalCorruptError, RecordType, decode_row_set,
                                 decode_rows, encode_row_set, encode_rows)


# --------------------------------------------------------------------------- helpers


def payload(seq: int, n: int = 100) -> bytes:
    """A payload that differs for every record (so that a mix-up shows)."""
    return bytes((seq * 31 + k * 7) % 256 for k in range(n))


def write_txns(d: Path, n_txns: int, per_txn: int = 2, *, segment_bytes: int = 64 << 20, n: int = 100,
               j: Journal | None = None, first: int | None = None) -> Journal:
    """``n_txns`` committed transactions of ``per_txn`` UNDO records each, tags 0.., END docs
    ``{"step": tag}``. Returns the (open) journal."""
    j = j or Journal(d, segment_bytes=segment_bytes)
    if first is None:
        first = j.txns[-1].tag + 1 if j.txns else 0
    for tag in range(first, first + n_txns):
        for _ in range(per_txn):
            j.append(RecordType.UNDO, tag, [payload(j.next_seq, n)])
        j.end(tag, {"step": tag, "kind": "commit"})
    return j


def segments(d: Path) -> list[Path]:
    return sorted(d.glob("seg-*.log"))


def files(d: Path) -> dict[str, str]:
    """sha256 of every file of a directory (names included: a deleted file shows)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def reopen(d: Path, **kw) -> Journal:
    j = Journal(d, **kw)
    j.close()
    return j


# --------------------------------------------------------------------------- round trip


def test_committed_transactions_round_trip_with_tags_docs_and_payloads(tmp_path):
    j = write_txns(tmp_path, 3, per_txn=2)
    j.append(RecordType.DENSE, 3, [b"head", memoryview(payload(99, 40))])  # parts are concatenated
    j.end(3, {"step": 3, "kind": "commit", "nested": {"a": [1, 2]}})
    j.close()

    back = Journal(tmp_path)
    assert [t.tag for t in back.txns] == [0, 1, 2, 3]
    assert [t.doc["step"] for t in back.txns] == [0, 1, 2, 3]
    assert back.txns[3].doc["nested"] == {"a": [1, 2]}
    assert back.tail == [] and back.torn_bytes == 0 and back.tail_damage is None
    for t in back.txns[:3]:
        assert [r.type for r in t.records] == [RecordType.UNDO, RecordType.UNDO]
        assert all(r.tag == t.tag for r in t.records) and t.end.type == RecordType.END and t.end.tag == t.tag
        assert [bytes(back.read(r)) for r in t.records] == [payload(r.seq) for r in t.records]
        assert t.first_seq == t.records[0].seq
    (dense,) = back.txns[3].records
    assert dense.type == RecordType.DENSE and bytes(back.read(dense)) == b"head" + payload(99, 40)
    # sequence numbers: consecutive from 0, END records included
    seqs = [r.seq for t in back.txns for r in (*t.records, t.end)]
    assert seqs == list(range(len(seqs))) and back.next_seq == len(seqs)
    # appending continues the sequence, in the same segment
    write_txns(tmp_path, 1, j=back)
    back.close()
    again = reopen(tmp_path)
    assert [t.tag for t in again.txns] == [0, 1, 2, 3, 4] and again.txns[-1].end.seq == len(seqs) + 2
    assert len(segments(tmp_path)) == 1


def test_append_many_writes_exactly_what_one_append_per_record_writes(tmp_path):
    recs = [(RecordType.ROWS, 1, [payload(i, 50 + i)]) for i in range(5)] + [(RecordType.DENSE, 1, [b"d", b"ense"])]
    one, many = Journal(tmp_path / "one"), Journal(tmp_path / "many")
    singles = [one.append(*r) for r in recs]
    batch = many.append_many(recs)
    assert [(r.seq, r.offset, r.length, r.crc) for r in batch] == [(r.seq, r.offset, r.length, r.crc) for r in singles]
    assert many.tail == batch and many.next_seq == one.next_seq == len(recs)
    for j in (one, many):
        j.end(1, {"step": 1})
        j.close()
    assert segments(tmp_path / "one")[0].read_bytes() == segments(tmp_path / "many")[0].read_bytes()
    back = reopen(tmp_path / "many")
    assert [bytes(p) for _, p in back.read_many(back.txns[0].records)] == \
        [b"".join(parts) for _, _, parts in recs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_row_payloads_round_trip_through_a_journal(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([9, 0, 4], dtype=torch.int32)  # any int dtype in, int64 out
    rows = torch.randn(3, 5, generator=g).to(dtype)
    with_empty = [("emb.t", ids, rows), ("emb.t.adagrad", torch.empty(0, dtype=torch.int64), torch.empty(0, 1))]
    j = Journal(tmp_path)
    for name, i, r in with_empty:
        j.append(RecordType.ROWS, 7, encode_rows(name, i, r))
    j.end(7, {})
    j.close()
    back = reopen(tmp_path)
    (txn,) = back.txns
    name, got_ids, raw = decode_rows(back.read(txn.records[0]))
    assert name == "emb.t" and got_ids.dtype == torch.int64 and got_ids.tolist() == [9, 0, 4]
    assert raw.dtype == torch.uint8 and raw.shape == (3, 5 * rows.element_size())
    assert torch.equal(raw.view(dtype), rows)
    name, got_ids, raw = decode_rows(back.read(txn.records[1]))
    assert name == "emb.t.adagrad" and got_ids.numel() == 0 and raw.shape == (0, 4)
    with pytest.raises(ValueError, match="does not hold"):
        decode_rows(bytes(back.read(txn.records[0]))[:-1])


def test_a_row_set_holds_several_tables_of_one_row_size_in_one_record(tmp_path):
    g = torch.Generator().manual_seed(2)
    tables = [("emb.a", torch.tensor([5, 1])), ("emb.b", torch.empty(0, dtype=torch.int64)),
              ("emb.c", torch.tensor([0, 9, 3]))]
    rows = torch.randn(5, 4, generator=g)   # the tables' rows, concatenated in that order
    j = Journal(tmp_path)
    j.append(RecordType.UNDO, 3, encode_row_set(tables, rows))
    j.end(3, {})
    j.close()
    (txn,) = reopen(tmp_path).txns
    got = decode_row_set(reopen(tmp_path).read(txn.records[0]))
    assert [n for n, _, _ in got] == ["emb.a", "emb.b", "emb.c"]
    assert [i.tolist() for _, i, _ in got] == [[5, 1], [], [0, 9, 3]]
    assert torch.equal(torch.cat([r for _, _, r in got]).view(torch.float32), rows)
    with pytest.raises(ValueError, match="holds 3 tables"):
        decode_rows(reopen(tmp_path).read(txn.records[0]))
    with pytest.raises(ValueError, match="got 4 rows"):
        encode_row_set(tables, rows[:4])


def test_row_records_of_the_one_table_layout_written_before_row_sets_are_still_read():
    ids, rows = torch.tensor([7, 2], dtype=torch.int64), torch.arange(6, dtype=torch.float32).view(2, 3)
    old = struct.pack("<HIQ", 5, 12, 2) + b"emb.t" + ids.numpy().tobytes() + rows.numpy().tobytes()
    ((name, got_ids, raw),) = decode_row_set(old)
    assert name == "emb.t" and got_ids.tolist() == [7, 2] and torch.equal(raw.view(torch.float32), rows)
    with pytest.raises(ValueError, match="does not hold"):
        decode_row_set(old[:-1])


def test_segments_rotate_after_an_end_and_keep_sequence_numbers_continuous(tmp_path):
    j = write_txns(tmp_path, 6, per_txn=3, segment_bytes=600)  # ~ 3 x 140 + END per transaction
    j.close()
    segs = segments(tmp_path)
    assert len(segs) >= 3
    back = reopen(tmp_path, segment_bytes=600)
    assert [t.tag for t in back.txns] == list(range(6))
    refs = [r for t in back.txns for r in (*t.records, t.end)]
    assert [r.seq for r in refs] == list(range(len(refs)))
    # each segment is named after its first record's seq, which follows the previous segment's last
    by_seg: dict[Path, list[int]] = {}
    for r in refs:
        by_seg.setdefault(r.segment, []).append(r.seq)
    # (end() starts the next segment right away once one is full: it may hold only its header)
    empty = [p for p in segs if p not in by_seg]
    assert sorted(by_seg) + empty == segs and all(p.stat().st_size == SEG.size for p in empty)
    assert all(int(p.stem[4:], 16) == back.next_seq for p in empty)
    for p in sorted(by_seg):
        assert int(p.stem[4:], 16) == by_seg[p][0]
        assert by_seg[p] == list(range(by_seg[p][0], by_seg[p][-1] + 1))
    # a segment ends with an END: a transaction never spans two segments
    for p in by_seg:
        last = max(by_seg[p])
        assert next(r for r in refs if r.seq == last).type == RecordType.END
    assert all(bytes(back.read(r)) == payload(r.seq) for t in back.txns for r in t.records)


def test_reclaim_drops_old_segments_after_absorbing_them_and_writes_start(tmp_path):
    j = write_txns(tmp_path, 6, per_txn=3, segment_bytes=600)
    segs = segments(tmp_path)
    assert len(segs) >= 3
    keep_from = j.txns[3].first_seq          # the oldest transaction still needed
    in_seg = {s: [r.seq for t in j.txns for r in (*t.records, t.end) if r.segment == s] for s in segs}
    whole = [s for s in segs if in_seg[s] and max(in_seg[s]) < keep_from]
    assert whole, "the test needs a segment entirely before the kept transaction"
    seen, payloads_ok = [], []

    def absorb(refs):  # runs before the segments are dropped: their records are still readable
        seen.extend(refs)
        payloads_ok.extend(bytes(j.read(r)) == payload(r.seq) for r in refs if r.type == RecordType.UNDO)
        assert all(r.segment.exists() for r in refs) and not (tmp_path / "START").exists()

    live0 = j.live_bytes
    dropped = j.reclaim(keep_from, absorb=absorb)
    # absorb saw every record of the dropped segments (END records included), in order
    assert [r.seq for r in seen] == list(range(len(seen))) and seen[-1].type == RecordType.END
    assert {r.segment for r in seen} == set(whole)
    assert payloads_ok and all(payloads_ok)
    # ... then they were deleted, and START names the first live record
    assert dropped == live0 - j.live_bytes > 0
    assert [p for p in segments(tmp_path)] == [s for s in segs if s not in whole]
    start = int((tmp_path / "START").read_text())
    assert start == seen[-1].seq + 1 == int(segments(tmp_path)[0].stem[4:], 16)
    assert all(t.end.seq >= start for t in j.txns)
    # the segment being appended to is never dropped, even when everything precedes the bound
    j.reclaim(j.next_seq)
    assert segments(tmp_path) and segments(tmp_path)[-1] == j._segs[-1].path
    assert j.txns == []  # every transaction was in the dropped segments
    # appending after a reclaim continues the sequence; a reopen sees exactly the live part
    write_txns(tmp_path, 1, j=j, first=6)
    j.close()
    back = reopen(tmp_path)
    assert [t.tag for t in back.txns] == [6] and back.txns[0].first_seq == int((tmp_path / "START").read_text())
    refs = [r for t in back.txns for r in (*t.records, t.end)]
    assert [r.seq for r in refs] == list(range(refs[0].seq, refs[0].seq + len(refs)))
    assert all(bytes(back.read(r)) == payload(r.seq) for t in back.txns for r in t.records)


def test_a_reclaim_lists_the_writers_own_records_which_are_the_ones_a_scan_of_the_segment_reads(tmp_path):
    # A segment this process wrote: reclaim hands absorb the writer's list (no header read back
    # from the device); it must be exactly what reading the headers gives. A segment found at
    # open has no such list (None): its headers are read, as before.
    from memory_pool.segment_format import iter_refs, seg_refs
    j = write_txns(tmp_path, 6, per_txn=3, segment_bytes=600)
    sealed = j._segs[:-1]
    assert len(sealed) >= 2 and all(s.refs for s in sealed)
    for s in sealed:
        assert seg_refs(s) is s.refs and s.refs == list(iter_refs(s))
    scanned, seen = [r for s in sealed for r in iter_refs(s)], []
    j.reclaim(j.next_seq, absorb=seen.extend)
    assert seen == scanned and [r.seq for r in seen] == list(range(len(seen)))
    write_txns(tmp_path, 2, j=j, first=6)
    j.close()
    back = reopen(tmp_path)
    assert back._segs and all(s.refs is None for s in back._segs)
    for s in back._segs[:-1]:
        assert list(seg_refs(s)) == list(iter_refs(s))
    back.close()


def test_segments_left_behind_by_a_reclaim_killed_after_start_are_dropped_at_open(tmp_path):
    """reclaim writes START before it unlinks: a crash in between leaves dead segments that the
    next writable open removes (a read-only open only skips them)."""
    j = write_txns(tmp_path, 6, per_txn=3, segment_bytes=600)
    j.close()
    segs = segments(tmp_path)
    live_from = int(segs[2].stem[4:], 16)
    (tmp_path / "START").write_text(f"{live_from}\n")  # what reclaim had done when it died
    ro = Journal(tmp_path, read_only=True)
    assert ro.txns[0].first_seq == live_from and segments(tmp_path) == segs
    back = reopen(tmp_path)
    assert segments(tmp_path) == segs[2:]
    assert back.txns[0].first_seq == live_from and back.txns[-1].tag == 5


# --------------------------------------------------------------------------- the torn tail


def test_unended_records_after_the_last_end_are_a_tail_not_a_transaction(tmp_path):
    j = write_txns(tmp_path, 2)
    end = j.txns[-1].end
    tail = [j.append(RecordType.UNDO, 2, [payload(j.next_seq)]) for _ in range(3)]
    j.flush()
    j.close()
    (seg,) = segments(tmp_path)
    size = seg.stat().st_size
    back = reopen(tmp_path)
    assert [t.tag for t in back.txns] == [0, 1]
    assert [r.seq for r in back.tail] == [r.seq for r in tail] and back.torn_bytes == 0
    assert back.tail_damage is None and back.next_seq == tail[-1].seq + 1
    assert bytes(back.read(back.tail[1])) == payload(tail[1].seq)  # the tail is readable (undo records)
    # a writer must drop the tail before it appends: otherwise the next END would seal it
    w = Journal(tmp_path)
    with pytest.raises(NeedsRecoveryError, match="unfinished transaction"):  # not damage: recover first
        w.append(RecordType.UNDO, 3, [b"x"])
    assert seg.stat().st_size == size
    removed = w.truncate_tail()
    assert removed == size - (end.payload_offset + end.length) == 3 * (REC.size + 100)
    assert seg.stat().st_size == end.payload_offset + end.length
    assert w.tail == [] and w.next_seq == end.seq + 1
    write_txns(tmp_path, 1, j=w)
    w.close()
    back = reopen(tmp_path)
    assert [t.tag for t in back.txns] == [0, 1, 2] and back.txns[2].first_seq == end.seq + 1
    assert back.tail == [] and back.torn_bytes == 0


@pytest.mark.parametrize("how", ["cut-in-payload", "cut-in-header", "zeros-appended", "garbage-appended",
                                 "payload-never-written"])
def test_a_partially_written_last_record_is_a_torn_tail_that_truncate_tail_removes(tmp_path, how):
    j = write_txns(tmp_path, 2)
    end = j.txns[-1].end
    committed_end = end.payload_offset + end.length
    first = j.append(RecordType.UNDO, 2, [payload(j.next_seq)])
    last = j.append(RecordType.UNDO, 2, [payload(j.next_seq)])
    j.flush()
    j.close()
    (seg,) = segments(tmp_path)
    size = seg.stat().st_size
    if how == "cut-in-payload":
        os.truncate(seg, last.payload_offset + 37)
        want_tail, torn = [first.seq], 37 + REC.size
    elif how == "cut-in-header":
        os.truncate(seg, last.offset + 11)
        want_tail, torn = [first.seq], 11
    elif how in ("zeros-appended", "garbage-appended"):
        junk = b"\0" * 300 if how == "zeros-appended" else bytes(range(256)) + b"DCXR" + b"\xff" * 44
        with open(seg, "ab") as f:
            f.write(junk)
        want_tail, torn = [first.seq, last.seq], len(junk)
    else:  # its header reached the disk, its payload did not (pages land in any order)
        with open(seg, "r+b") as f:
            f.seek(last.payload_offset)
            f.write(b"\0" * last.length)
        want_tail, torn = [first.seq], REC.size + last.length
    now = seg.stat().st_size
    back = reopen(tmp_path)
    assert [t.tag for t in back.txns] == [0, 1]
    assert all(bytes(back.read(r)) == payload(r.seq) for t in back.txns for r in t.records)
    assert [r.seq for r in back.tail] == want_tail and back.torn_bytes == torn and back.tail_damage is None
    w = Journal(tmp_path)
    assert w.truncate_tail() == now - committed_end
    assert seg.stat().st_size == committed_end < size
    w.close()
    w = Journal(tmp_path)
    assert w.tail == [] and w.torn_bytes == 0 and w.next_seq == end.seq + 1
    write_txns(tmp_path, 1, j=w)
    w.close()
    back = reopen(tmp_path)
    assert [t.tag for t in back.txns] == [0, 1, 2] and back.torn_bytes == 0
    assert all(bytes(back.read(r)) == payload(r.seq) for t in back.txns for r in t.records)


def test_a_torn_tail_in_a_new_segment_is_truncated_away_with_the_segment(tmp_path):
    """A segment is started right after an END; a tail there (even a segment whose header never
    became durable) belongs to the unfinished transaction."""
    j = write_txns(tmp_path, 2, segment_bytes=200)
    segs = segments(tmp_path)
    assert segs[-1].stat().st_size == SEG.size  # the segment started after the last END
    ref = j.append(RecordType.UNDO, 2, [payload(j.next_seq)])
    j.close()
    assert segments(tmp_path) == segs and ref.segment == segs[-1]
    os.truncate(segs[-1], SEG.size // 2)  # the new segment's header torn
    back = reopen(tmp_path)
    assert [t.tag for t in back.txns] == [0, 1] and back.tail == [] and back.torn_bytes == SEG.size // 2
    w = Journal(tmp_path, segment_bytes=200)
    w.truncate_tail()
    assert segments(tmp_path) == segs[:-1]
    write_txns(tmp_path, 1, j=w)
    w.close()
    assert [t.tag for t in reopen(tmp_path).txns] == [0, 1, 2]


def test_a_new_segment_killed_before_its_header_is_dropped_and_appends_go_to_the_previous_one(tmp_path):
    """Killed between creating the file and writing its header: an empty file. It holds nothing;
    appending into it would write records with no segment header before them."""
    write_txns(tmp_path, 2).close()
    segs = segments(tmp_path)
    empty = tmp_path / f"seg-{reopen(tmp_path).next_seq:016x}.log"
    empty.touch()
    ro = Journal(tmp_path, read_only=True)
    assert [t.tag for t in ro.txns] == [0, 1] and ro.torn_bytes == 0 and empty.exists()
    w = Journal(tmp_path)
    assert empty.exists()  # an open changes nothing (a refused pool stays as it was) ...
    write_txns(tmp_path, 1, j=w)
    assert not empty.exists() and segments(tmp_path) == segs  # ... the first append removes it
    w.close()
    assert [t.tag for t in reopen(tmp_path).txns] == [0, 1, 2]
    assert all(p.read_bytes()[:8] == b"DCXJSEG1" for p in segments(tmp_path))


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_bad_record_in_the_tail_with_valid_records_after_it_sets_tail_damage(tmp_path, where):
    j = write_txns(tmp_path, 2)
    tail = [j.append(RecordType.UNDO, 2, [payload(j.next_seq)]) for _ in range(3)]
    j.flush()
    j.close()
    (seg,) = segments(tmp_path)
    flip(seg, tail[0].payload_offset + 50 if where == "payload" else tail[0].offset + 12)
    before = files(tmp_path)
    back = reopen(tmp_path)
    assert back.tail_damage and ("checksum" in back.tail_damage or "valid records after it" in back.tail_damage)
    assert back.tail == []  # the valid tail ends at the bad record
    assert [t.tag for t in back.txns] == [0, 1]
    assert files(tmp_path) == before
    # a bad record that is the *last* one is just a torn tail
    j2 = tmp_path / "j2"
    j = write_txns(j2, 2)
    tail = [j.append(RecordType.UNDO, 2, [payload(j.next_seq)]) for _ in range(3)]
    j.close()
    flip(segments(j2)[0], tail[-1].payload_offset + 50 if where == "payload" else tail[-1].offset + 12)
    back = reopen(j2)
    assert back.tail_damage is None and [r.seq for r in back.tail] == [r.seq for r in tail[:2]]


# --------------------------------------------------------------------------- damage before the tail


def _refuses(d: Path, match: str | None = None, **kw) -> JournalCorruptError:
    before = files(d)
    for read_only in (True, False):
        with pytest.raises(JournalCorruptError, match=match) as e:
            Journal(d, read_only=read_only, **kw)
        assert files(d) == before, "a refused open changed the journal"
    err = e.value
    assert isinstance(err, PoolCorruptError) and err.exit_code == 4
    return err


def test_a_bit_flip_in_a_committed_payload_is_refused_when_read(tmp_path):
    j = write_txns(tmp_path, 3)
    j.close()
    victim = j.txns[1].records[1]
    flip(victim.segment, victim.payload_offset + 17)
    before = files(tmp_path)
    back = reopen(tmp_path)  # opening checks structure, not every committed payload
    assert [t.tag for t in back.txns] == [0, 1, 2]
    with pytest.raises(JournalCorruptError, match=f"record {victim.seq}.*checksum") as e:
        back.read(back.txns[1].records[1])
    with pytest.raises(JournalCorruptError, match=f"record {victim.seq}.*checksum"):
        for _ in back.read_many([r for t in back.txns for r in t.records]):  # (replay, compaction)
            pass
    assert isinstance(e.value, PoolCorruptError) and e.value.exit_code == 4
    assert bytes(back.read(back.txns[1].records[0])) == payload(back.txns[1].records[0].seq)
    assert files(tmp_path) == before


@pytest.mark.parametrize("which", ["record", "end"])
def test_a_bit_flip_in_a_record_header_before_the_last_end_is_refused_at_open(tmp_path, which):
    j = write_txns(tmp_path, 3)
    j.close()
    victim = j.txns[1].records[0] if which == "record" else j.txns[0].end
    flip(victim.segment, victim.offset + 16, 0x01)  # a bit of its seq/tag field
    _refuses(tmp_path, "before a durable transaction end")


def test_a_bit_flip_in_a_header_in_an_older_segment_is_refused_at_open(tmp_path):
    j = write_txns(tmp_path, 4, segment_bytes=300)
    j.close()
    assert len(segments(tmp_path)) >= 3
    victim = j.txns[0].records[1]
    flip(victim.segment, victim.offset + 4, 0x01)  # the record type
    _refuses(tmp_path, "later segments exist")


def test_a_bit_flip_in_a_segment_header_is_refused(tmp_path):
    write_txns(tmp_path, 4, segment_bytes=300).close()
    flip(segments(tmp_path)[1], 12)
    _refuses(tmp_path, "header damaged")


def test_a_truncated_segment_that_is_not_the_last_is_refused(tmp_path):
    write_txns(tmp_path, 4, segment_bytes=300).close()
    segs = segments(tmp_path)
    os.truncate(segs[1], segs[1].stat().st_size - 30)
    _refuses(tmp_path, segs[1].name)


def test_a_deleted_middle_segment_is_a_gap_naming_the_missing_records(tmp_path):
    write_txns(tmp_path, 4, segment_bytes=300).close()
    segs = segments(tmp_path)
    first, after = int(segs[1].stem[4:], 16), int(segs[2].stem[4:], 16)
    segs[1].unlink()
    _refuses(tmp_path, rf"records {first}\.\.{after - 1} are missing")


def test_a_deleted_first_segment_is_refused_with_or_without_start(tmp_path):
    write_txns(tmp_path, 4, segment_bytes=300).close()
    segs = segments(tmp_path)
    segs[0].unlink()  # no START: the journal starts at 0
    _refuses(tmp_path, "segment with sequence 0 is missing")

    d = tmp_path / "with-start"
    j = write_txns(d, 6, segment_bytes=300)
    j.reclaim(j.txns[3].first_seq)
    j.close()
    start = int((d / "START").read_text())
    assert start > 0
    segments(d)[0].unlink()
    _refuses(d, f"segment with sequence {start} is missing")


def test_a_damaged_start_file_is_refused(tmp_path):
    j = write_txns(tmp_path, 6, segment_bytes=300)
    j.reclaim(j.txns[3].first_seq)
    j.close()
    (tmp_path / "START").write_text("12x\n")
    _refuses(tmp_path, "START")


# --------------------------------------------------------------------------- through the pool


ROWS, DIM = 64, 8


def _pool_rows(path) -> dict[str, torch.Tensor]:
    with MemoryPool.open(path) as pool:
        return {n: pool.table(n).read(torch.arange(pool.table(n).num_embeddings)) for n in pool.tables()}


def _journal_bytes(pool_dir: Path) -> int:
    return sum(p.stat().st_size for p in (pool_dir / "journal").glob("seg-*.log"))


def _three_persisted_batches(path: Path) -> tuple[MemoryPool, dict[str, torch.Tensor]]:
    """A new power-sim pool (left open) with tables a [ROWS, DIM] and b [ROWS, 1] after three
    persisted batches of 20 rows, and every row of both as persisted."""
    g = torch.Generator().manual_seed(5)
    pool = MemoryPool.create(path, tier="power-sim")
    a = pool.create_table("a", ROWS, DIM, init="zeros")
    b = pool.create_table("b", ROWS, 1, init="zeros")
    for r in range(3):
        ids = torch.randperm(ROWS, generator=g)[:20]
        a.write(ids, torch.randn(20, DIM, generator=g))
        b.write(ids, torch.full((20, 1), float(r + 1)))
        pool.persist()
    return pool, {"a": a.read(torch.arange(ROWS)), "b": b.read(torch.arange(ROWS))}


def test_journal_replay_at_open_is_idempotent_and_compaction_keeps_the_contents(tmp_pool_dir):
    pool, want = _three_persisted_batches(tmp_pool_dir)
    with pool:
        pool.table("a").write([1, 2], torch.full((2, DIM), 99.0))  # not persisted: not in the journal
    image = (tmp_pool_dir / "tables" / "a.bin").read_bytes()
    assert torch.equal(torch.frombuffer(bytearray(image), dtype=torch.float32), torch.zeros(ROWS * DIM))

    first, second = _pool_rows(tmp_pool_dir), _pool_rows(tmp_pool_dir)  # replayed twice
    for n in want:
        assert torch.equal(first[n], want[n]) and torch.equal(second[n], want[n]), n
    with MemoryPool.open(tmp_pool_dir, read_only=True) as ro:  # a reader replays privately
        assert torch.equal(ro.table("a").read(torch.arange(ROWS)), want["a"])

    # compaction in a writing session: the journal is written back and dropped, contents kept
    with MemoryPool.open(tmp_pool_dir) as pool:
        pool.table("b").write([0], torch.full((1, 1), 7.0))
        pool.persist()
        journal = _journal_bytes(tmp_pool_dir)
        pool.compact()
    want["b"][0] = 7.0
    assert _journal_bytes(tmp_pool_dir) < journal
    image = torch.frombuffer(bytearray((tmp_pool_dir / "tables" / "a.bin").read_bytes()), dtype=torch.float32)
    assert torch.equal(image.view(ROWS, DIM), want["a"])  # written back into the image
    for _ in range(2):
        after = _pool_rows(tmp_pool_dir)
        for n in want:
            assert torch.equal(after[n], want[n]), n


def test_compact_right_after_open_writes_the_journal_back_and_drops_it(tmp_pool_dir):
    """``compact()`` (no bound) compacts every complete segment; after a reopen every segment is
    complete, so the journal must shrink even though nothing was appended in this session."""
    g = torch.Generator().manual_seed(5)
    with MemoryPool.create(tmp_pool_dir, tier="power-sim") as pool:
        a = pool.create_table("a", ROWS, DIM, init="zeros")
        for _ in range(3):
            a.write(torch.arange(ROWS), torch.randn(ROWS, DIM, generator=g))
            pool.persist()
        want = a.read(torch.arange(ROWS))
    journal = _journal_bytes(tmp_pool_dir)
    with MemoryPool.open(tmp_pool_dir) as pool:
        pool.compact()
    assert _journal_bytes(tmp_pool_dir) < journal
    image = torch.frombuffer(bytearray((tmp_pool_dir / "tables" / "a.bin").read_bytes()), dtype=torch.float32)
    assert torch.equal(image.view(ROWS, DIM), want)
    assert torch.equal(_pool_rows(tmp_pool_dir)["a"], want)


def test_compaction_in_the_writing_session_shrinks_the_journal(tmp_pool_dir):
    g = torch.Generator().manual_seed(6)
    with MemoryPool.create(tmp_pool_dir, tier="power-sim") as pool:
        a = pool.create_table("a", ROWS, DIM, init="zeros")
        for _ in range(4):
            a.write(torch.arange(ROWS), torch.randn(ROWS, DIM, generator=g))
            pool.persist()
        want = a.read(torch.arange(ROWS))
        grown = _journal_bytes(tmp_pool_dir)
        assert grown > 4 * ROWS * DIM * 4
        pool.compact()
        assert _journal_bytes(tmp_pool_dir) < grown // 4
        assert pool.stats.bytes_compacted > 0 and pool.stats.bytes_written_back > 0
    assert torch.equal(_pool_rows(tmp_pool_dir)["a"], want)


CHILD_POOL = r"""
import os, sys, torch
from memory_pool import MemoryPool
path, phase = sys.argv[1], sys.argv[2]

def die_after(cls, name, n=1):
    orig = getattr(cls, name)
    calls = [0]
    def wrapper(*a, **kw):
        out = orig(*a, **kw)
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), 9)
        return out
    setattr(cls, name, wrapper)

g = torch.Generator().manual_seed(7)
if phase == "replay":
    import memory_pool.replay as P
    die_after(P, "replay_rows")  # one table replayed into the working copy, the next not
    MemoryPool.open(path)
    raise SystemExit("not killed")
with MemoryPool.open(path) as pool:
    a, b = pool.table("a"), pool.table("b")
    for r in range(3):  # more transactions in this session, so that compact() has work to do
        ids = torch.randperm(a.num_embeddings, generator=g)[:30]
        a.write(ids, torch.randn(30, a.embedding_dim, generator=g))
        b.write(ids, torch.full((30, 1), 10.0 + r))
        pool.persist()
    torch.save({"a": a.read(torch.arange(a.num_embeddings)), "b": b.read(torch.arange(b.num_embeddings))},
               sys.argv[3])
    a.write([0], torch.full((1, a.embedding_dim), -5.0))  # never persisted: lost with the process
    if phase == "write-back":
        from memory_pool.tiers import FileRegion
        die_after(FileRegion, "write_back")
    elif phase == "sync":
        from memory_pool.tiers import FileRegion
        die_after(FileRegion, "sync")
    elif phase == "start-written":
        import memory_pool.journal as J
        orig = J.atomic_write
        def aw(path, data, **kw):
            orig(path, data, **kw)
            if path.name == "START":
                os.kill(os.getpid(), 9)
        J.atomic_write = aw
    pool.compact()
raise SystemExit("not killed")
"""


@pytest.mark.parametrize("phase", ["replay", "write-back", "sync", "start-written"])
def test_sigkill_during_replay_or_compaction_recovers_the_persisted_contents(tmp_path, tmp_pool_dir, run_py,
                                                                             phase):
    pool, want = _three_persisted_batches(tmp_pool_dir)
    pool.close()
    saved = tmp_path / "want.pt"
    proc = run_py(CHILD_POOL, tmp_pool_dir, phase, saved, check=False)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-3000:])
    if phase != "replay":
        want = torch.load(saved)  # what the child had persisted before it was killed
    got = _pool_rows(tmp_pool_dir)
    for n in want:
        assert torch.equal(got[n], want[n]), n
    again = _pool_rows(tmp_pool_dir)  # and stays so (idempotent)
    for n in want:
        assert torch.equal(again[n], want[n]), n
    # the pool still works: compact, reopen, same contents
    with MemoryPool.open(tmp_pool_dir) as pool:
        pool.table("b").write([3], torch.full((1, 1), 42.0))
        pool.persist()
        pool.compact()
    want["b"][3] = 42.0
    final = _pool_rows(tmp_pool_dir)
    for n in want:
        assert torch.equal(final[n], want[n]), n


def test_replay_writes_the_newest_value_of_every_row_as_applying_the_parts_in_order_would():
    # Replay copies each row once, straight from its newest part, and compaction sorts the same
    # set out with latest(): both must equal applying every part in journal order.
    from memory_pool.persistence import latest, newest_mask, replay_rows

    g = torch.Generator().manual_seed(3)
    parts = []
    for k in range(9):
        ids = torch.randperm(50, generator=g)[:int(torch.randint(1, 30, (1,), generator=g))]
        if k == 4:
            ids = torch.tensor([7, 7, 3, 7])            # duplicates inside one part: the last wins
        parts.append((ids, torch.randint(0, 256, (ids.numel(), 12), dtype=torch.uint8, generator=g)))
    reference = torch.zeros(50, 12, dtype=torch.uint8)
    for ids, raw in parts:
        for i, r in zip(ids.tolist(), raw):
            reference[i] = r
    rows = torch.zeros(50, 12, dtype=torch.uint8)
    n = replay_rows(rows, parts)
    touched = torch.unique(torch.cat([p[0] for p in parts]))
    assert n == touched.numel() and torch.equal(rows, reference)
    ids, raw = latest(parts, 50)
    assert torch.equal(ids, touched) and torch.equal(raw, reference[touched])
    assert newest_mask(torch.tensor([7, 7, 3, 7, 3]), 8).tolist() == [False, False, False, True, True]


def test_large_checksums_agree_with_google_crc32c_and_let_other_threads_run_meanwhile():
    """Payloads of 32 KiB and more are checksummed without the GIL: the trainer's thread keeps
    dispatching ops while the journal writer checksums megabytes. The values are google-crc32c's
    (an independent implementation of the same function), for any buffer type."""
    rng = np.random.default_rng(0)
    for n in (0, 1, 100, records.GIL_FREE_BYTES - 1, records.GIL_FREE_BYTES, 3 << 20):
        buf = rng.integers(0, 256, n, dtype=np.uint8)
        want = google_crc32c.value(buf.tobytes())
        assert records.crc32c_extend(0, buf) == want
        assert records.crc32c_extend(0, buf.tobytes()) == want
        assert records.crc32c_extend(0, memoryview(buf)) == want
        assert records.crc32c_extend(0, bytearray(buf.tobytes())) == want
        assert records.crc32c([buf[:n // 3], buf[n // 3:]]) == want
        assert records.crc32c_extend(0, buf[::2]) == google_crc32c.value(buf[::2].tobytes())  # (not contiguous)

    big = np.ones(512 << 20, dtype=np.uint8)   # (~20 ms at 26 GB/s)
    inside, done = threading.Event(), threading.Event()

    def checksum():
        inside.set()
        records.crc32c_extend(0, big)
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(10.0)  # no forced hand-over: this thread runs only if the GIL is let go
    try:
        th = threading.Thread(target=checksum)
        th.start()
        inside.wait()
        ran = 0
        while not done.is_set():
            ran += 1
            if ran % 1000 == 0:
                time.sleep(0)  # (the GIL back to the checksum's thread once it is done)
        th.join()
    finally:
        sys.setswitchinterval(old)
    assert ran > 5000, f"the main thread ran {ran} loop iterations during a 512 MiB checksum"


@pytest.mark.parametrize("then", ["reopen", "compact"])
def test_a_bulk_load_is_not_undone_by_the_tables_older_journal_rows(tmp_pool_dir, then):
    """Table.load_ writes the image directly; the journal's committed rows of the table from
    before it must not be replayed over it at the next open, nor written back by a compaction."""
    g = torch.Generator().manual_seed(8)
    with MemoryPool.create(tmp_pool_dir, tier="power-sim") as pool:
        a = pool.create_table("a", ROWS, DIM)
        b = pool.create_table("b", ROWS, DIM)
        a.write([1, 2], torch.full((2, DIM), 5.0))
        b.write([1, 2], torch.full((2, DIM), 6.0))
        pool.persist()
        new = torch.randn(ROWS, DIM, generator=g)
        a.load_(new)
        a.write([3], torch.full((1, DIM), 7.0))          # after the load: counts
        pool.persist()
        new[3] = 7.0
        if then == "compact":
            pool.compact()
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(tmp_pool_dir, replay=replay) as pool:
            assert torch.equal(pool.table("a").view(), new), replay
            assert torch.equal(pool.table("b").read([1, 2]), torch.full((2, DIM), 6.0)), replay
