"""``DIR/job.json`` of a job of several ranks carries a crc32 of its canonical JSON and is
verified where it is read: a flipped byte or a truncated file is ``PoolCorruptError`` (exit code
4) naming the file, never a silently different job."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from checkpointing.job import JOB_FILE, read_job_file, write_job_file
from dlrm_cxl.distributed import DistContext, prepare_job_dir
from memory_pool import PoolCorruptError, PoolFormatError

JOB = {"seed": 3, "data": "synthetic", "world_size": 2,
       "model": {"feature_names": ["a", "b"], "num_embeddings": [10, 20], "dense_lr": 0.01,
                 "embedding_optimizer": {"kind": "rowwise_adagrad", "eps": 1e-08}}}


def test_round_trip_and_canonical_crc(tmp_path):
    write_job_file(tmp_path, JOB)
    assert read_job_file(tmp_path) == JOB
    doc = json.loads((tmp_path / JOB_FILE).read_text())
    body = {k: v for k, v in doc.items() if k != "crc32"}
    assert body == JOB
    # The pool.json convention: crc32 of the body's JSON with sorted keys and compact separators.
    assert doc["crc32"] == zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    assert not list(tmp_path.glob(".*.tmp"))  # written through atomic_write: no temporary left
    write_job_file(tmp_path, {**JOB, "crc32": 123})  # a stale crc32 in the input is replaced
    assert read_job_file(tmp_path) == JOB


def test_every_flipped_byte_is_refused_naming_the_file(tmp_path):
    write_job_file(tmp_path, JOB)
    f = tmp_path / JOB_FILE
    raw = f.read_bytes()
    for i in range(len(raw)):
        damaged = bytearray(raw)
        damaged[i] ^= 0x01
        f.write_bytes(bytes(damaged))
        with pytest.raises(PoolCorruptError, match=JOB_FILE) as info:
            read_job_file(tmp_path)
        assert info.value.exit_code == 4, i
    f.write_bytes(raw)
    assert read_job_file(tmp_path) == JOB


def test_a_changed_value_with_valid_json_fails_the_checksum(tmp_path):
    write_job_file(tmp_path, JOB)
    f = tmp_path / JOB_FILE
    f.write_text(f.read_text().replace('"world_size": 2', '"world_size": 3'))
    with pytest.raises(PoolCorruptError, match=r"job\.json: job file checksum mismatch"):
        read_job_file(tmp_path)


def test_every_truncation_is_refused(tmp_path):
    write_job_file(tmp_path, JOB)
    f = tmp_path / JOB_FILE
    raw = f.read_bytes()
    doc_end = len(raw.rstrip())  # cutting only the trailing newline leaves the whole document
    for n in range(doc_end):
        f.write_bytes(raw[:n])
        with pytest.raises(PoolCorruptError, match=JOB_FILE):
            read_job_file(tmp_path)


def test_a_job_file_without_checksum_is_refused(tmp_path):
    (tmp_path / JOB_FILE).write_text(json.dumps(JOB))
    with pytest.raises(PoolCorruptError, match="no checksum"):
        read_job_file(tmp_path)
    (tmp_path / JOB_FILE).write_text("[1, 2]")
    with pytest.raises(PoolCorruptError, match=JOB_FILE):
        read_job_file(tmp_path)


def test_a_missing_job_file_is_a_format_error(tmp_path):
    with pytest.raises(PoolFormatError, match="missing") as info:
        read_job_file(tmp_path)
    assert not isinstance(info.value, PoolCorruptError)


class _OneRank(DistContext):
    """A DistContext of one rank without a process group: collectives are the identity."""

    def barrier(self) -> None:
        pass

    def all_true(self, flag: bool) -> bool:
        return flag

    def any_true(self, flag: bool) -> bool:
        return flag


def test_prepare_job_dir_writes_and_verifies_the_checksum(tmp_path):
    job_dir = tmp_path / "job"
    ctx = _OneRank(rank=0, world=1, device=torch.device("cpu"), num_features=2)
    job = {"seed": 0, "data": "synthetic", "model": None}
    assert prepare_job_dir(job_dir, ctx, fresh=False, job=job, log=print) is False
    assert read_job_file(job_dir) == {**job, "world_size": 1}
    assert prepare_job_dir(job_dir, ctx, fresh=False, job=job, log=print) is False  # reads it back
    f = job_dir / JOB_FILE
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(PoolCorruptError, match=JOB_FILE):
        prepare_job_dir(job_dir, ctx, fresh=False, job=job, log=print)
    f.write_bytes(raw.replace(b'"seed": 0', b'"seed": 1'))
    with pytest.raises(PoolCorruptError, match="checksum mismatch"):
        prepare_job_dir(job_dir, ctx, fresh=False, job=job, log=print)
    # --fresh starts over: the damaged job file is replaced by a good one.
    assert prepare_job_dir(job_dir, ctx, fresh=True, job=job, log=lambda s: None) is False
    assert read_job_file(job_dir) == {**job, "world_size": 1}
