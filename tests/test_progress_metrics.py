"""The small modules behind issue 28's output: the progress lines written off a terminal
(dlrm_cxl/progress.py). The CLI around them: tests/test_newcomer.py."""

from __future__ import annotations

import io
import os

import pytest

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
