"""Tests for dlrm_cxl.data: Criteo TSV parsing, cyclic streaming and resume, malformed input, zarr
conversion, synthetic Zipf data and the prefetcher.

Expectations are computed independently here with plain Python (str.split, int, math.log1p,
int(hex, 16) % n) rather than with the module's own helpers.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dlrm_cxl.data import (
    CRITEO_NUM_DENSE,
    CRITEO_NUM_SPARSE,
    Batch,
    CriteoTSVReader,
    DataSpec,
    Prefetcher,
    SyntheticData,
    ZarrReader,
    convert_tsv_to_zarr,
    criteo_feature_names,
    make_data_source,
    validate_spec,
)
from dlrm_cxl.errors import DataFormatError

# The repo carries its own copy of the samples; fall back to shared/ beside the repo.
_LOCAL = Path(__file__).resolve().parent / "data"
_SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DATA_DIR = _LOCAL if (_LOCAL / "criteo_sample_100.tsv").exists() else _SHARED
SAMPLE = DATA_DIR / "criteo_sample_100.tsv"
SAMPLE2 = DATA_DIR / "criteo_rows_101_200.tsv"

# Deliberately different, non-power-of-two table sizes so a mix-up of features shows.
NUM_EMB = tuple(97 + 13 * i for i in range(CRITEO_NUM_SPARSE))


def spec(batch_size: int, num_embeddings=NUM_EMB) -> DataSpec:
    return DataSpec(CRITEO_NUM_DENSE, criteo_feature_names(), tuple(num_embeddings), batch_size)


# ----------------------------------------------------------------------------- independent oracle


def sample_lines(path: Path = SAMPLE) -> list[str]:
    with open(path, newline="") as f:
        return [ln.rstrip("\n").rstrip("\r") for ln in f]


def expected_row(line: str, num_emb=NUM_EMB):
    fields = line.split("\t")
    assert len(fields) == 40
    label = float(int(fields[0]))
    dense = []
    for x in fields[1:14]:
        v = int(x) if x != "" else 0
        v = max(v, 0)
        dense.append(math.log1p(v))
    ids = []
    for x, n in zip(fields[14:], num_emb):
        ids.append((int(x, 16) if x != "" else 0) % n)
    return label, dense, ids


def expected_batch(lines: list[str], indices, num_emb=NUM_EMB):
    rows = [expected_row(lines[i], num_emb) for i in indices]
    labels = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    dense = torch.tensor([r[1] for r in rows], dtype=torch.float64).to(torch.float32)
    ids = torch.tensor([r[2] for r in rows], dtype=torch.int64)  # [B, F]
    return labels, dense, ids


def assert_batch_is(batch: Batch, lines, indices, num_emb=NUM_EMB):
    labels, dense, ids = expected_batch(lines, indices, num_emb)
    assert batch.dense.dtype == torch.float32 and batch.labels.dtype == torch.float32
    assert torch.equal(batch.labels, labels)
    torch.testing.assert_close(batch.dense, dense, rtol=1e-6, atol=0)
    kjt = batch.sparse
    assert list(kjt.keys()) == list(criteo_feature_names())
    assert kjt.values().dtype == torch.int64
    lengths = kjt.lengths()
    assert torch.equal(lengths, torch.ones(len(indices) * CRITEO_NUM_SPARSE, dtype=lengths.dtype))
    # key-major layout: all of feature 0's ids, then feature 1's, ...
    assert torch.equal(kjt.values(), ids.T.reshape(-1))
    for f, name in enumerate(criteo_feature_names()):
        assert torch.equal(kjt[name].values(), ids[:, f])


def assert_same_batch(a: Batch, b: Batch):
    assert torch.equal(a.dense, b.dense)
    assert torch.equal(a.labels, b.labels)
    assert list(a.sparse.keys()) == list(b.sparse.keys())
    assert torch.equal(a.sparse.values(), b.sparse.values())
    assert torch.equal(a.sparse.lengths(), b.sparse.lengths())


def take(it, n):
    return [next(it) for _ in range(n)]


def run_with_timeout(fn, seconds=10.0):
    """Run fn in a thread so that a would-be infinite loop fails the test instead of hanging it."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"did not finish within {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ----------------------------------------------------------------------------- spec


def test_spec_validation_names_the_offending_value():
    with pytest.raises(ValueError, match="batch_size.*0"):
        spec(0)
    with pytest.raises(ValueError, match="25 entries.*26"):
        DataSpec(13, criteo_feature_names(), NUM_EMB[:25], 8)
    with pytest.raises(ValueError, match="cat_3.*0"):
        DataSpec(13, criteo_feature_names(), NUM_EMB[:3] + (0,) + NUM_EMB[4:], 8)
    s = DataSpec(2, ["a", "b"], [5, 6], 3)  # lists are accepted and frozen into tuples
    assert s.feature_names == ("a", "b") and s.num_embeddings == (5, 6)
    validate_spec(s)
    assert criteo_feature_names() == tuple(f"cat_{i}" for i in range(26))


# ----------------------------------------------------------------------------- TSV parsing


def test_first_batch_of_real_sample_matches_plain_python():
    lines = sample_lines()
    assert len(lines) == 100
    reader = CriteoTSVReader(SAMPLE, spec(16))
    batch, pos = next(reader.iter_batches())
    assert batch.dense.shape == (16, 13) and batch.labels.shape == (16,)
    assert_batch_is(batch, lines, range(16))
    # the sample has missing and negative integers and missing categoricals; make sure the
    # rows checked exercise those rules
    first16 = [ln.split("\t") for ln in lines[:16]]
    assert any(f[i] == "" for f in first16 for i in range(1, 14))
    assert any(f[i].startswith("-") for f in first16 for i in range(1, 14))
    assert any(f[i] == "" for f in first16 for i in range(14, 40))
    assert pos == {"epoch": 0, "offset": sum(len(ln) + 1 for ln in lines[:16]), "line": 16}
    # a hand-checked value: line 1 is "0\t\t3\t260\t..." -> I2 = log1p(3), C1 = 0x05db9164 % 97
    assert batch.dense[0, 0].item() == 0.0
    assert batch.dense[0, 1].item() == pytest.approx(math.log1p(3), rel=1e-6)
    assert batch.sparse["cat_0"].values()[0].item() == 0x05DB9164 % 97


def test_cyclic_stream_spans_the_epoch_boundary():
    lines = sample_lines()
    it = CriteoTSVReader(SAMPLE, spec(64)).iter_batches()
    (b0, p0), (b1, p1), (b2, p2) = take(it, 3)
    assert_batch_is(b0, lines, range(0, 64))
    assert p0["epoch"] == 0 and p0["line"] == 64
    assert_batch_is(b1, lines, list(range(64, 100)) + list(range(0, 28)))
    assert p1["epoch"] == 1 and p1["line"] == 28
    assert p1["offset"] == sum(len(ln) + 1 for ln in lines[:28])
    assert_batch_is(b2, lines, range(28, 92))
    assert p2 == {"epoch": 1, "line": 92, "offset": sum(len(ln) + 1 for ln in lines[:92])}


def test_batch_larger_than_the_file():
    lines = sample_lines()
    it = CriteoTSVReader(SAMPLE, spec(250)).iter_batches()
    (b0, p0), (b1, p1) = take(it, 2)
    assert_batch_is(b0, lines, [i % 100 for i in range(250)])
    assert p0["epoch"] == 2 and p0["line"] == 50
    assert_batch_is(b1, lines, [i % 100 for i in range(250, 500)])
    assert p1["epoch"] == 4 and p1["line"] == 100


@pytest.mark.parametrize("ending", ["\n", "\r\n"])
@pytest.mark.parametrize("trailing", [True, False])
def test_line_endings(tmp_path, ending, trailing):
    lines = sample_lines()[:10]
    text = ending.join(lines) + (ending if trailing else "")
    p = tmp_path / "crlf.tsv"
    p.write_bytes(text.encode())
    it = CriteoTSVReader(p, spec(7)).iter_batches()
    (b0, _), (b1, p1), (b2, _) = take(it, 3)
    assert_batch_is(b0, lines, range(7))
    assert_batch_is(b1, lines, [7, 8, 9, 0, 1, 2, 3])
    assert p1["epoch"] == 1 and p1["line"] == 4
    assert_batch_is(b2, lines, [4, 5, 6, 7, 8, 9, 0])


# ----------------------------------------------------------------------------- resume


def _check_resume(source, n=7):
    stream = take(source.iter_batches(), n)
    for i in range(n - 1):
        saved = json.loads(json.dumps(stream[i][1]))  # positions survive JSON
        batch, pos = next(source.iter_batches(saved))
        assert_same_batch(batch, stream[i + 1][0])
        assert pos == stream[i + 1][1]
    return stream


def test_resume_tsv(tmp_path):
    p = tmp_path / "two.tsv"
    p.write_bytes(SAMPLE.read_bytes() + SAMPLE2.read_bytes())
    stream = _check_resume(CriteoTSVReader(p, spec(48)), n=9)  # 9 * 48 > 2 * 200 rows
    assert stream[-1][1]["epoch"] == 2
    lines = sample_lines(SAMPLE) + sample_lines(SAMPLE2)
    assert_batch_is(stream[4][0], lines, [i % 200 for i in range(4 * 48, 5 * 48)])


def test_resume_zarr(tmp_path):
    z = tmp_path / "s.zarr"
    convert_tsv_to_zarr(SAMPLE, z, spec(1), chunk_rows=32)
    stream = _check_resume(ZarrReader(z, spec(48)), n=7)
    assert stream[-1][1]["epoch"] == 3


def test_resume_synthetic():
    s = DataSpec(4, ("a", "b", "c"), (10, 1000, 50_000), 32)
    _check_resume(SyntheticData(s, seed=3), n=5)


def test_bad_positions_are_rejected():
    r = CriteoTSVReader(SAMPLE, spec(4))
    with pytest.raises(DataFormatError, match="position"):
        next(r.iter_batches({"epoch": 0, "offset": 5, "line": 0}))  # not a line start
    with pytest.raises(DataFormatError, match="position"):
        next(r.iter_batches({"epoch": 0, "offset": 10**9, "line": 0}))
    with pytest.raises(DataFormatError, match="position"):
        next(r.iter_batches({"epoch": 0}))


# ----------------------------------------------------------------------------- malformed input


def _corrupt(tmp_path, line_no: int, mutate) -> Path:
    lines = sample_lines()[:20]
    fields = lines[line_no - 1].split("\t")
    lines[line_no - 1] = "\t".join(mutate(fields))
    p = tmp_path / "bad.tsv"
    p.write_text("\n".join(lines) + "\n")
    return p


def _set(i, v):
    def mutate(fields):
        fields[i] = v
        return fields

    return mutate


BAD_CASES = {
    "short line": (lambda f: f[:-1], "expected 40 tab-separated fields, got 39"),
    "long line": (lambda f: f + ["x"], "expected 40 tab-separated fields, got 41"),
    "non-numeric int": (_set(3, "12a"), r"I3 \(field 4\) is not an integer: '12a'"),
    "float int": (_set(1, "1.5"), r"I1 .* is not an integer"),
    "bad hex": (_set(18, "zz0f12ab"), r"C5 \(cat_4, field 19\) is not hexadecimal: 'zz0f12ab'"),
    "hex with 0x": (_set(14, "0x1f"), r"C1 .* is not hexadecimal"),
    "negative hex": (_set(20, "-1f"), r"C7 .* is not hexadecimal"),
    "label 2": (_set(0, "2"), r"label \(field 1\) must be 0 or 1, got '2'"),
    "label missing": (_set(0, ""), r"label .* must be 0 or 1"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_malformed_line_names_file_and_line(tmp_path, case):
    mutate, message = BAD_CASES[case]
    p = _corrupt(tmp_path, 17, mutate)
    it = CriteoTSVReader(p, spec(8)).iter_batches()
    next(it)  # lines 1..8 are fine
    next(it)  # lines 9..16 are fine
    with pytest.raises(DataFormatError) as ei:
        next(it)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:17: "), msg
    assert __import__("re").search(message, msg), msg
    assert isinstance(ei.value, ValueError)


def test_skip_bad_lines_skips_and_counts(tmp_path):
    lines = sample_lines()[:20]
    bad = dict(BAD_CASES)
    lines[4] = "\t".join(bad["short line"][0](lines[4].split("\t")))
    lines[11] = "\t".join(bad["label 2"][0](lines[11].split("\t")))
    p = tmp_path / "bad.tsv"
    p.write_text("\n".join(lines) + "\n")
    reader = CriteoTSVReader(p, spec(6), skip_bad_lines=True)
    it = reader.iter_batches()
    good = [i for i in range(20) if i not in (4, 11)]
    seq = [good[i % 18] for i in range(4 * 6)]  # 24 good rows: spans one epoch boundary
    for k in range(4):
        batch, pos = next(it)
        assert_batch_is(batch, sample_lines()[:20], seq[6 * k : 6 * k + 6])
    # epoch 0 reads both bad lines; epoch 1 stops after line index 6, past index 4 but not 11
    assert reader.skipped == 3
    # ... which are 2 distinct bad lines, skipped on 2 passes over the file
    assert reader.skip_report() == {"lines": 2, "skips": 3, "passes": 2}
    # the same file without skipping fails at line 5
    with pytest.raises(DataFormatError, match=r":5: expected 40"):
        next(CriteoTSVReader(p, spec(6)).iter_batches())


def test_skip_report_counts_each_bad_line_once_however_many_passes_read_it(tmp_path):
    """A reader resumed mid-file (a trainer's position) that then cycles the file: the bad lines
    are counted once each, the passes that skipped one are counted, and a report up to a batch's
    position leaves out what was read ahead of it."""
    lines = sample_lines()[:20]
    bad = dict(BAD_CASES)
    for i in (2, 15):
        lines[i] = "\t".join(bad["short line"][0](lines[i].split("\t")))
    p = tmp_path / "bad.tsv"
    p.write_text("\n".join(lines) + "\n")
    first = CriteoTSVReader(p, spec(6), skip_bad_lines=True).iter_batches()
    _, pos = next(first)
    _, pos = next(first)  # 12 good rows read: past line 3, not line 16
    assert (pos["epoch"], pos["line"]) == (0, 13)
    reader = CriteoTSVReader(p, spec(6), skip_bad_lines=True)
    it = reader.iter_batches(pos)
    positions = [next(it)[1] for _ in range(18)]  # 108 good rows: 6 passes of 18, from mid-file
    # the reference, counted from the file itself: the (epoch, line) of every bad line read
    bad_lines = {3, 16}
    read = [(e, n) for e in range(positions[-1]["epoch"] + 1) for n in range(1, 21)
            if (0, 13) < (e, n) <= (positions[-1]["epoch"], positions[-1]["line"]) and n in bad_lines]
    assert reader.skip_report() == {"lines": 2, "skips": len(read), "passes": len({e for e, _ in read})}
    assert reader.bad_lines == 2 and reader.skipped == len(read) > 2
    # up to an earlier batch: the later skips are not counted
    upto = positions[9]
    read_upto = [(e, n) for e, n in read if (e, n) <= (upto["epoch"], upto["line"])]
    assert reader.skip_report(upto=upto) == {"lines": 2, "skips": len(read_upto),
                                             "passes": len({e for e, _ in read_upto})}
    assert len(read_upto) < len(read)


def test_one_pass_reads_each_sample_once_with_a_short_last_batch(tmp_path):
    """What evaluation reads: the TSV and its zarr conversion in one pass, never cycled."""
    lines = sample_lines()
    reader = CriteoTSVReader(SAMPLE, spec(32))
    batches = [b for b, _ in reader.iter_pass()]
    assert [b.labels.numel() for b in batches] == [32, 32, 32, 4]
    for k, b in enumerate(batches):
        assert_batch_is(b, lines, list(range(32 * k, min(32 * k + 32, 100))))
    z = tmp_path / "s.zarr"
    convert_tsv_to_zarr(SAMPLE, z, spec(32), chunk_rows=24)  # (batches span chunks)
    zb = [b for b, _ in ZarrReader(z, spec(32)).iter_pass()]
    assert [b.labels.numel() for b in zb] == [32, 32, 32, 4]
    for a, b in zip(batches, zb):
        assert torch.equal(a.labels, b.labels) and torch.equal(a.dense, b.dense)
        assert torch.equal(a.sparse.values(), b.sparse.values())


def test_empty_and_all_bad_files_raise_instead_of_looping(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    with pytest.raises(DataFormatError, match="empty"):
        run_with_timeout(lambda: next(CriteoTSVReader(empty, spec(4)).iter_batches()))
    with pytest.raises(DataFormatError, match="empty"):
        skipping = CriteoTSVReader(empty, spec(4), skip_bad_lines=True)
        run_with_timeout(lambda: next(skipping.iter_batches()))
    junk = tmp_path / "junk.tsv"
    junk.write_text("a\tb\n\nc\n")
    for bs in (1, 2, 1000):
        reader = CriteoTSVReader(junk, spec(bs), skip_bad_lines=True)
        with pytest.raises(DataFormatError, match="no valid line"):
            run_with_timeout(lambda: next(reader.iter_batches()))
    with pytest.raises(DataFormatError, match=":1: expected 40"):
        next(CriteoTSVReader(junk, spec(2)).iter_batches())


# ----------------------------------------------------------------------------- zarr


def test_zarr_round_trip_equals_tsv_and_is_chunked_compressed(tmp_path):
    import zarr

    z = tmp_path / "sample.zarr"
    stats = convert_tsv_to_zarr(SAMPLE, z, spec(1), chunk_rows=32)
    assert stats["rows"] == 100 and stats["skipped"] == 0 and stats["chunks"] == 4
    g = zarr.open_group(str(z), mode="r")
    assert g["dense"].shape == (100, 13) and g["dense"].dtype == np.float32
    assert g["sparse"].shape == (100, 26) and g["sparse"].dtype == np.int64
    assert g["labels"].shape == (100,) and g["labels"].dtype == np.float32
    assert g["dense"].chunks == (32, 13) and g["sparse"].chunks == (32, 26)
    assert g["labels"].chunks == (32,)
    for name in ("dense", "sparse", "labels"):
        (codec,) = g[name].compressors
        assert isinstance(codec, zarr.codecs.BloscCodec)
        assert codec.cname.value == "zstd" and codec.clevel == 3
        assert codec.shuffle.value == "shuffle"
    assert g.attrs["num_embeddings"] == list(NUM_EMB)
    # stored values equal the independent oracle
    _, dense, ids = expected_batch(sample_lines(), range(100))
    assert np.array_equal(g["sparse"][:], ids.numpy())
    # batches: same as the TSV reader's, across chunk and epoch boundaries
    tsv = CriteoTSVReader(SAMPLE, spec(45)).iter_batches()
    zr = ZarrReader(z, spec(45)).iter_batches()
    for _ in range(7):
        (bt, _), (bz, pz) = next(tsv), next(zr)
        assert_same_batch(bt, bz)
    assert pz == {"epoch": 3, "row": 15}


def test_zarr_spec_mismatch_and_failed_conversion(tmp_path):
    z = tmp_path / "sample.zarr"
    convert_tsv_to_zarr(SAMPLE, z, spec(1), chunk_rows=64)
    other = tuple(n + 1 for n in NUM_EMB)
    with pytest.raises(DataFormatError, match="num_embeddings") as ei:
        ZarrReader(z, spec(8, other))
    assert "re-convert" in ei.value.hint
    names = ("x",) + criteo_feature_names()[1:]
    with pytest.raises(DataFormatError, match="feature_names"):
        ZarrReader(z, DataSpec(13, names, NUM_EMB, 8))
    with pytest.raises(DataFormatError, match="not a dlrm-cxl zarr"):
        ZarrReader(tmp_path / "nope.zarr", spec(8))
    # a conversion that fails leaves no (partial) output behind
    bad = _corrupt(tmp_path, 17, BAD_CASES["bad hex"][0])
    out = tmp_path / "bad.zarr"
    with pytest.raises(DataFormatError, match=":17:"):
        convert_tsv_to_zarr(bad, out, spec(1), chunk_rows=8)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if "tmp" in p.name] == []
    stats = convert_tsv_to_zarr(bad, out, spec(1), chunk_rows=8, skip_bad_lines=True)
    assert stats["rows"] == 19 and stats["skipped"] == 1


# ----------------------------------------------------------------------------- synthetic


SYN_SPEC = DataSpec(5, ("a", "b", "c", "d"), (1, 7, 1000, 40_000_000), 256)


def test_synthetic_is_a_pure_function_of_seed_and_k():
    d1 = SyntheticData(SYN_SPEC, seed=11)
    a = d1.batch(5)
    assert_same_batch(a, d1.batch(5))
    assert_same_batch(a, SyntheticData(SYN_SPEC, seed=11).batch(5))
    b = d1.batch(6)
    assert not torch.equal(a.sparse.values(), b.sparse.values())
    assert not torch.equal(a.dense, b.dense)
    c = SyntheticData(SYN_SPEC, seed=12).batch(5)
    assert not torch.equal(a.dense, c.dense)
    # the iterator yields batch(k) in order
    for k, (batch, pos) in enumerate(take(d1.iter_batches({"batch": 3}), 3), start=3):
        assert_same_batch(batch, d1.batch(k))
        assert pos == {"batch": k + 1}


def test_synthetic_ids_in_range_and_layout():
    d = SyntheticData(SYN_SPEC, seed=0)
    for k in range(3):
        b = d.batch(k)
        assert b.dense.shape == (256, 5) and b.dense.dtype == torch.float32
        assert b.labels.shape == (256,) and set(b.labels.tolist()) <= {0.0, 1.0}
        for name, n in zip(SYN_SPEC.feature_names, SYN_SPEC.num_embeddings):
            v = b.sparse[name].values()
            assert v.shape == (256,) and int(v.min()) >= 0 and int(v.max()) < n
    assert torch.all(d.batch(0).sparse["a"].values() == 0)  # a 1-row table
    # the 40M table really uses its range (not all ids in a small prefix)
    big = torch.cat([d.batch(k).sparse["d"].values() for k in range(4)])
    assert int(big.max()) > 20_000_000


def _counts(alpha, n=100_000, batches=10, bs=2048):
    s = DataSpec(0, ("t",), (n,), bs)
    d = SyntheticData(s, seed=1, alpha=alpha)
    ids = np.concatenate([d.batch(k).sparse.values().numpy() for k in range(batches)])
    return np.bincount(ids, minlength=n), ids.size


def test_synthetic_zipf_skew():
    n = 100_000
    counts, total = _counts(1.2, n)
    top = np.sort(counts)[::-1]
    share_top1pct = top[: n // 100].sum() / total
    # continuous power law on [1, n+1): P(rank < r) = (1 - (r+1)^(1-a)) / (1 - (n+1)^(1-a))
    expect = (1 - (n // 100 + 1) ** -0.2) / (1 - (n + 1) ** -0.2)
    assert share_top1pct > 0.6
    assert abs(share_top1pct - expect) < 0.02
    expect_hottest = (1 - 2**-0.2) / (1 - (n + 1) ** -0.2)
    assert abs(top[0] / total - expect_hottest) < 0.01
    hot_rows = np.argsort(counts)[::-1][:10]
    assert hot_rows.max() - hot_rows.min() > 1000  # scattered, not rows 0..9

    # alpha=0: uniform. 20480 draws over 1000 rows: ~20.5 per row (sd ~4.5)
    counts0, total0 = _counts(0.0, 1000)
    share0 = np.sort(counts0)[::-1][:10].sum() / total0
    assert share0 < 0.02  # top 1% of rows: ~1.6% expected from noise alone, 1% ideal
    assert counts0.min() >= 3 and counts0.max() <= 45
    chi2 = ((counts0 - total0 / 1000) ** 2 / (total0 / 1000)).sum()
    assert chi2 < 1200  # ~999 +- 45 for uniform; any real skew is far above


def test_synthetic_labels_depend_on_the_true_effects():
    s = DataSpec(4, tuple(f"f{i}" for i in range(6)), (50,) * 6, 1024)
    d = SyntheticData(s, seed=5, alpha=0.5)
    eff, lab = [], []
    for k in range(8):
        b = d.batch(k)
        e = sum(d.row_effect(f, b.sparse[f"f{f}"].values().numpy()) for f in range(d.informative))
        eff.append(e)
        lab.append(b.labels.numpy())
    eff, lab = np.concatenate(eff), np.concatenate(lab)
    assert d.informative == 3 and np.all(np.abs(eff) <= 3.0)
    hi, lo = lab[eff > 1.0].mean(), lab[eff < -1.0].mean()
    assert hi > 0.75 and lo < 0.25, (hi, lo)
    # a logistic regression on one-hot rows of the informative features learns something
    x = torch.zeros(len(lab), 3 * 50)
    for k in range(8):
        b = d.batch(k)
        for f in range(3):
            x[torch.arange(k * 1024, (k + 1) * 1024), f * 50 + b.sparse[f"f{f}"].values()] = 1.0
    y = torch.from_numpy(lab)
    w = torch.zeros(150, requires_grad=True)
    opt = torch.optim.Adam([w], lr=0.1)
    first = None
    for _ in range(60):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 0.1


def test_synthetic_speed_on_large_tables():
    s = DataSpec(13, criteo_feature_names(), (40_000_000,) * 26, 2048)
    d = SyntheticData(s, seed=0)
    d.batch(0)
    t = time.perf_counter()
    for k in range(1, 6):
        d.batch(k)
    per_batch = (time.perf_counter() - t) / 5
    assert per_batch < 0.2  # ~10 ms measured; generous for slow CI machines


# ----------------------------------------------------------------------------- factory, prefetcher


def test_make_data_source(tmp_path):
    assert isinstance(make_data_source("synthetic", spec(4), seed=2), SyntheticData)
    r = make_data_source(str(SAMPLE), spec(4), skip_bad_lines=True)
    assert isinstance(r, CriteoTSVReader) and r.skip_bad_lines
    z = tmp_path / "d.zarr"
    convert_tsv_to_zarr(SAMPLE, z, spec(1))
    assert isinstance(make_data_source(z, spec(4)), ZarrReader)
    for missing in (tmp_path / "missing.tsv", tmp_path / "missing.zarr", "no-such-thing"):
        with pytest.raises(DataFormatError, match="does not exist") as ei:
            make_data_source(missing, spec(4))
        assert "synthetic" in ei.value.hint


def test_prefetcher_preserves_sequence():
    d = SyntheticData(DataSpec(3, ("a", "b"), (100, 1000), 16), seed=9)
    direct = take(d.iter_batches({"batch": 2}), 10)
    with Prefetcher(d.iter_batches({"batch": 2}), depth=2) as pf:
        got = take(pf, 10)
    for (a, pa), (b, pb) in zip(direct, got):
        assert_same_batch(a, b)
        assert pa == pb
    assert not pf._thread.is_alive()


def test_prefetcher_propagates_exception_in_order_and_closes():
    closed = threading.Event()

    def gen():
        try:
            for i in range(3):
                yield i
            raise RuntimeError("boom")
        finally:
            closed.set()

    pf = Prefetcher(gen())
    assert [next(pf), next(pf), next(pf)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="boom"):
        run_with_timeout(lambda: next(pf), 5.0)
    with pytest.raises(StopIteration):
        next(pf)
    assert closed.is_set()

    closed2 = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed2.set()

    pf = Prefetcher(endless(), depth=1)
    assert list(zip(range(5), pf)) == [(i, i) for i in range(5)]
    pf.close()
    assert not pf._thread.is_alive() and closed2.wait(2.0)
    assert list(Prefetcher(iter([]))) == []


def test_wide_values(tmp_path):
    """Hex values beyond int64 are reduced exactly; integers beyond int64 are rejected."""
    lines = sample_lines()[:4]
    f = lines[2].split("\t")
    f[14] = "ffffffffffffffffffff"  # 2**80 - 1
    f[15] = "0000000000000000000000000000000a"
    lines[2] = "\t".join(f)
    p = tmp_path / "wide.tsv"
    p.write_text("\n".join(lines) + "\n")
    batch, _ = next(CriteoTSVReader(p, spec(4)).iter_batches())
    assert batch.sparse["cat_0"].values()[2].item() == (2**80 - 1) % NUM_EMB[0]
    assert batch.sparse["cat_1"].values()[2].item() == 10 % NUM_EMB[1]
    assert_batch_is(batch, lines, range(4))
    f[5] = "9" * 20
    lines[2] = "\t".join(f)
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=r":3: integer feature I5 .* does not fit in int64"):
        next(CriteoTSVReader(p, spec(4)).iter_batches())


@pytest.mark.parametrize("chunk_rows", [7, 30, 100, 5000])
def test_zarr_chunk_sizes_not_dividing_the_parse_batch(tmp_path, chunk_rows):
    z = tmp_path / "c.zarr"
    stats = convert_tsv_to_zarr(SAMPLE, z, spec(1), chunk_rows=chunk_rows)
    assert stats["rows"] == 100 and stats["chunks"] == -(-100 // chunk_rows)
    (batch, pos), = take(ZarrReader(z, spec(100)).iter_batches(), 1)
    assert_batch_is(batch, sample_lines(), range(100))
    assert pos == {"epoch": 0, "row": 100}
