"""The error hierarchy as a whole: ``dlrm_cxl.errors`` lists every error class of the project (the
pool's, re-exported, and the data/config/training ones it defines), each a ``DlrmCxlError`` with a
hint and an exit code, and its docstring table says exactly that. The lower layers never import
``dlrm_cxl``."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import dlrm_cxl.errors as errors
import memory_pool.errors as pool_errors

ALL = [getattr(errors, n) for n in errors.__all__]


def _table() -> dict[str, tuple[int, str]]:
    """The docstring's table: class -> (exit code, hint; continuation lines joined)."""
    rows: dict[str, list] = {}
    last = None
    for line in errors.__doc__.splitlines():
        m = re.match(r"^(\w+Error)\s+(\d+)\s+(.*)$", line)
        if m:
            last = m.group(1)
            rows[last] = [int(m.group(2)), m.group(3).strip()]
        elif last and re.match(r"^ {20,}\S", line):
            rows[last][1] += " " + line.strip()
        else:
            last = None
    return {k: (code, hint) for k, (code, hint) in rows.items()}


def test_every_error_is_a_dlrm_cxl_error_with_a_hint_and_an_exit_code():
    assert len(ALL) == len(set(ALL)) >= 20
    for cls in ALL:
        assert issubclass(cls, errors.DlrmCxlError), cls
        if cls is errors.DlrmCxlError:
            continue
        err = cls("message")
        assert err.hint.strip() and err.hint in str(err), cls
        assert isinstance(err.exit_code, int) and err.exit_code >= 1, cls
    for cls in (errors.DataFormatError, errors.ConfigMismatchError, errors.InvalidIdsError):
        assert issubclass(cls, ValueError)


def test_the_pool_errors_are_re_exported_and_none_is_missing():
    for name in pool_errors.__all__:
        assert getattr(errors, name) is getattr(pool_errors, name), name
        assert name in errors.__all__, name
    # Every DlrmCxlError subclass defined anywhere in the lower layer is listed here too.
    defined = {v for v in vars(pool_errors).values() if isinstance(v, type) and issubclass(v, pool_errors.DlrmCxlError)}
    assert defined <= set(ALL)
    # One hierarchy: the errors this module defines derive from the pool layer's base.
    assert errors.DlrmCxlError is pool_errors.DlrmCxlError
    for name in ("DataFormatError", "ConfigMismatchError"):
        assert not hasattr(pool_errors, name), f"{name} belongs to dlrm_cxl.errors, not the pool layer"


def test_the_docstring_table_lists_every_class_with_its_exit_code_and_hint():
    table = _table()
    assert set(table) == set(errors.__all__)
    for cls in ALL:
        code, hint = table[cls.__name__]
        assert code == cls.exit_code, cls
        if cls is not errors.DlrmCxlError:
            assert hint == cls.default_hint, (cls, hint)


@pytest.mark.parametrize("name", ["DataFormatError", "ConfigMismatchError", "TrainingDivergedError",
                                  "PoolCorruptError", "CompactionError"])
def test_the_cli_returns_the_exit_code_of_the_class(name, capsys, monkeypatch):
    from dlrm_cxl import cli

    cls = getattr(errors, name)

    def boom(args):
        raise cls("it broke")

    monkeypatch.setattr(cli, "_cmd_inspect", boom)
    assert cli.main(["inspect", "--pool", "nowhere"]) == cls.exit_code
    err = capsys.readouterr().err
    assert "it broke" in err and f"hint: {cls.default_hint}" in err


def test_the_lower_layers_never_import_dlrm_cxl():
    code = ("import sys, memory_pool, checkpointing, checkpointing.job\n"
            "bad = sorted(m for m in sys.modules if m == 'dlrm_cxl' or m.startswith('dlrm_cxl.'))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
