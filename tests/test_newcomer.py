"""Issue 28, a newcomer's first hour: resume that just works, flags that are refused rather than
ignored, no traceback for bad input, messages that say the right thing, help for every flag, and
the exit codes the README lists. In-process ``main(argv)``, and real processes for the closed pipe
and the read-only (immutable) pool."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dlrm_cxl.cli import main  # noqa: F401  (run_main calls it)
from dlrm_cxl.cli_args import build_parser
from memory_pool import MemoryPool, destroy_pool
from test_cli import CONSOLE_SCRIPT, DIGEST_RE, TINY, TSV, assert_clean_error, run_cli, run_main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A tiny pool trained for 2 steps on the Criteo sample file: (path, digest)."""
    p = tmp_path_factory.mktemp("newcomer") / "pool"
    code, out, err = run_main("train", "--pool", p, *TINY, "--data", TSV, "--steps", 2)
    assert code == 0, err
    yield p, DIGEST_RE.search(out).group(1)
    if (p / "pool.json").exists():
        destroy_pool(p)


# --------------------------------------------------------------------------- resume and flags


def test_resume_without_data_continues_on_the_file_the_pool_was_trained_on(tmp_path):
    p = tmp_path / "pool"
    assert run_main("train", "--pool", p, *TINY, "--data", TSV, "--steps", 2)[0] == 0
    code, out, err = run_main("train", "--pool", p, "--steps", 3, "--no-progress")
    assert code == 0, err
    assert "done: step 3" in out, out
    # an explicit other --data is still refused, naming the data the pool was trained on
    code, _, err = run_main("train", "--pool", p, "--steps", 4, "--no-progress", "--data", "synthetic")
    assert_clean_error(code, err, 2, "was trained on --data", str(TSV))


def test_steps_already_reached_says_nothing_to_do_and_exits_0(pool):
    p, digest = pool
    code, out, err = run_main("train", "--pool", p, "--steps", 1, "--no-progress", "--data", TSV)
    assert code == 0, err
    assert "already at step 2; nothing to do" in out, out
    assert "step 2 -> 1" not in out + err and "0 recovery points" not in out, out
    assert f"state_digest {digest}" in out  # nothing was trained


@pytest.mark.parametrize("flag, value, needle", [("--tier", "shm", "--tier shm applies to a new pool only"),
                                                 ("--capacity", "1G", "applies to a new pool only")])
def test_tier_and_capacity_on_an_existing_pool_are_refused_not_ignored(pool, flag, value, needle):
    code, _, err = run_main("train", "--pool", pool[0], "--steps", 5, "--no-progress", "--data", TSV, flag, value)
    assert_clean_error(code, err, 2, needle, "--fresh")


def test_a_nonexistent_data_file_is_a_usage_error_and_makes_no_pool(tmp_path):
    p = tmp_path / "pool"
    code, _, err = run_main("train", "--pool", p, *TINY, "--data", tmp_path / "missing.tsv", "--steps", 1)
    assert_clean_error(code, err, 2, "missing.tsv: no such file or directory")
    assert not p.exists()


def test_a_zarr_for_another_preset_is_refused_before_a_pool_is_made_with_the_cli_command(tmp_path):
    z = tmp_path / "tiny.zarr"
    assert run_main("data", "convert", TSV, z, "--preset", "tiny")[0] == 0
    p = tmp_path / "pool"
    code, _, err = run_main("train", "--pool", p, "--preset", "small", "--data", z, "--steps", 1, "--no-progress")
    assert_clean_error(code, err, 7, "dlrm-cxl data convert FILE.tsv DIR.zarr --preset small")
    assert "convert_tsv_to_zarr" not in err
    assert not p.exists()  # validated first: no half-made pool of hundreds of MB


# --------------------------------------------------------------------------- never a traceback


@pytest.mark.parametrize("text, needle", [
    ('{"foo": 1}', "unknown key 'foo'"),
    ('{"embedding_dim": "16"}', "key 'embedding_dim' must be an integer"),
    ("[1, 2]", "not a JSON list"),
    ('{"bottom_mlp": 3}', "key 'bottom_mlp' must be a list of integers"),
    ('{"embedding_optimizer": {"lr": "x"}}', "key 'embedding_optimizer.lr' must be a number"),
])
def test_a_bad_config_file_is_a_typed_error_naming_the_key(tmp_path, text, needle):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(text)
    code, _, err = run_main("train", "--pool", tmp_path / "pool", *TINY, "--config", cfg, "--steps", 1)
    assert_clean_error(code, err, 2, needle)
    assert not (tmp_path / "pool").exists()


def _immutable(path: Path) -> bool:
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


@pytest.mark.parametrize("command", [["train", "--steps", "5", "--no-progress"], ["recover"], ["destroy"]])
def test_a_pool_that_cannot_be_written_is_a_typed_error_and_nothing_is_changed(tmp_path, command):
    p = tmp_path / "pool"
    assert run_main("train", "--pool", p, *TINY, "--steps", 2)[0] == 0
    before = sorted(x.name for x in p.iterdir())
    if not _immutable(p):
        pytest.skip("chattr +i is not available here")
    try:
        code, _, err = run_main(command[0], "--pool", p, *command[1:])
        assert_clean_error(code, err, 2, f"`dlrm-cxl {command[0]}` changes the pool but cannot write to it",
                           "nothing was changed", "chattr -i")
        if command[0] == "train":  # as a real process too
            r = run_cli(*command, "--pool", p, console_script=True)
            assert_clean_error(r.returncode, r.stderr, 2, "cannot write to it")
        assert run_main("inspect", "--pool", p, "--no-digest")[0] == 0  # readers read it as it is
    finally:
        subprocess.run(["chattr", "-i", str(p)], check=True)
    assert sorted(x.name for x in p.iterdir()) == before


def test_a_closed_pipe_ends_the_command_quietly_with_exit_0(pool):
    """``dlrm-cxl inspect --pool P | head -1``: the reader is gone before the command writes
    (deterministic: the pipe's read end is closed before the process starts)."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([str(CONSOLE_SCRIPT), "inspect", "--pool", str(pool[0])], stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=120,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
    finally:
        os.close(w)
    assert p.returncode == 0, p.stderr
    assert "Broken pipe" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    # and through a shell pipeline, as setup.sh runs it
    sh = subprocess.run(["bash", "-c", f"set -o pipefail; '{CONSOLE_SCRIPT}' inspect --pool '{pool[0]}' | head -1"],
                        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert sh.returncode == 0, sh.stderr
    assert sh.stdout.startswith("pool "), sh.stdout
    assert "Broken pipe" not in sh.stderr


def test_import_of_a_file_that_is_not_a_torch_file_says_so(tmp_path):
    state = tmp_path / "notes.pt"
    state.write_text("not a torch file")
    code, _, err = run_main("import", "--pool", tmp_path / "pool", "--state", state, "--preset", "tiny")
    assert_clean_error(code, err, 2, "not a state_dict this tool can read")
    assert "weights_only" not in err
    assert not (tmp_path / "pool").exists()


# --------------------------------------------------------------------------- messages that are wrong


def test_import_into_an_existing_pool_does_not_hint_a_fresh_flag_it_lacks(pool, tmp_path):
    state = tmp_path / "s.pt"
    assert run_main("export", "--pool", pool[0], "--out", state)[0] == 0
    code, _, err = run_main("import", "--pool", pool[0], "--state", state, "--preset", "tiny")
    assert_clean_error(code, err, 2, "already holds a pool", "dlrm-cxl destroy")
    assert "--fresh" not in err


def test_data_convert_of_a_missing_input_names_the_positional_input(tmp_path):
    code, _, err = run_main("data", "convert", tmp_path / "missing.tsv", tmp_path / "out.zarr")
    assert_clean_error(code, err, 2, "INPUT", "missing.tsv: no such file")
    assert "--data" not in err


@pytest.mark.parametrize("command", ["inspect", "train", "recover"])
def test_a_regular_file_as_pool_says_it_is_a_file(tmp_path, command):
    f = tmp_path / "afile"
    f.write_text("x")
    code, _, err = run_main(command, "--pool", f)
    assert_clean_error(code, err, 3, "is a file")
    assert "not an empty directory" not in err and "no such directory" not in err


def test_recover_dry_run_says_rows_would_be_restored(tmp_path):
    p = tmp_path / "pool"
    r = run_cli("train", "--pool", p, *TINY, "--steps", 3, "--crash-at", "3:before-commit", "--writer", "inline")
    assert r.returncode != 0 and (p / "pool.json").exists(), r.stderr
    code, out, err = run_main("recover", "--pool", p, "--dry-run", "--no-digest")
    assert code == 0, err
    assert "would be consistent" in out and "rows would be restored" in out, out
    assert not re.search(r"\d+ rows restored", out), out


def test_the_recovery_reason_never_shows_an_empty_step_list():
    from dlrm_cxl.provisioning import recovery_reason

    status = {"steps_to_roll_back": [], "committed_step": 7, "torn_bytes": 0}
    why = recovery_reason(status, 5)
    assert "[]" not in why and "ahead of the job's step 5" in why, why
    assert recovery_reason({**status, "steps_to_roll_back": [8]}, None) == "step 8 was not committed"


def test_a_writer_refused_by_the_lock_is_not_told_to_open_read_only(pool):
    with MemoryPool.open(pool[0]):  # this process is the writer
        code, _, err = run_main("train", "--pool", pool[0], "--steps", 5, "--no-progress", "--data", TSV)
    assert_clean_error(code, err, 5, "locked", "wait until the other process ends")
    assert "inspect/eval do" not in err


# --------------------------------------------------------------------------- output: --help, --version, exit codes


def _flags(parser) -> list:
    return [a for a in parser._actions if a.option_strings or a.dest not in ("help", "command", "data_command")]


def test_every_flag_of_every_command_has_help_and_version_is_offered():
    parser = build_parser()
    subs = [a for a in parser._actions if a.dest == "command"][0].choices
    data = [a for a in subs["data"]._actions if a.dest == "data_command"][0].choices
    missing = [(name, a.dest) for name, sp in [*subs.items(), *(("data " + k, v) for k, v in data.items())]
               for a in _flags(sp) if a.dest not in ("help", "data_command") and not a.help]
    assert missing == []
    train_help = subs["train"].format_help()
    assert "default auto" in train_help and "K, M, G, T" in train_help
    code, out, _ = run_main("--version")
    assert code == 0 and re.match(r"dlrm-cxl \S+", out), out


def test_the_readme_the_help_and_the_code_list_the_same_exit_codes():
    from dlrm_cxl import errors
    from dlrm_cxl.cli_args import EXIT_CODES
    from memory_pool import errors as pool_errors

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("Exit codes ("):readme.index("Errors print one line")]
    assert sorted(int(c) for c in re.findall(r"^- `(\d+)`", section, re.M)) == sorted(EXIT_CODES)
    epilog = build_parser().epilog
    assert all(re.search(rf"^\s*{c}  ", epilog, re.M) for c in EXIT_CODES)
    classes = [v for m in (errors, pool_errors) for v in vars(m).values()
               if isinstance(v, type) and issubclass(v, errors.DlrmCxlError)]
    assert {c.exit_code for c in classes} <= set(EXIT_CODES)
    assert errors.PoolNotWritableError.exit_code == 2 and "PoolNotWritableError" in section
    assert "needs recovery" in section and "NeedsRecoveryError" in section
    assert errors.NoMetricsError.exit_code == 2 and "NoMetricsError" in section


# --------------------------------------------------------------------------- --skip-bad-lines, eval


def _tsv_with_one_bad_line(tmp_path: Path) -> Path:
    """The 100-line sample with one malformed line inserted as line 37 (36 good lines before it)."""
    lines = TSV.read_bytes().splitlines(keepends=True)
    fields = lines[36].split(b"\t")
    fields[14] = b"not-hex!"
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(b"".join(lines[:36]) + b"\t".join(fields) + b"".join(lines[36:]))
    return bad


def test_skip_bad_lines_counts_a_bad_line_once_and_says_on_how_many_passes_it_was_skipped(tmp_path):
    bad = _tsv_with_one_bad_line(tmp_path)
    steps, batch = 50, 32  # 1600 samples: 16 passes over the 100 good lines
    flags = ["--pool", tmp_path / "p", *TINY, "--batch-size", batch, "--data", bad, "--skip-bad-lines"]
    code, out, err = run_main("train", *flags, "--steps", steps)
    assert code == 0, err
    # the reference: the passes whose samples reached past the 36 good lines before the bad one
    passes = sum(1 for k in range(100) if 100 * k + 36 < steps * batch)
    assert passes == 16
    assert f"data: 1 malformed line, skipped on each of {passes} passes over the file (--skip-bad-lines)" in out, out
    assert f"{passes} malformed" not in out
    # resumed at the end of a pass: step 51 reads lines 1-32 of the next pass, step 52 past line 37
    code, out, err = run_main("train", *flags, "--steps", steps + 1, "--json")
    assert code == 0, err
    assert json.loads(out)["bad_lines"] == {"lines": 0, "skips": 0, "passes": 0}
    code, out, err = run_main("train", *flags, "--steps", steps + 2, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["skipped_lines"] == 1 and d["bad_lines"] == {"lines": 1, "skips": 1, "passes": 1}


def test_eval_of_a_file_smaller_than_its_batches_evaluates_each_sample_once_and_names_the_step(pool, tmp_path):
    p, _ = pool  # tiny (batch 64) at step 2
    n_lines = len(TSV.read_bytes().splitlines())
    code, out, err = run_main("eval", "--pool", p, "--data", TSV)  # 8 batches of 64 > 100 lines
    assert code == 0, err
    assert re.fullmatch(rf"eval of step 2 on {re.escape(str(TSV))}: auc \d\.\d{{4}}, logloss \d\.\d{{4}} over "
                        rf"{n_lines} samples \(the whole file, each sample once\)\n", out), out
    code, js, err = run_main("eval", "--pool", p, "--data", TSV, "--json")
    res = json.loads(js)
    assert (res["step"], res["samples"], res["whole_data"], res["data"]) == (2, 100, True, str(TSV)), res
    # its zarr conversion is the same samples: the same result (an independent path through the data)
    z = tmp_path / "s.zarr"
    assert run_main("data", "convert", TSV, z, "--preset", "tiny")[0] == 0
    zres = json.loads(run_main("eval", "--pool", p, "--data", z, "--json")[1])
    assert (zres["samples"], zres["auc"], zres["logloss"]) == (100, res["auc"], res["logloss"])
    # fewer batches than the file: the first ones, said so
    code, out, _ = run_main("eval", "--pool", p, "--data", TSV, "--batches", 1)
    assert code == 0 and "over 64 samples (the first 1 batches; --batches N reads more)" in out, out
    assert json.loads(run_main("eval", "--pool", p, "--data", TSV, "--batches", 1, "--json")[1])["whole_data"] is False


# --------------------------------------------------------------------------- needs recovery: one rule on every tier


def test_eval_and_export_refuse_a_pool_that_needs_recovery_alike_on_shm_and_pmem(tmp_path):
    """A crash between a step's records and its commit (3:before-commit: the transaction is in the
    journal, its END is not): on shm the step changed rows in place, on emulated pmem they never
    reached the images; on both `recover` has work to do, and eval and export refuse with the same
    error, hint and exit code until it ran. `inspect` says so on both."""
    errs = {}
    for tier in ("pmem", "shm"):
        p = tmp_path / tier
        assert run_main("train", "--pool", p, *TINY, "--tier", tier, "--steps", 2)[0] == 0
        r = run_cli("train", "--pool", p, "--steps", 5, "--threads", 1, "--no-progress",
                    "--crash-at", "3:before-commit")
        assert r.returncode == -9, r.stderr
        code, _, err = run_main("eval", "--pool", p)
        assert_clean_error(code, err, 2, "needs recovery (step 3 was not committed)",
                           f"`dlrm-cxl recover --pool {p}` first")
        errs[tier] = err.replace(str(p), "P")
        code, _, err2 = run_main("export", "--pool", p, "--out", tmp_path / f"{tier}.pt")
        assert_clean_error(code, err2, 2, "needs recovery (step 3 was not committed)")
        assert not (tmp_path / f"{tier}.pt").exists()
        code, text, _ = run_main("inspect", "--pool", p, "--no-digest")
        assert code == 0 and "needs recovery: uncommitted step 3" in text, text
        assert json.loads(run_main("inspect", "--pool", p, "--no-digest", "--json")[1])["needs_recovery"] is True
        assert run_main("recover", "--pool", p, "--no-digest")[0] == 0
        code, out, err = run_main("eval", "--pool", p)
        assert code == 0 and out.startswith("eval of step 2 on held-out synthetic data"), err
        assert json.loads(run_main("inspect", "--pool", p, "--no-digest", "--json")[1])["needs_recovery"] is False
    assert errs["pmem"] == errs["shm"]  # the same words on both tiers
    assert "inspect/eval do" not in errs["pmem"]


def test_readers_refused_by_a_trainers_lock_are_not_told_to_open_read_only(pool, tmp_path):
    with MemoryPool.open(pool[0]):  # this process is the writer
        for argv in (["eval"], ["export", "--out", tmp_path / "x.pt"], ["inspect"]):
            code, _, err = run_main(argv[0], "--pool", pool[0], *argv[1:])
            assert_clean_error(code, err, 5, "is being trained", "wait until training stops")
            assert "open read-only" not in err and "inspect/eval do" not in err


# --------------------------------------------------------------------------- output noise


def test_torchs_is_fx_tracing_notice_is_not_printed_by_any_command(pool):
    # the reference: without dlrm_cxl's filter, making a TorchRec KJT prints it (so this test can fail)
    ref = subprocess.run([sys.executable, "-c",
                          "import torch; from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as K; "
                          "K.from_lengths_sync(keys=['a'], values=torch.tensor([1]), lengths=torch.tensor([1]))"],
                         capture_output=True, text=True, timeout=120)
    assert "is_fx_tracing" in ref.stderr, ref.stderr
    for argv in (["eval", "--pool", pool[0]], ["train", "--pool", pool[0], "--steps", 3, "--data", TSV]):
        r = run_cli(*argv)
        assert r.returncode == 0, r.stderr
        assert "is_fx_tracing" not in r.stderr, r.stderr


def test_training_progress_off_a_terminal_is_plain_lines_not_a_redrawn_bar(tmp_path):
    """stderr is a pipe here, as in a log file: no tqdm bar and its carriage returns (a run
    shorter than the 10 s interval prints no progress line at all)."""
    r = run_cli("train", "--pool", tmp_path / "p", "--preset", "tiny", "--threads", "1", "--steps", 30)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "step/s" not in r.stderr, repr(r.stderr)
    assert "done: step 30" in r.stdout


# --------------------------------------------------------------------------- metrics and plot


def _metrics(p: Path) -> list[dict]:
    return [json.loads(line) for line in (p / "metrics.jsonl").read_text().splitlines()]


def test_train_records_every_step_once_in_metrics_jsonl_across_runs_and_crashes(tmp_path):
    p = tmp_path / "pool"
    code, out, err = run_main("train", "--pool", p, *TINY, "--steps", 8, "--eval-every", 4, "--json")
    assert code == 0, err
    summary = json.loads(out)
    lines = _metrics(p)
    steps = [d for d in lines if "loss" in d]
    assert [d["step"] for d in steps] == list(range(1, 9))
    # the summary's own numbers: mean loss of the last steps, the evaluations, the critical path
    assert np.mean([d["loss"] for d in steps]) == pytest.approx(summary["final_loss"], rel=1e-12)
    assert [(d["step"], d["eval"]) for d in lines if "eval" in d] == \
        [(e["step"], {k: v for k, v in e.items() if k != "step"}) for e in summary["eval"]]
    assert sum(d["checkpoint_ms"] for d in steps) == pytest.approx(
        summary["checkpoint"]["critical_ms_per_step"] * summary["checkpoint"]["steps"], rel=1e-9)
    assert all(d["samples_per_s"] > 0 for d in steps)
    assert lines[0]["run"]["start_step"] == 0 and lines[0]["run"]["steps"] == 8

    # lines a crashed run left beyond the pool's step (and a torn last line) go when a run resumes
    with open(p / "metrics.jsonl", "a") as f:
        for k in range(9, 13):
            f.write(json.dumps({"step": k, "loss": 99.0, "samples_per_s": 1.0}) + "\n")
        f.write('{"step": 13, "lo')
    assert run_main("train", "--pool", p, "--steps", 12)[0] == 0
    lines = _metrics(p)
    steps = [d["step"] for d in lines if "loss" in d]
    assert steps == list(range(1, 13)) and all(d["loss"] != 99.0 for d in lines if "loss" in d)
    assert [d["run"]["start_step"] for d in lines if "run" in d] == [0, 8]

    # a real crash, then the resume: still each step once
    r = run_cli("train", "--pool", p, "--steps", 20, "--threads", 1, "--no-progress", "--crash-at", "16:after-update")
    assert r.returncode == -9, r.stderr
    assert run_main("train", "--pool", p, "--steps", 20)[0] == 0
    steps = [d["step"] for d in _metrics(p) if "loss" in d]
    assert steps == list(range(1, 21)), steps


def test_an_shm_pool_records_its_metrics_in_its_pool_directory(tmp_path):
    p = tmp_path / "shm"
    assert run_main("train", "--pool", p, *TINY, "--tier", "shm", "--steps", 3)[0] == 0
    assert [d["step"] for d in _metrics(p) if "loss" in d] == [1, 2, 3]


def test_plot_draws_a_png_of_a_real_run_and_refuses_a_pool_without_metrics(tmp_path):
    from PIL import Image

    p = tmp_path / "pool"
    assert run_main("train", "--pool", p, *TINY, "--steps", 40, "--eval-every", 10)[0] == 0
    out = tmp_path / "loss.png"
    code, text, err = run_main("plot", "--pool", p, "--out", out)
    assert code == 0, err
    assert text == f"wrote {out}: loss, samples/s and eval AUC over steps 1..40 (40 steps, 4 evaluations)\n"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, len(data)
    with Image.open(out) as im:
        assert im.size == (900, 900)
        colors = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert len(colors) > 50  # lines, text, antialiasing: not a blank canvas
    code, js, _ = run_main("plot", "--pool", p, "--out", tmp_path / "b.png", "--json")
    assert code == 0 and json.loads(js)["steps"] == 40 and json.loads(js)["evals"] == 4

    # a pool with no metrics (made by import; or trained before metrics were recorded)
    (p / "metrics.jsonl").unlink()
    code, _, err = run_main("plot", "--pool", p, "--out", tmp_path / "c.png")
    assert_clean_error(code, err, 2, "holds no training metrics (no metrics.jsonl)", "dlrm-cxl train --pool")
    assert not (tmp_path / "c.png").exists()
    code, _, err = run_main("plot", "--pool", tmp_path / "nowhere", "--out", tmp_path / "c.png")
    assert_clean_error(code, err, 3, "is not a pool")


# --------------------------------------------------------------------------- sizes


def _allocated(paths) -> int:
    return sum(os.stat(f).st_blocks * 512 for f in paths if f.is_file())


def test_inspect_shows_the_footprint_by_part_on_disk_and_in_memory(tmp_path):
    import memory_pool

    for tier in ("pmem", "shm"):
        p = tmp_path / tier
        assert run_main("train", "--pool", p, *TINY, "--tier", tier, "--steps", 5)[0] == 0
        info = json.loads(run_main("inspect", "--pool", p, "--json", "--no-digest")[1])
        fp = info["footprint"]
        storage = Path(info["storage_dir"])
        tables = sorted((storage / "tables").glob("*.bin"))
        state = [f for f in tables if f.name.endswith(".adagrad.bin")]
        medium, other = ("memory", "disk") if tier == "shm" else ("disk", "memory")
        # the reference: the files themselves, measured here
        assert fp["parts"]["tables"][medium] == _allocated(set(tables) - set(state)) > 0
        assert fp["parts"]["optimizer_state"][medium] == _allocated(state) > 0
        assert fp["parts"]["journal"][medium] == _allocated((storage / "journal").rglob("*")) > 0
        assert fp["parts"]["tables"][other] == fp["parts"]["journal"][other] == 0
        assert fp["disk"] + fp["memory"] == sum(b["disk"] + b["memory"] for b in fp["parts"].values())
        if tier == "shm":  # the region in /dev/shm is RAM: all of it is counted, in memory
            assert str(storage).startswith(str(memory_pool.tiers.shm_root()))
            assert fp["memory"] == _allocated(storage.rglob("*"))
            assert fp["parts"]["other"]["disk"] > 0  # pool.json, LOCK, metrics.jsonl in --pool
        code, text, _ = run_main("inspect", "--pool", p, "--no-digest")
        assert re.search(r"^size: [\d.]+ MB on disk, [\d.]+ MB in memory", text, re.M), text
        assert re.search(rf"^  journal +[\d.]+ MB in {medium}$" if tier == "shm" else
                         r"^  journal +[\d.]+ MB on disk$", text, re.M), text


def test_inspect_of_an_sgd_pool_lists_its_tables_without_optimizer_state(tmp_path):
    p = tmp_path / "sgd"
    assert run_main("train", "--pool", p, *TINY, "--embedding-optimizer", "sgd", "--steps", 1)[0] == 0
    code, text, _ = run_main("inspect", "--pool", p, "--no-digest")
    assert "tables: 26 embedding tables, no optimizer state (SGD) (26 tables in the pool)" in text, text
    info = json.loads(run_main("inspect", "--pool", p, "--no-digest", "--json")[1])
    assert all(t["optimizer_state"] == [] for t in info["embedding_tables"]) and len(info["embedding_tables"]) == 26
