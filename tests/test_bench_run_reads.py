"""tools/bench_run_reads.py: it runs both paths on the same rows, checks them, and leaves no file behind."""

from __future__ import annotations

import pytest

from helpers import tool as load_tool


def test_the_run_reads_bench_reads_both_ways_and_cleans_up(tmp_path, capsys):
    assert load_tool("bench_run_reads").main(["--dir", str(tmp_path), "--mib", "4", "--rows", "2000",
                                              "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "mapped (faults)" in out and "bulk (direct reads)" in out and "us a row" in out
    assert list(tmp_path.iterdir()) == []


def test_the_run_reads_bench_refuses_more_rows_than_the_run_holds(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        load_tool("bench_run_reads").main(["--dir", str(tmp_path), "--mib", "1", "--rows", "5000"])
    assert exc.value.code == 2 and "--rows must be between 1 and the run's 4,096 rows" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
