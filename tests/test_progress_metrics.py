"""The small modules behind issue 28's output: the progress lines written off a terminal
(dlrm_cxl/progress.py), the metrics file and its reader (dlrm_cxl/metrics.py), and the grouping
of a pool's tables (dlrm_cxl/footprint.py). The CLI around them: tests/test_newcomer.py."""

from __future__ import annotations

import io
import json
import os

import pytest

from dlrm_cxl.errors import NoMetricsError
from dlrm_cxl.footprint import group_tables
from dlrm_cxl.metrics import METRICS_FILE, MetricsLog, read_metrics, trim_metrics
from dlrm_cxl.progress import ProgressLines, progress_bar


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_progress_off_a_terminal_is_a_plain_line_every_interval():
    out, clock = io.StringIO(), FakeClock()
    bar = ProgressLines(total=100, initial=20, file=out, interval=10, clock=clock)
    for k in range(21, 56):  # a step a second: 35 s
        clock.t += 1
        bar.set_postfix(loss=f"{1 / k:.4f}", samples_s="1,000")
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # at 10, 20, 30 s (steps 30, 40, 50), then the last step at close
    assert [line.split(":")[0] for line in lines] == ["step 30/100 (30%)", "step 40/100 (40%)", "step 50/100 (50%)",
                                                      "step 55/100 (55%)"]
    assert lines[0] == "step 30/100 (30%): loss 0.0333, samples/s 1,000, 10 s elapsed, ~70 s left"
    assert bar.lines == 4


def test_a_run_shorter_than_the_interval_prints_no_progress_and_a_terminal_gets_tqdm():
    out, clock = io.StringIO(), FakeClock()
    bar = ProgressLines(total=5, file=out, clock=clock)
    for _ in range(5):
        clock.t += 1
        bar.update(1)
    bar.close()
    assert out.getvalue() == ""
    assert isinstance(progress_bar(10, file=io.StringIO()), ProgressLines)
    from tqdm import tqdm

    main, sub = os.openpty()
    with os.fdopen(sub, "w") as tty:
        bar = progress_bar(10, file=tty)
        try:
            assert isinstance(bar, tqdm)
        finally:
            bar.close()
    os.close(main)
    with pytest.raises(ValueError):
        ProgressLines(10, interval=0)


def _log(d, start, steps=10, **kw) -> MetricsLog:
    return MetricsLog(d, start_step=start, steps=steps, batch_size=8, tier="pmem", **kw)


def test_a_resumed_run_drops_the_steps_it_trains_again_and_a_reader_keeps_the_last_value_per_step(tmp_path):
    m = _log(tmp_path, 0)
    for k in range(1, 7):
        m.step(k, loss=float(k))
    m.evaluation(4, {"auc": 0.5, "logloss": 0.7, "samples": 8})
    m.close()
    path = tmp_path / METRICS_FILE
    with open(path, "a") as f:
        f.write('{"step": 7, "loss"')  # a crash mid-line
    # the pool resumes at step 3: steps 4.. (and the eval after step 4) are trained again
    m = _log(tmp_path, 3)
    for k in range(4, 6):
        m.step(k, loss=10.0 * k)
    m.close()
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [d["step"] for d in docs if "step" in d] == [1, 2, 3, 4, 5]
    assert [d["run"]["start_step"] for d in docs if "run" in d] == [0, 3]
    got = read_metrics(tmp_path)
    assert got.steps == [1, 2, 3, 4, 5] and got.loss == [1.0, 2.0, 3.0, 40.0, 50.0] and got.evals == []
    # a reader alone (a file no run trimmed): the last line of a step wins, bad lines are skipped
    with open(path, "a") as f:
        f.write("not json\n" + json.dumps({"step": 5, "loss": 55.0}) + "\n"
                + json.dumps({"step": 5, "eval": {"auc": 0.9}}) + "\n")
    got = read_metrics(tmp_path)
    assert got.loss[-1] == 55.0 and got.evals == [(5, {"auc": 0.9})] and got.checkpoint_ms[-1] is None
    size = path.stat().st_size
    assert trim_metrics(path, 5) == 0  # a file with nothing to drop at its end is left as it is
    assert path.stat().st_size == size   # (a bad line further up: not one this writes, read_metrics skips it)
    # (from the end: step 5's eval and loss, the bad line, the run's step 5)
    assert trim_metrics(path, 4) == 4 and read_metrics(tmp_path).steps == [1, 2, 3, 4]


def test_the_checkpoint_time_of_a_step_is_the_checkpointers_critical_time_in_it(tmp_path):
    crit = iter([1.0, 1.25, 1.5, 3.0])
    clock = FakeClock()
    m = _log(tmp_path, 0, critical_seconds=lambda: next(crit), clock=clock)
    clock.t += 0.5
    m.step(1, 0.7)
    clock.t += 2
    m.evaluation(1, {"auc": 0.5})   # the eval's time does not count in step 2's throughput
    clock.t += 0.25
    m.step(2, 0.6)
    clock.t += 1
    m.step(3, 0.5)
    m.close()
    got = read_metrics(tmp_path)
    assert got.checkpoint_ms == pytest.approx([250.0, 250.0, 1500.0])
    assert got.samples_per_s == pytest.approx([16.0, 32.0, 8.0])


def test_a_directory_without_metrics_is_a_typed_error_with_a_hint(tmp_path):
    with pytest.raises(NoMetricsError) as ei:
        read_metrics(tmp_path)
    assert ei.value.exit_code == 2 and "dlrm-cxl train" in ei.value.hint
    (tmp_path / METRICS_FILE).write_text(json.dumps({"run": {"start_step": 0}}) + "\n")
    with pytest.raises(NoMetricsError, match="records no training step"):
        read_metrics(tmp_path)


def test_a_metrics_file_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path):
    (tmp_path / METRICS_FILE).mkdir()  # (something in its place: every write fails)
    warnings = []
    m = _log(tmp_path, 0, warn=warnings.append)
    m.step(1, 0.5)
    m.close()
    assert len(warnings) == 1 and "no longer recorded" in warnings[0]


def test_each_embedding_table_is_grouped_with_its_optimizer_state():
    from dlrm_cxl.model import state_table_name  # (the name the trainer gives a state table)

    def t(name, n=4, dim=8):
        return {"name": name, "num_embeddings": n, "embedding_dim": dim, "bytes": 4 * n * dim}

    tables = [t("a"), t("b"), t(state_table_name("a"), dim=1), t(state_table_name("b"), dim=1), t("extra")]
    g = group_tables(tables, {"model": {"feature_names": ["a", "b"]}})
    assert [(e["name"], [s["name"] for s in e["optimizer_state"]], e["bytes_with_state"]) for e in g["embedding"]] \
        == [("a", [state_table_name("a")], 128 + 16), ("b", [state_table_name("b")], 128 + 16)]
    assert [e["name"] for e in g["other"]] == ["extra"]
    # a pool made through the API (no model in its meta): the same grouping by name
    g = group_tables(tables, {})
    assert [e["name"] for e in g["embedding"]] == ["a", "b", "extra"] and g["other"] == []
