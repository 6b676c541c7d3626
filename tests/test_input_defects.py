"""Defects 7, 10 and 14 of issue 25, each with the test that caught it:

- 7: a damaged zarr dataset (a deleted chunk, a garbled chunk, a label other than 0/1, a NaN or inf
  dense value) is refused with a ``DataFormatError`` naming the array and the chunk, instead of
  being read as zeros or failing with a bare ``RuntimeError``;
- 10: ``MemoryPool.lookup`` refuses a KeyedJaggedTensor with a negative length with
  ``InvalidIdsError`` naming the value (it raised a raw torch ``RuntimeError``, or crashed);
- 14: ``dlrm-cxl data convert`` never deletes what is at its output path unless it is a dataset
  it wrote itself, and replaces that only with ``--overwrite``.

The datasets are real zarr stores written by the project's converter from the Criteo sample.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from dlrm_cxl.cli import main
from dlrm_cxl.data import (
    CRITEO_NUM_DENSE,
    DataSpec,
    ZarrReader,
    convert_tsv_to_zarr,
    criteo_feature_names,
)
from dlrm_cxl.errors import DataFormatError, DlrmCxlError, InvalidConfigError, InvalidIdsError
from memory_pool import MemoryPool

_LOCAL = Path(__file__).resolve().parent / "data"
_SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DATA_DIR = _LOCAL if (_LOCAL / "criteo_sample_100.tsv").exists() else _SHARED
SAMPLE = DATA_DIR / "criteo_sample_100.tsv"
NUM_EMB = tuple(97 + 13 * i for i in range(26))
TINY = ["--preset", "tiny", "--threads", "1", "--no-progress"]


def spec(batch_size: int = 8) -> DataSpec:
    return DataSpec(CRITEO_NUM_DENSE, criteo_feature_names(), NUM_EMB, batch_size)


def read_one_epoch(path: Path, batch_size: int = 8) -> None:
    """Every row of the dataset once, through the reader training uses."""
    reader = ZarrReader(path, spec(batch_size))
    it = reader.iter_batches()
    for _ in range(-(-reader.num_rows // batch_size)):
        next(it)


@contextlib.contextmanager
def expect(cls, *needles: str):
    """pytest.raises(cls), plus: a DlrmCxlError with a hint, whose message holds every needle."""
    with pytest.raises(cls) as info:
        yield info
    err = info.value
    assert isinstance(err, DlrmCxlError) and err.hint.strip(), repr(err)
    for n in needles:
        assert n in err.message, (n, err.message)


def run_main(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def tree(root: Path) -> dict[str, object]:
    """Everything under root: relative path -> file bytes, link target, or "dir"."""
    out: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes()
    return out


@pytest.fixture
def dataset(tmp_path) -> Path:
    """A converted sample: 100 rows in chunks of 32 (chunks 0..3, the last one of 4 rows)."""
    z = tmp_path / "sample.zarr"
    convert_tsv_to_zarr(SAMPLE, z, spec(), chunk_rows=32)
    read_one_epoch(z)  # intact, it reads
    return z


def _set(z: Path, array: str, index, value) -> None:
    import zarr

    zarr.open_group(str(z), mode="r+")[array][index] = value


# ----------------------------------------------------------------------------- 7: damaged zarr


@pytest.mark.parametrize("array, chunk_file, chunk", [
    ("labels", "labels/c/1", 1),
    ("dense", "dense/c/2/0", 2),
    ("sparse", "sparse/c/3/0", 3),  # the short last chunk
])
def test_a_deleted_zarr_chunk_is_a_data_format_error_naming_array_and_chunk(dataset, array, chunk_file,
                                                                            chunk):
    (dataset / chunk_file).unlink()  # zarr would read it as its fill value, zeros: valid-looking rows
    with expect(DataFormatError, f"array {array!r} chunk {chunk}", chunk_file, "missing"):
        read_one_epoch(dataset)


def test_a_chunk_of_only_zeros_is_stored_so_a_deleted_one_is_told_apart(tmp_path):
    # The first 4 sample lines are all negatives: with 4-row chunks, labels chunk 0 is all zeros,
    # which zarr 3 leaves out of the store unless told to write it.
    assert [ln[0] for ln in SAMPLE.read_text().splitlines()[:4]] == ["0"] * 4
    z = tmp_path / "z.zarr"
    convert_tsv_to_zarr(SAMPLE, z, spec(), chunk_rows=4)
    assert (z / "labels" / "c" / "0").is_file()
    read_one_epoch(z)
    # A dataset of an older converter (no every_chunk_stored attribute): a missing chunk may be
    # one it left out, and the hint says so.
    import zarr

    g = zarr.open_group(str(z), mode="r+")
    del g.attrs["every_chunk_stored"]
    (z / "labels" / "c" / "0").unlink()
    with expect(DataFormatError, "array 'labels' chunk 0", "missing") as info:
        read_one_epoch(z)
    assert "older" in info.value.hint


@pytest.mark.parametrize("damage", ["garbled", "truncated", "empty"])
def test_a_garbled_zarr_chunk_is_a_data_format_error_not_a_bare_runtime_error(dataset, damage):
    f = dataset / "sparse" / "c" / "2" / "0"
    data = bytearray(f.read_bytes())
    if damage == "garbled":
        data[16:32] = b"\xff" * 16  # inside blosc's header/stream: decompression fails
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    f.write_bytes(bytes(data))
    with expect(DataFormatError, "array 'sparse' chunk 2", "sparse/c/2/0", "does not decode") as info:
        read_one_epoch(dataset)
    assert isinstance(info.value.__cause__, Exception)  # what zarr/blosc said is kept as the cause


@pytest.mark.parametrize("label", [0.5, 2.0, -1.0, float("nan"), float("inf")])
def test_a_label_other_than_0_or_1_is_a_data_format_error_naming_array_chunk_and_row(dataset, label):
    _set(dataset, "labels", 40, label)
    with expect(DataFormatError, "array 'labels' chunk 1", "row 40", "not 0 or 1"):
        read_one_epoch(dataset)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_inf_dense_value_is_a_data_format_error_naming_array_chunk_and_row(dataset, value):
    _set(dataset, "dense", (70, 3), value)
    with expect(DataFormatError, "array 'dense' chunk 2", "row 70 column 3", repr(value)):
        read_one_epoch(dataset)


def test_an_out_of_range_id_names_the_array_chunk_row_and_feature(dataset):
    _set(dataset, "sparse", (70, 3), 10**6)
    with expect(DataFormatError, "array 'sparse' chunk 2", "row 70", "1000000", "'cat_3'"):
        read_one_epoch(dataset)


def test_training_on_a_zarr_with_a_deleted_chunk_exits_7_naming_the_chunk(tmp_path):
    z = tmp_path / "d.zarr"
    code, _, err = run_main("data", "convert", SAMPLE, z, "--preset", "tiny", "--chunk-rows", 30)
    assert code == 0, err
    (z / "labels" / "c" / "0").unlink()
    code, _, err = run_main("train", "--pool", tmp_path / "p", *TINY, "--batch-size", 16, "--steps", 2,
                            "--data", z)
    assert code == 7, err
    assert "Traceback" not in err and "array 'labels' chunk 0" in err and "hint:" in err, err


# ----------------------------------------------------------------------------- 10: lookup lengths


def _two_table_pool(path) -> MemoryPool:
    pool = MemoryPool.create(path, tier="pmem")
    pool.create_table("a", 50, 8).write(torch.arange(50), torch.randn(50, 8))
    pool.create_table("b", 20, 4).write(torch.arange(20), torch.randn(20, 4))
    return pool


@pytest.mark.parametrize("lengths, values, where", [
    ([2, -1, 1, 0], [1, 2], "key 'a', bag 1"),   # torch: "offsets[-1] can not be greater ..."
    ([3, -1, 0, 0], [1, 2], "key 'a', bag 1"),
    ([1, 1, 1, -1], [1, 2], "key 'b', bag 1"),
])
def test_pool_lookup_with_a_negative_length_raises_invalid_ids_error_naming_it(tmp_pool_dir, lengths, values,
                                                                                where):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor(values, dtype=torch.int64),
                            lengths=torch.tensor(lengths), stride=2)
    with _two_table_pool(tmp_pool_dir) as pool:
        with expect(InvalidIdsError, f"length {min(lengths)} is negative", where):
            pool.lookup(kjt)


def test_pool_lookup_with_negative_lengths_that_sum_right_is_refused_not_a_crash(tmp_pool_dir, run_py):
    # Lengths [-1, 1, 0, 0] sum to the 0 values: before the check, embedding_bag read out of
    # bounds, and the process raised a RuntimeError or died of SIGSEGV (both seen). In a child, so
    # that a crash fails only this test.
    proc = run_py("""
        import sys, torch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        from memory_pool import MemoryPool, InvalidIdsError
        with MemoryPool.create(sys.argv[1], tier="pmem") as pool:
            pool.create_table("a", 50, 8)
            pool.create_table("b", 20, 4)
            kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.zeros(0, dtype=torch.int64),
                                    lengths=torch.tensor([-1, 1, 0, 0]), stride=2)
            try:
                pool.lookup(kjt)
            except InvalidIdsError as e:
                print("refused:", e.message)
    """, tmp_pool_dir, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused: lookup: KeyedJaggedTensor length -1 is negative (key 'a', bag 0" in proc.stdout


# ----------------------------------------------------------------------------- 14: convert output


def convert_cli(out: Path, *flags) -> tuple[int, str, str]:
    return run_main("data", "convert", SAMPLE, out, "--preset", "tiny", "--chunk-rows", 30, *flags)


def assert_refused(code: int, err: str, path: Path, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and "error:" in err and "\nhint: " in err, err
    assert str(path) in err, err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_data_convert_never_touches_a_directory_holding_a_users_notes(tmp_path, flags):
    out = tmp_path / "out"
    out.mkdir()
    notes = "my notes: do not lose\n\x00\xff".encode("latin-1")
    (out / "notes.txt").write_bytes(notes)
    before = tree(tmp_path)
    code, _, err = convert_cli(out, *flags)
    assert_refused(code, err, out, "not a dlrm-cxl zarr dataset", "choose another output path")
    assert tree(tmp_path) == before  # nothing deleted, nothing left behind (no temporary sibling)
    assert (out / "notes.txt").read_bytes() == notes


@pytest.mark.parametrize("content", [b"a regular file the user keeps\n", b""])
@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_data_convert_never_replaces_a_regular_file(tmp_path, content, flags):
    out = tmp_path / "out.zarr"
    out.write_bytes(content)
    before = tree(tmp_path)
    code, _, err = convert_cli(out, *flags)
    assert_refused(code, err, out, "is a file")
    assert tree(tmp_path) == before and out.read_bytes() == content


@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_data_convert_never_replaces_a_symbolic_link(tmp_path, flags):
    target = tmp_path / "elsewhere.zarr"
    assert convert_cli(target)[0] == 0
    out = tmp_path / "out.zarr"
    out.symlink_to(target, target_is_directory=True)
    before = tree(tmp_path)
    code, _, err = convert_cli(out, *flags)
    assert_refused(code, err, out, "symbolic link")
    assert tree(tmp_path) == before


def test_data_convert_replaces_its_own_dataset_only_with_overwrite(tmp_path):
    out = tmp_path / "out.zarr"
    code, _, err = convert_cli(out)
    assert code == 0, err
    before = tree(tmp_path)
    code, _, err = run_main("data", "convert", SAMPLE, out, "--preset", "tiny", "--chunk-rows", 50)
    assert_refused(code, err, out, "already holds a dlrm-cxl zarr dataset", "--overwrite")
    assert tree(tmp_path) == before
    code, _, err = run_main("data", "convert", SAMPLE, out, "--preset", "tiny", "--chunk-rows", 50,
                            "--overwrite")
    assert code == 0, err
    import zarr

    assert zarr.open_group(str(out), mode="r")["labels"].chunks == (50,)  # the new conversion
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.zarr"]  # no old copy, no temporary


@pytest.mark.parametrize("extra", ["notes.txt", "labels/notes.txt", "dense/c/README"])
def test_data_convert_overwrite_keeps_its_own_dataset_once_a_user_file_is_inside(tmp_path, extra):
    out = tmp_path / "out.zarr"
    assert convert_cli(out)[0] == 0
    (out / extra).write_text("the user's\n")
    before = tree(tmp_path)
    code, _, err = convert_cli(out, "--overwrite")
    assert_refused(code, err, out, extra, "not a dlrm-cxl zarr dataset")
    assert tree(tmp_path) == before


def test_convert_overwrite_keeps_a_zarr_group_that_another_tool_wrote(tmp_path):
    import zarr

    out = tmp_path / "theirs.zarr"
    g = zarr.open_group(str(out), mode="w")
    g.create_array("labels", shape=(4,), chunks=(4,), dtype="float32")[:] = 1.0
    before = tree(tmp_path)
    with expect(InvalidConfigError, str(out), "format='dlrm-cxl-criteo'"):
        convert_tsv_to_zarr(SAMPLE, out, spec(), chunk_rows=32, overwrite=True)
    assert tree(tmp_path) == before


def test_data_convert_into_an_empty_directory_or_a_new_path_writes_the_dataset(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    import zarr

    for out in (empty, tmp_path / "new" / "sub.zarr"):
        code, _, err = convert_cli(out)
        assert code == 0, err
        assert zarr.open_group(str(out), mode="r")["labels"].shape == (100,)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]
