"""The ``dlrm-cxl`` command line: in-process ``main(argv)`` and as real processes
(``python -m dlrm_cxl`` and the ``dlrm-cxl`` console script of the venv).

Exit codes (dlrm_cxl/cli.py): 0 ok; 1 unexpected; 2 bad arguments/input; 3 not a pool; 4 damage;
5 locked; 6 full; 7 malformed data; 8 diverged. Bad input must give a message and a hint on
stderr, never a traceback: in-process, any exception escaping ``main`` fails the test.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrm_cxl.cli import main
from memory_pool import MemoryPool, destroy_pool

DATA = Path(__file__).resolve().parent / "data"
TSV = DATA / "criteo_sample_100.tsv"
CONSOLE_SCRIPT = Path(sys.executable).parent / "dlrm-cxl"
DIGEST_RE = re.compile(r"^state_digest ([0-9a-f]{64})$", re.M)
TINY = ["--preset", "tiny", "--threads", "1", "--no-progress"]


def run_main(*argv) -> tuple[int, str, str]:
    """main(argv) with stdout/stderr captured; returns (code, out, err)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    assert isinstance(code, int)
    return code, out.getvalue(), err.getvalue()


def run_cli(*argv, console_script=False, timeout=120) -> subprocess.CompletedProcess:
    """The CLI as a real process (python -m dlrm_cxl, or the console script), outside the repo."""
    cmd = [str(CONSOLE_SCRIPT)] if console_script else [sys.executable, "-m", "dlrm_cxl"]
    return subprocess.run(cmd + [str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                          cwd="/", env={**os.environ, "PYTHONWARNINGS": "ignore"})


def assert_clean_error(code, err, expected_code, *needles):
    assert code == expected_code, err
    assert "Traceback" not in err, err
    assert "error" in err, err
    assert "hint" in err or "usage:" in err, err  # argparse errors: the usage line is the hint
    for n in needles:
        assert n in err, (n, err)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny pool trained for 60 steps through main(): (pool, stdout, stderr, digest)."""
    pool = tmp_path_factory.mktemp("cli") / "pool"
    code, out, err = run_main("train", "--pool", pool, *TINY, "--steps", 60)
    assert code == 0, err
    m = DIGEST_RE.search(out)
    assert m, out
    yield pool, out, err, m.group(1)
    if (pool / "pool.json").exists():
        destroy_pool(pool)


# --------------------------------------------------------------------------- argument handling


def test_main_returns_codes_for_help_and_bad_args_instead_of_exiting(capsys):
    assert main(["--help"]) == 0
    assert "train" in capsys.readouterr().out
    assert main(["train", "--help"]) == 0
    assert "--steps" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["train", "--steps", "many"]) == 2
    code = main(["train", "--preset", "huge"])
    err = capsys.readouterr().err
    assert_clean_error(code, err, 2, "--preset", "invalid choice", "tiny")


@pytest.mark.parametrize("spec", ["abc", "x:after-log", "0:after-log", "3:nowhere"])
def test_bad_crash_at_syntax_is_exit_2_with_a_hint(tmp_path, spec):
    code, _, err = run_main("train", "--pool", tmp_path / "p", *TINY, "--steps", 2, "--crash-at", spec)
    assert_clean_error(code, err, 2, "--crash-at")
    assert not (tmp_path / "p").exists()


def test_negative_steps_is_exit_2(tmp_path):
    code, _, err = run_main("train", "--pool", tmp_path / "p", *TINY, "--steps", -1)
    assert_clean_error(code, err, 2, "--steps")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_exit_2(tmp_path):
    code, _, err = run_main("train", "--pool", tmp_path / "p", *TINY, "--steps", 1, "--device", "cuda")
    assert_clean_error(code, err, 2, "CUDA")


# --------------------------------------------------------------------------- train / inspect / eval


def test_train_with_no_digest_prints_none_and_inspect_still_computes_it(tmp_path):
    # (the digests read every row once: minutes for tables beyond DRAM; inspect has them later)
    pool = tmp_path / "p"
    code, out, err = run_main("train", "--pool", pool, *TINY, "--steps", 3, "--no-digest")
    assert code == 0 and "done: step 3" in out and not DIGEST_RE.search(out), (out, err)
    code, js, _ = run_main("train", "--pool", pool, *TINY, "--steps", 4, "--no-digest", "--json")
    assert code == 0 and json.loads(js)["state_digest"] is None
    code, text, _ = run_main("inspect", "--pool", pool)
    assert code == 0 and DIGEST_RE.search(text)


def test_train_inspect_eval_in_process(trained):
    pool, out, err, digest = trained
    # banner: the tier and what it survives
    assert re.search(r"tier pmem: survives power loss", out), out
    assert "step 0 -> 60" in out
    assert re.search(r"^done: step 60 \(60 steps this run, 3840 samples", out, re.M), out
    assert re.search(r"^loss \(mean of last 10 steps\): \d+\.\d{4}$", out, re.M), out
    assert "Traceback" not in err

    code, text, _ = run_main("inspect", "--pool", pool)
    assert code == 0
    assert "tier pmem: survives power loss" in text
    # 26 embedding tables, each on one line with its optimizer state (the pool holds 52 tables)
    assert "tables: 26 embedding tables, each with its optimizer state (52 tables in the pool)" in text, text
    assert re.search(r"^  cat_25 +1000 x 8 +float32  \+ cat_25\.adagrad 1000 x 1$", text, re.M), text
    assert not re.search(r"^  cat_25\.adagrad", text, re.M), text
    assert "step reached (committed): 60" in text
    assert DIGEST_RE.search(text).group(1) == digest

    code, js, _ = run_main("inspect", "--pool", pool, "--json")
    assert code == 0
    info = json.loads(js)
    assert info["tier"] == "pmem" and "power loss" in info["durability"]
    assert info["step"] == 60 and info["state_digest"] == digest
    assert len(info["tables"]) == 52  # (every table of the pool) ...
    assert {t["name"] for t in info["tables"]} >= {f"cat_{i}" for i in range(26)}
    # ... and the 26 embedding tables, each with its optimizer state
    assert [(t["name"], [s["name"] for s in t["optimizer_state"]]) for t in info["embedding_tables"]] == \
        [(f"cat_{i}", [f"cat_{i}.adagrad"]) for i in range(26)]

    # held-out synthetic data of the training distribution: the model has learnt something
    code, js, _ = run_main("eval", "--pool", pool, "--json", "--batches", 8)
    assert code == 0
    res = json.loads(js)
    assert res["samples"] == 8 * 64 and res["step"] == 60 and res["data"] == "synthetic"
    assert math.isfinite(res["logloss"]) and res["logloss"] < 0.69
    assert res["auc"] > 0.6, res

    # --json summary; the pool is at --steps already: nothing runs, the digest is unchanged
    code, js, err2 = run_main("train", "--pool", pool, "--steps", 60, "--threads", 1, "--json")
    assert code == 0
    summary = json.loads(js)  # stdout is exactly the JSON; the banner went to stderr
    assert (summary["start_step"], summary["end_step"], summary["steps_run"]) == (60, 60, 0)
    assert summary["state_digest"] == digest and summary["tier"] == "pmem"
    assert "tier pmem" in err2


def test_train_summary_reports_what_compaction_cost(tmp_path, monkeypatch):
    monkeypatch.setenv("DLRM_CXL_COMPACT_MB", "0.25")  # a compaction every few steps
    pool = tmp_path / "pool"
    # (a fixed window: from the recovery budget, a fast machine chose one window over steps
    # 1-12, so the compactions before its end wrote back only step 1's rows, "0.0 MB")
    code, out, err = run_main("train", "--pool", pool, *TINY, "--steps", 12, "--window", 2)
    assert code == 0, err
    m = re.search(r"^compaction: (\d+) in the background, (\d+) write-back passes between them, "
                  r"([\d.]+) s of CPU \(([\d.]+) ms/step amortised\); "
                  r"([\d.]+) MB of rows written back into the tables$", out, re.M)
    assert m and int(m.group(1)) >= 1 and float(m.group(5)) > 0, out
    code, js, _ = run_main("train", "--pool", pool, *TINY, "--steps", 14, "--window", 2, "--json")
    assert code == 0
    stats = json.loads(js)["pool_stats"]
    assert stats["compactions"] >= 1 and stats["compact_seconds"] > 0 and stats["bytes_written_back"] > 0
    destroy_pool(pool)


def test_a_resumed_train_says_how_long_the_open_took_and_how_many_journal_rows_it_left_to_apply_at_v(tmp_path):
    pool = tmp_path / "pool"
    code, out, err = run_main("train", "--pool", pool, *TINY, "--tier", "pmem", "--steps", 4, "-v")
    assert code == 0, err
    assert "replay on demand" not in out  # a new pool: no journal to replay
    code, out, err = run_main("train", "--pool", pool, *TINY, "--steps", 5)
    assert code == 0, err
    assert "replay on demand" not in out + err and "pool opened in" not in out + err  # a detail: -v only
    code, out, err = run_main("train", "--pool", pool, *TINY, "--steps", 6, "--verbose")
    assert code == 0, err
    m = re.search(r"pool opened in \d+ ms; ([\d,]+) journal rows are applied as the steps first read them", out)
    assert m and int(m.group(1).replace(",", "")) > 0, out
    m2 = re.search(r"^replay on demand: the pool opened in [\d.]+ s with ([\d,]+) journal rows left to apply; "
                   r"([\d,]+) applied since", out, re.M)
    assert m2 and m2.group(1) == m.group(1) and int(m2.group(2).replace(",", "")) > 0, out
    destroy_pool(pool)


def test_train_summary_reports_the_journal_writers_cpu_and_the_bytes_per_step(tmp_path):
    """The critical path hides the journal writer's work (its own thread); the summary says what
    it cost, since with no core to spare it is taken from the step."""
    pool = tmp_path / "pool"
    code, out, err = run_main("train", "--pool", pool, *TINY, "--tier", "pmem", "--steps", 8)
    assert code == 0, err
    m = re.search(r"^checkpoint undo: [\d.]+ ms/step on the critical path \([\d.]+ waiting for the previous "
                  r"step to be durable\), ([\d.]+) ms/step of CPU on the journal writer's thread, \d+ recovery "
                  r"points", out, re.M)
    assert m and float(m.group(1)) > 0, out
    code, js, _ = run_main("train", "--pool", pool, *TINY, "--steps", 12, "--json")
    assert code == 0
    ck = json.loads(js)["checkpoint"]
    assert ck["writer_cpu_ms_per_step"] > 0 and ck["writer_cpu_seconds"] > 0
    assert ck["touched_row_bytes_per_step"] > 0 and ck["dense_bytes_per_step"] > 0
    destroy_pool(pool)

    code, out, err = run_main("train", "--pool", pool, *TINY, "--checkpoint", "none", "--steps", 4)
    assert code == 0, err
    assert "ms/step on the critical path" in out and "journal writer" not in out  # (no writer: nothing to say)
    destroy_pool(pool)


@pytest.mark.parametrize("knob", ["DLRM_CXL_SEGMENT_MB", "DLRM_CXL_COMPACT_MB", "DLRM_CXL_APPLY_MB"])
@pytest.mark.parametrize("value", ["lots", "0", "-1", "nan"])
def test_a_bad_journal_size_in_the_environment_is_a_clean_error(knob, value, tmp_path, monkeypatch):
    monkeypatch.setenv(knob, value)
    code, _, err = run_main("train", "--pool", tmp_path / "pool", *TINY, "--steps", 2)
    assert_clean_error(code, err, 2, knob, repr(value))
    assert not (tmp_path / "pool").exists()  # refused before anything was made


def test_flags_on_an_existing_pool_are_checked_against_its_own_config(trained):
    pool = trained[0]
    code, _, err = run_main("train", "--pool", pool, "--steps", 60, "--lr", 0.5)
    assert_clean_error(code, err, 2, "embedding_optimizer", "--fresh")
    assert "num_embeddings" not in err  # the lr differs, not the preset
    code, _, err = run_main("train", "--pool", pool, "--steps", 60, "--preset", "small")
    assert_clean_error(code, err, 2, "num_embeddings")


def test_real_processes_train_inspect_and_crash(tmp_path):
    pool = tmp_path / "pool"
    p = run_cli("train", "--pool", pool, *TINY, "--steps", 3)
    assert p.returncode == 0, p.stderr
    assert "tier pmem: survives power loss" in p.stdout
    assert re.search(r"^done: step 3 \(3 steps this run", p.stdout, re.M), p.stdout
    digest = DIGEST_RE.search(p.stdout).group(1)
    assert "Traceback" not in p.stderr

    p = run_cli("inspect", "--pool", pool, "--json", console_script=True)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert (info["step"], info["state_digest"], info["tier"]) == (3, digest, "pmem")

    # SIGKILL in the middle of step 5 on (emulated) pmem, the journal writer inline (step 4 is
    # durable before step 5 begins): the step's rows never reached durable media and nothing of
    # it is in the journal, so the pool is at its newest commit at once: export works without a
    # recovery (nothing is left for `recover` to do).
    p = run_cli("train", "--pool", pool, "--steps", 8, "--threads", 1, "--no-progress", "--writer", "inline",
                "--crash-at", "5:after-update", console_script=True)
    assert p.returncode == -9, (p.returncode, p.stderr)
    assert "crash injection: SIGKILL at step 5 after-update" in p.stderr
    code, out, err = run_main("inspect", "--pool", pool, "--json")
    assert code == 0 and json.loads(out)["step"] == 4 and not json.loads(out)["checkpoint"]["needs_recovery"]
    assert not json.loads(out)["needs_recovery"]
    assert run_main("export", "--pool", pool, "--out", tmp_path / "x.pt")[0] == 0
    code, out, _ = run_main("recover", "--pool", pool, "--json")
    assert code == 0 and json.loads(out)["committed_step"] == 4
    assert re.fullmatch(r"[0-9a-f]{64}", json.loads(out)["state_digest"])

    # The same on shm, where step 5 changed rows in place: eval and export refuse the half-done
    # pool until it is recovered, and recovery restores the rows from the undo log.
    shm = tmp_path / "shm"
    assert run_cli("train", "--pool", shm, *TINY, "--tier", "shm", "--steps", 3).returncode == 0
    p = run_cli("train", "--pool", shm, "--steps", 8, "--threads", 1, "--no-progress",
                "--crash-at", "5:after-update", console_script=True)
    assert p.returncode == -9, (p.returncode, p.stderr)
    code, _, err = run_main("export", "--pool", shm, "--out", tmp_path / "y.pt")
    assert_clean_error(code, err, 2, "needs recovery", "dlrm-cxl recover")
    assert not (tmp_path / "y.pt").exists()
    code, _, err = run_main("eval", "--pool", shm, "--json")
    assert_clean_error(code, err, 2, "needs recovery", "dlrm-cxl recover")
    code, out, _ = run_main("recover", "--pool", shm, "--json", "--no-digest")  # (a big pool: seconds saved)
    assert code == 0
    rep = json.loads(out)
    assert rep["committed_step"] == 4 and rep["rolled_back_steps"] == [5] and rep["rows_restored"] > 0
    assert rep["state_digest"] is None
    assert run_main("export", "--pool", shm, "--out", tmp_path / "y.pt")[0] == 0


def test_the_parser_offers_exactly_the_model_presets():
    from dlrm_cxl.cli import PRESET_NAMES
    from dlrm_cxl.model import PRESETS

    assert sorted(PRESET_NAMES) == sorted(PRESETS)


def test_locked_pool_is_exit_5(trained):
    pool = trained[0]
    with MemoryPool.open(pool):  # this process is the writer
        p = run_cli("train", "--pool", pool, "--steps", 60, "--no-progress", console_script=True)
    assert_clean_error(p.returncode, p.stderr, 5, "locked")


# --------------------------------------------------------------------------- export / import / convert


def test_export_loads_into_torchrec_dlrm_and_import_recreates_the_tables(trained, tmp_path):
    from dlrm_cxl.data import SyntheticData
    from dlrm_cxl.model import PRESETS, PoolDLRM, torchrec_dlrm
    from dlrm_cxl.options import data_spec

    pool, *_ = trained
    out = tmp_path / "dlrm.pt"
    code, text, _ = run_main("export", "--pool", pool, "--out", out)
    assert code == 0 and str(out) in text
    state = torch.load(out, weights_only=True)
    cfg = PRESETS["tiny"]
    dlrm = torchrec_dlrm(cfg)
    dlrm.load_state_dict(state, strict=True)

    # the TorchRec model computes what the pool model computes
    batch = SyntheticData(data_spec(cfg), seed=5).batch(0)
    with MemoryPool.open(pool, read_only=True) as p, torch.no_grad():
        from checkpointing import committed_state

        model = PoolDLRM(cfg, p)
        model.load_state_dict(committed_state(p)[1]["model"])
        ours = model(batch.dense, model.plan(batch.sparse))[0]
        theirs = dlrm(batch.dense, batch.sparse).squeeze(-1)
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
        src_tables = {f"cat_{i}": p.table(f"cat_{i}").view().clone() for i in range(26)}

    new = tmp_path / "imported"
    code, _, err = run_main("import", "--pool", new, "--state", out, "--preset", "tiny")
    assert code == 0, err
    with MemoryPool.open(new, read_only=True) as q:
        for name, w in src_tables.items():
            assert q.table(name).view().numpy().tobytes() == w.numpy().tobytes(), name
    code, js, _ = run_main("inspect", "--pool", new, "--json")
    assert code == 0 and json.loads(js)["step"] == 0
    # same weights -> same predictions -> same eval
    a = json.loads(run_main("eval", "--pool", pool, "--json")[1])
    b = json.loads(run_main("eval", "--pool", new, "--json")[1])
    assert (a.pop("step"), b.pop("step")) == (60, 0)  # (the step each one evaluated)
    assert a == b


def test_an_export_that_runs_out_of_disk_is_exit_6_and_leaves_the_last_export_and_no_scratch_file(trained, tmp_path):
    """A real process whose files may not grow past 64 KiB (RLIMIT_FSIZE: EFBIG, as on a full
    disk): the export stops with the typed error and a hint naming the directory, the file a
    previous export wrote is untouched, and none of the export's scratch files stays."""
    import resource
    import signal

    out = tmp_path / "out" / "dlrm.pt"
    out.parent.mkdir()
    out.write_bytes(b"the last export\n")

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (past the limit: EFBIG instead of the signal)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    p = subprocess.run([sys.executable, "-m", "dlrm_cxl", "export", "--pool", str(trained[0]), "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd="/", preexec_fn=small_files,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert_clean_error(p.returncode, p.stderr, 6, "free disk space in", str(out.parent))
    assert out.read_bytes() == b"the last export\n"
    assert os.listdir(out.parent) == ["dlrm.pt"]
    assert run_main("export", "--pool", trained[0], "--out", out)[0] == 0   # (the same with room)
    assert os.listdir(out.parent) == ["dlrm.pt"] and out.stat().st_size > 64 << 10


def test_an_export_survives_a_power_loss_right_after_it_returns(trained, tmp_path):
    """When ``export`` has returned, its file and its name are durable: the emulated power loss
    (memory_pool/fileio.py: every write, creation and rename not yet synced taken back) right
    after it leaves the new file whole -- not the previous export, not an empty or torn one.
    Fails without the file's fsync (its bytes go) and without the directory's (the rename goes)."""
    from memory_pool import fileio

    out = tmp_path / "out" / "dlrm.pt"
    out.parent.mkdir()
    out.write_bytes(b"the last export\n")  # (before the watch: on the disk already)
    fileio.watch(out.parent)
    try:
        assert run_main("export", "--pool", trained[0], "--out", out)[0] == 0
    finally:
        fileio.unwatch(out.parent)
    written = out.read_bytes()
    assert written != b"the last export\n"
    fileio.power_on(out.parent)
    assert out.read_bytes() == written and os.listdir(out.parent) == ["dlrm.pt"]
    assert set(torch.load(out, weights_only=True)) >= {f"sparse_arch.embedding_bag_collection.embedding_bags.cat_{i}.weight"
                                                       for i in range(26)}


def test_an_export_stopped_midway_leaves_the_last_export_and_nothing_else(trained, tmp_path, monkeypatch):
    """An export interrupted while it streams the tables (here: a KeyboardInterrupt from the
    third piece read) removes its temporary file; the previous export stays as it was."""
    from dlrm_cxl.export import write_torchrec_state
    from dlrm_cxl.model_io import open_model
    from memory_pool.table import Table

    out = tmp_path / "out" / "dlrm.pt"
    out.parent.mkdir()
    out.write_bytes(b"the last export\n")
    read, snapshot = [], Table.snapshot

    def interrupted(self, lo, hi):
        read.append((self.name, lo))
        if len(read) == 3:
            raise KeyboardInterrupt
        return snapshot(self, lo, hi)

    monkeypatch.setattr(Table, "snapshot", interrupted)
    pool, _, model = open_model(trained[0], replay="on-demand")
    try:
        with pytest.raises(KeyboardInterrupt):
            write_torchrec_state(model, out)
    finally:
        pool.close()
    assert len(read) == 3 and out.read_bytes() == b"the last export\n"
    assert os.listdir(out.parent) == ["dlrm.pt"]


def test_import_of_a_state_that_does_not_fit_is_exit_2_and_creates_nothing(trained, tmp_path):
    out = tmp_path / "dlrm.pt"
    assert run_main("export", "--pool", trained[0], "--out", out)[0] == 0
    code, _, err = run_main("import", "--pool", tmp_path / "p", "--state", out)  # default preset small
    assert_clean_error(code, err, 2, "--preset tiny")
    assert not (tmp_path / "p").exists()
    code, _, err = run_main("import", "--pool", tmp_path / "p", "--state", tmp_path / "missing.pt",
                            "--preset", "tiny")
    assert_clean_error(code, err, 2, "missing.pt")
    (tmp_path / "junk.pt").write_text("junk\n")  # the weights-only unpickler raises KeyError on this
    code, _, err = run_main("import", "--pool", tmp_path / "p", "--state", tmp_path / "junk.pt",
                            "--preset", "tiny")
    assert_clean_error(code, err, 2, "junk.pt")
    assert not (tmp_path / "p").exists()


def test_data_convert_writes_a_zarr_that_trains_like_the_tsv(tmp_path):
    z = tmp_path / "sample.zarr"
    code, out, err = run_main("data", "convert", TSV, z, "--preset", "tiny", "--chunk-rows", 30)
    assert code == 0, err
    stats = json.loads(out)
    assert (stats["rows"], stats["skipped"]) == (100, 0)
    flags = [*TINY, "--batch-size", 32, "--steps", 5]
    code, out_z, err = run_main("train", "--pool", tmp_path / "pz", "--data", z, *flags)
    assert code == 0, err
    assert "epochs wrapped" in out_z
    code, out_t, err = run_main("train", "--pool", tmp_path / "pt", "--data", TSV, *flags)
    assert code == 0, err
    code, js_z, err = run_main("train", "--pool", tmp_path / "pz", "--data", z, *flags, "--json")
    code, js_t, err = run_main("train", "--pool", tmp_path / "pt", "--data", TSV, *flags, "--json")
    # The same model (a TSV line and its zarr row are the same sample); the streams' positions
    # are written differently (a byte offset, a row index), so the full state digests differ.
    assert json.loads(js_z)["model_digest"] == json.loads(js_t)["model_digest"]
    for pool in ("pz", "pt"):  # eval defaults to the data the pool was trained on
        code, js, err = run_main("eval", "--pool", tmp_path / pool, "--json", "--batches", 3)
        assert code == 0, err
        res = json.loads(js)
        assert res["samples"] == 96 and math.isfinite(res["auc"]) and math.isfinite(res["logloss"])


# --------------------------------------------------------------------------- bad pools and data


def test_inspect_of_a_directory_that_is_not_a_pool_is_exit_3(tmp_path):
    (tmp_path / "empty").mkdir()
    code, _, err = run_main("inspect", "--pool", tmp_path / "empty")
    assert_clean_error(code, err, 3, "not a pool")
    code, _, err = run_main("inspect", "--pool", tmp_path / "nowhere")
    assert_clean_error(code, err, 3, "not a pool")


def test_capacity_too_small_is_exit_6_with_a_capacity_hint(tmp_path):
    code, _, err = run_main("train", "--pool", tmp_path / "p", *TINY, "--steps", 1, "--capacity", "64K")
    assert_clean_error(code, err, 6, "--capacity")
    assert not (tmp_path / "p" / "pool.json").exists()


def test_corrupt_header_is_exit_4(tmp_path):
    pool = tmp_path / "p"
    assert run_main("train", "--pool", pool, *TINY, "--steps", 1)[0] == 0
    header = pool / "pool.json"
    doc = json.loads(header.read_text())
    doc["capacity_bytes"] = 12345  # valid JSON, wrong checksum
    header.write_text(json.dumps(doc))
    for argv in (["inspect"], ["eval"], ["train", "--steps", 2, "--no-progress"]):
        code, _, err = run_main(*argv, "--pool", pool)
        assert_clean_error(code, err, 4, "checksum")
    header.write_bytes(header.read_bytes()[:40])  # truncated
    code, _, err = run_main("inspect", "--pool", pool)
    assert_clean_error(code, err, 4, "pool.json")


def _bad_tsv(tmp_path) -> Path:
    lines = TSV.read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.tsv"
    fields = lines[36].split(b"\t")
    fields[14] = b"not-hex!"  # C1 of line 37
    bad.write_bytes(b"".join(lines[:36]) + b"\t".join(fields) + b"".join(lines[36:]))
    return bad


def test_malformed_tsv_line_is_exit_7_naming_file_and_line(tmp_path):
    bad = _bad_tsv(tmp_path)
    code, _, err = run_main("train", "--pool", tmp_path / "p", *TINY, "--batch-size", 32, "--steps", 3,
                            "--data", bad)
    assert_clean_error(code, err, 7, "bad.tsv:37:", "--skip-bad-lines")
    code, _, err = run_main("data", "convert", bad, tmp_path / "o.zarr", "--preset", "tiny")
    assert_clean_error(code, err, 7, "bad.tsv:37:")
    assert not (tmp_path / "o.zarr").exists()


def test_skip_bad_lines_skips_and_counts(tmp_path):
    bad = _bad_tsv(tmp_path)  # the sample with one extra, malformed line
    flags = [*TINY, "--batch-size", 32, "--steps", 3, "--json"]
    code, out, err = run_main("train", "--pool", tmp_path / "skip", "--data", bad, "--skip-bad-lines", *flags)
    assert code == 0, err
    skipped = json.loads(out)
    assert skipped["skipped_lines"] >= 1
    code, out, err = run_main("train", "--pool", tmp_path / "clean", "--data", TSV, *flags)
    assert code == 0, err
    clean = json.loads(out)
    assert clean["skipped_lines"] == 0
    assert skipped["model_digest"] == clean["model_digest"]  # the same rows were trained on
    assert skipped["state_digest"] != clean["state_digest"]  # ... but the stream stands elsewhere
    code, out, _ = run_main("data", "convert", bad, tmp_path / "o.zarr", "--preset", "tiny", "--skip-bad-lines")
    assert code == 0 and json.loads(out)["skipped"] == 1 and json.loads(out)["rows"] == 100


def test_diverged_training_is_exit_8(tmp_path):
    code, _, err = run_main("train", "--pool", tmp_path / "p", *TINY, "--steps", 10,
                            "--dense-optimizer", "sgd", "--dense-lr", "1e30")
    assert_clean_error(code, err, 8, "loss is", "learning rate")


def test_a_bad_prefetch_nice_is_refused_with_a_hint_before_a_pool_is_made(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DLRM_CXL_PREFETCH_NICE", "high")
    rc = main(["train", "--pool", str(tmp_path / "p"), "--preset", "tiny", "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "DLRM_CXL_PREFETCH_NICE must be a whole number from 0 to 19, got 'high'" in err
    assert "hint: unset DLRM_CXL_PREFETCH_NICE" in err
    assert not (tmp_path / "p").exists()


def test_fresh_on_a_directory_that_is_not_a_pool_deletes_nothing(tmp_path, capsys):
    from dlrm_cxl.cli import main

    d = tmp_path / "mydata"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    rc = main(["train", "--pool", str(d), "--preset", "tiny", "--steps", "1", "--fresh", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 3 and "not a pool" in err and "hint:" in err
    assert (d / "notes.txt").read_text() == "keep me"
