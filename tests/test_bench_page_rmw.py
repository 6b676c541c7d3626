"""tools/bench_page_rmw.py: it runs, reports per page and per row, and leaves no file behind."""

from __future__ import annotations

import pytest

from helpers import tool as load_tool


def _tool():
    return load_tool("bench_page_rmw")


def test_the_page_rmw_bench_stores_the_rows_in_place_and_cleans_up(tmp_path, capsys, monkeypatch):
    tool = _tool()
    seen = {}
    real = tool.in_place

    def in_place(path, pages, rows, ph):
        real(path, pages, rows, ph)
        seen["bytes"] = path.read_bytes()   # (before main removes it)
        seen["pages"] = pages

    monkeypatch.setattr(tool, "in_place", in_place)
    assert tool.main(["--dir", str(tmp_path), "--mib", "4", "--pages", "50", "--rows", "3", "--packed-mib", "8"]) == 0
    out = capsys.readouterr().out
    assert "us of the machine's CPU a page" in out and "packed rows do" in out
    assert list(tmp_path.iterdir()) == []
    # the rows stored went to the image, each page's first three rows, and nothing else changed
    page = tool.PAGE
    for p in seen["pages"][:5].tolist():
        assert seen["bytes"][p * page:p * page + 3 * tool.ROW] == b"\x07" * (3 * tool.ROW)
        assert seen["bytes"][p * page + 3 * tool.ROW:p * page + 4 * tool.ROW] != b"\x07" * tool.ROW


def test_the_page_rmw_bench_refuses_more_rows_than_a_page_holds(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _tool().main(["--dir", str(tmp_path), "--mib", "4", "--rows", "17"])
    assert exc.value.code == 2 and "--rows must be 1..16" in capsys.readouterr().err


def test_the_page_rmw_bench_refuses_a_dir_that_is_not_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _tool().main(["--dir", str(tmp_path / "absent"), "--mib", "4", "--pages", "50"])
    assert exc.value.code == 2 and "is not a directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
