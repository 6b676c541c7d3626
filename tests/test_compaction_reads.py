"""A compaction's reads of its journal (memory_pool/newest.py, ``JournalReader.read_payloads``):
two passes of direct reads, the ids first, then every record whole and verified. They must find
each row's newest value exactly as a reference that replays the records one after the other
does, whatever the records' sizes against the span read at once; refuse a record damaged in its
rows or in its ids before returning anything; and read through the page cache where a direct
read is refused."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from helpers import flip
from memory_pool import journal_reader
from memory_pool.journal import Journal, JournalCorruptError, RecordType
from memory_pool.newest import newest_rows
from memory_pool.record_heads import RecordHeads
from memory_pool.records import encode_row_set

SIZES = {"a": 500, "b": 80}
DIM = 16   # float32: 64-byte rows


def write_records(d: Path, seed: int = 0, records: int = 12) -> tuple[Journal, list]:
    """Records of rows of both tables, ids overlapping across records (some records hold many
    rows: larger than a small read span), each committed; returns the journal and
    ``[(ref, {table: (ids, rows)})]`` in journal order."""
    g = torch.Generator().manual_seed(seed)
    j = Journal(d, direct=True)
    written = []
    for tag in range(records):
        tables = []
        for name, rows in SIZES.items():
            n = int(torch.randint(1, rows if tag % 4 else rows // 2, (1,), generator=g))
            ids = torch.randperm(rows, generator=g)[:n]
            tables.append((name, ids, torch.randn(n, DIM, generator=g)))
        rows = torch.cat([t[2] for t in tables])
        seq = j.next_seq
        j.append(RecordType.ROWS, tag, encode_row_set([(n, i) for n, i, _ in tables], rows))
        j.end(tag, {"step": tag})
        ref = next(r for t in j.txns for r in t.records if r.seq == seq)
        written.append((ref, {n: (i, v) for n, i, v in tables}))
    return j, written


def reference(written, select) -> dict:
    """Each row's newest value, by replaying the records in order (a dict a row)."""
    out: dict = {}
    for ref, tables in written:
        for name, (ids, vals) in tables.items():
            keep = select(ref, name, ids)
            if keep is None:
                continue
            rows = out.setdefault(name, {})
            for k in range(ids.numel()):
                if keep is True or bool(keep[k]):
                    rows[int(ids[k])] = vals[k]
    return out


def check(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, rows in want.items():
        ids, raw = got[name]
        assert ids.tolist() == sorted(rows), name
        assert torch.equal(raw.view(torch.float32), torch.stack([rows[i] for i in sorted(rows)])), name


@pytest.mark.parametrize("span", [4096, journal_reader.DIRECT_SPAN], ids=["span-one-page", "span-default"])
def test_a_compactions_reads_find_each_rows_newest_value_as_replaying_the_records_does(tmp_path, monkeypatch, span):
    monkeypatch.setattr(journal_reader, "DIRECT_SPAN", span)
    j, written = write_records(tmp_path / "journal")
    refs = [ref for ref, _ in written]

    def every(ref, name, ids):
        return True

    want = reference(written, every)
    assert len({i for _, t in written for i in t["a"][0].tolist()}) < sum(t["a"][0].numel() for _, t in written), \
        "the records overlap (else there is no newest value to pick)"
    check(newest_rows(j, refs, SIZES, every), want)

    # Rows a record no longer counts for (a refresh or a load since): a mask, or the table skipped.
    def some(ref, name, ids):
        if name == "b" and ref.tag % 3 == 0:
            return None
        return (ids % 5) != (ref.tag % 5)

    check(newest_rows(j, refs, SIZES, some), reference(written, some))


@pytest.mark.parametrize("where", ["rows", "ids"])
def test_a_record_damaged_in_its_rows_or_its_ids_is_refused_before_anything_is_returned(tmp_path, where):
    j, written = write_records(tmp_path / "journal")
    refs = [ref for ref, _ in written]
    ref, tables = written[5]
    ids_bytes = 8 * sum(t[0].numel() for t in tables.values())
    payload_end = ref.payload_offset + ref.length
    rows_at = payload_end - sum(t[1].numel() * 4 for t in tables.values())
    # (a flip in the ids' high bytes: an id far outside the table; in a row: its checksum fails)
    flip(ref.segment, rows_at - ids_bytes + 7 if where == "ids" else rows_at + 3)
    with pytest.raises(JournalCorruptError):
        newest_rows(j, refs, SIZES, lambda *a: True)


def test_a_record_whose_id_was_changed_within_its_table_is_refused_by_its_checksum(tmp_path):
    j, written = write_records(tmp_path / "journal")
    refs = [ref for ref, _ in written]
    ref, tables = written[3]
    rows_at = ref.payload_offset + ref.length - sum(t[1].numel() * 4 for t in tables.values())
    ids_at = rows_at - 8 * sum(t[0].numel() for t in tables.values())
    flip(ref.segment, ids_at, mask=0x01)   # (id 2k <-> 2k+1: still a row of the table)
    with pytest.raises(JournalCorruptError, match="checksum"):
        newest_rows(j, refs, SIZES, lambda *a: True)


def test_a_direct_read_the_device_refuses_is_done_again_through_the_page_cache(tmp_path):
    path = tmp_path / "f"
    data = os.urandom(3 * 4096)
    path.write_bytes(data)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("the temporary directory's file system does not take O_DIRECT")
    try:
        buf = bytearray(2 * 4096 + 1)
        span = memoryview(buf)[1:]   # (not aligned: a direct read of it is refused with EINVAL)
        got, direct = journal_reader._read_span(fd, True, span, 4096)
        assert (got, direct) == (2 * 4096, False)
        assert bytes(span) == data[4096:]
        span.release()
    finally:
        os.close(fd)


def test_ids_that_read_differently_the_second_time_are_refused(tmp_path, monkeypatch):
    """The first pass takes the ids unverified; the second checks them against the verified
    record. A first read that differed (the bytes changed between the two) must stop the
    compaction, not place rows by the wrong ids."""
    j, written = write_records(tmp_path / "journal")
    refs = [ref for ref, _ in written]
    heads = Journal._read_heads

    def first_read_differs(self, rs):
        for ref, view in heads(self, rs):
            if ref.seq != refs[4].seq:
                yield ref, view
                continue
            b = bytearray(view)
            ids_at = int.from_bytes(b[12:16], "little")
            b[ids_at] ^= 0x01   # (an id of the record's first table, still inside the table)
            yield ref, memoryview(b)

    monkeypatch.setattr(Journal, "_read_heads", first_read_differs)
    with pytest.raises(JournalCorruptError, match="changed between two reads"):
        newest_rows(j, refs, SIZES, lambda *a: True)


@pytest.mark.parametrize("defect", ["unknown table", "another row size", "a row past its table"])
def test_a_record_of_an_unknown_table_or_of_another_row_size_is_refused(tmp_path, defect):
    j, written = write_records(tmp_path / "journal", records=3)
    if defect == "unknown table":
        sizes = {"a": SIZES["a"]}
        match = "unknown table 'b'"
    elif defect == "a row past its table":
        # (checked before the plan: the C plan and the torch one would each fail their own way)
        sizes = SIZES
        seq = j.next_seq
        j.append(RecordType.ROWS, 9, encode_row_set([("a", torch.tensor([3, SIZES["a"] + 7]))], torch.zeros(2, DIM)))
        j.end(9, {"step": 9})
        written.append((next(r for t in j.txns for r in t.records if r.seq == seq), None))
        match = f"holds row {SIZES['a'] + 7} of 'a', which has {SIZES['a']} rows"
    else:
        sizes = SIZES
        seq = j.next_seq
        j.append(RecordType.ROWS, 9, encode_row_set([("a", torch.arange(4))], torch.zeros(4, DIM // 2)))
        j.end(9, {"step": 9})
        written.append((next(r for t in j.txns for r in t.records if r.seq == seq), None))
        match = "of 32 bytes, an earlier one of 64"
    with pytest.raises(JournalCorruptError, match=match):
        newest_rows(j, [ref for ref, _ in written], sizes, lambda *a: True)


@pytest.mark.parametrize("cut", ["in its rows", "in its ids"])
def test_a_record_cut_short_is_refused_as_truncated(tmp_path, cut):
    """A segment that ends inside a record (a file cut by hand, or by a tool): the first pass
    reads the ids, so a cut in the rows is found by the second, a cut in the ids by the first."""
    j, written = write_records(tmp_path / "journal", records=4)
    refs = [ref for ref, _ in written]
    ref, tables = written[-1]
    rows_at = ref.payload_offset + ref.length - sum(t[1].numel() * 4 for t in tables.values())
    at = rows_at + 100 if cut == "in its rows" else rows_at - 8 * 3
    with open(ref.segment, "r+b") as f:
        f.truncate(at)
    with pytest.raises(JournalCorruptError, match="truncated"):
        newest_rows(j, refs, SIZES, lambda *a: True)


def test_a_segment_gone_under_a_compaction_is_refused_naming_it(tmp_path):
    j, written = write_records(tmp_path / "journal", records=3)
    refs = [ref for ref, _ in written]
    refs[0].segment.unlink()
    with pytest.raises(JournalCorruptError, match=f"its segment {refs[0].segment.name} is gone"):
        newest_rows(j, refs, SIZES, lambda *a: True)


def write_keeping_heads(d: Path, **kw) -> tuple[Journal, list]:
    """write_records, the journal keeping its row records' heads as it writes them."""
    real = Journal.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        self.heads = RecordHeads()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Journal, "__init__", init)
        return write_records(d, **kw)


def test_kept_heads_spare_the_first_pass_every_read_and_give_the_same_newest_values(tmp_path, monkeypatch):
    j, written = write_keeping_heads(tmp_path / "journal")
    refs = [ref for ref, _ in written]
    assert len(j.heads) == len(refs) and j.heads.nbytes > 0
    on_device = [bytes(v) for _, v in Journal(tmp_path / "journal", read_only=True).read_payloads(refs, ids_only=True)]
    opened = []
    real_open = journal_reader._open_for_reading
    monkeypatch.setattr(journal_reader, "_open_for_reading", lambda *a: opened.append(a) or real_open(*a))
    assert [bytes(v) for _, v in j.read_payloads(refs, ids_only=True)] == on_device
    assert opened == [], "the first pass read kept heads from the device"
    check(newest_rows(j, refs, SIZES, lambda *a: True), reference(written, lambda *a: True))
    assert opened, "the second pass must still read every record from the device"


def test_a_record_not_on_the_device_as_its_kept_head_says_is_refused(tmp_path):
    """The second pass compares each record's ids on the device with the kept ones: a record
    that was not written as kept must stop the compaction, not place rows by the wrong ids."""
    j, written = write_keeping_heads(tmp_path / "journal")
    refs = [ref for ref, _ in written]
    ref = refs[4]
    crc, length, head = j.heads._by_seq[ref.seq]
    head[int.from_bytes(head[12:16].tobytes(), "little")] ^= 0x01   # (an id of its first table, still inside it)
    with pytest.raises(JournalCorruptError, match="changed between two reads"):
        newest_rows(j, refs, SIZES, lambda *a: True)


def test_kept_heads_go_with_their_records_and_never_stand_for_another_record(tmp_path):
    j, written = write_keeping_heads(tmp_path / "journal", records=6)
    refs = [ref for ref, _ in written]
    assert all(j.heads.get(r) is not None for r in refs)
    other = dataclasses.replace(refs[2], crc=refs[2].crc ^ 1)   # (the same number, another record)
    assert j.heads.get(other) is None
    j.rotate()
    assert j.reclaim(j.next_seq) > 0
    assert len(j.heads) == 0 and j.heads.nbytes == 0


def test_a_table_whose_records_hold_another_tables_very_ids_reuses_its_plan_and_gets_its_own_values(
        tmp_path, monkeypatch):
    """An embedding table and its optimizer state are written with the same ids, in records of
    their own (a record holds one row size): the state table's plan is the table's, and each
    still gets its own newest values."""
    from memory_pool import newest
    g = torch.Generator().manual_seed(3)
    j = Journal(tmp_path / "journal", direct=True)
    sizes = {"a": 500, "s": 500}
    written = []
    for tag in range(8):
        ids = torch.randperm(500, generator=g)[:int(torch.randint(1, 300, (1,), generator=g))]
        for name, dim in (("a", DIM), ("s", 1)):
            vals = torch.randn(ids.numel(), dim, generator=g)
            seq = j.next_seq
            j.append(RecordType.ROWS, tag, encode_row_set([(name, ids)], vals))
            written.append((seq, {name: (ids, vals)}))
        j.end(tag, {"step": tag})
    refs = {r.seq: r for t in j.txns for r in t.records}
    written = [(refs[seq], tables) for seq, tables in written]
    calls = []
    real = newest.newest_places
    monkeypatch.setattr(newest, "newest_places", lambda *a: calls.append(1) or real(*a))

    def every(ref, name, ids):
        return True

    check(newest_rows(j, [r for r, _ in written], sizes, every), reference(written, every))
    assert len(calls) == 1
    # A mask that keeps other rows of the state table: its own plan.
    calls.clear()

    def some(ref, name, ids):
        return (ids % 3) != 0 if name == "s" else True

    check(newest_rows(j, [r for r, _ in written], sizes, some), reference(written, some))
    assert len(calls) == 2


def test_a_populated_buffer_is_zeroed_and_its_pages_are_present_before_the_first_write():
    """``arena.populated`` (newest_rows' buffer): the pages come with the mapping, not one fault
    each at the first write, as fresh anonymous memory's do."""
    import resource
    from memory_pool.arena import populated

    def faults_writing(buf):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        buf.fill_(1)
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    n = 8 << 20
    buf = populated(n)
    assert buf.numel() == n and buf.dtype == torch.uint8 and int(buf.max()) == 0
    import mmap
    unpopulated = torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)   # (fresh pages: faults seen)
    assert faults_writing(buf) < 64 < faults_writing(unpopulated)
    assert int(buf.min()) == 1
