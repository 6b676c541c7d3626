"""The architecture rules of issue #27 hold (tools/check_arch.py): no private reaches, no import
cycles (function-level and TYPE_CHECKING imports count), module and MemoryPool sizes, tier-name
literals only in the tier module and the CLI's parser. And the checker finds what it should."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import check_arch  # noqa: E402


@pytest.mark.parametrize("check", sorted(check_arch.CHECKS))
def test_the_product_keeps_the_rule(check):
    found = check_arch.CHECKS[check](REPO)
    assert not found, f"{len(found)} finding(s) of tools/check_arch.py:\n" + "\n".join(map(str, found))


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    for pkg in check_arch.PACKAGES:
        (root / pkg).mkdir(exist_ok=True)
        (root / pkg / "__init__.py").touch()
    return root


def test_private_reaches_are_found_and_own_members_are_not(tmp_path):
    root = _tree(tmp_path, {
        "memory_pool/a.py": """
            from .b import _helper, public
            from . import b

            class A:
                def __init__(self, other):
                    self._x = other._y          # reach: other._y
                    self.__dict__.update({})    # dunder: public
                    super()._init()             # own member through super()

                @classmethod
                def make(cls):
                    return cls._cache

            def f(t):
                return t._region.tensor, b._private(), t.region._dirty
            """,
        "memory_pool/b.py": """
            def _helper(): pass
            def public(): pass
            """,
    })
    found = sorted((f.where, f.what) for f in check_arch.private_reaches(root))
    assert found == [
        ("memory_pool/a.py:16", "b._private"),
        ("memory_pool/a.py:16", "t._region"),
        ("memory_pool/a.py:16", "t.region._dirty"),
        ("memory_pool/a.py:2", "from .b import _helper"),
        ("memory_pool/a.py:7", "other._y"),
    ]


def test_import_cycles_count_function_level_and_type_checking_imports(tmp_path):
    root = _tree(tmp_path, {
        "memory_pool/pool.py": "from .table import Table\n",
        "memory_pool/table.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from .pool import MemoryPool
            """,
        "dlrm_cxl/a.py": "def f():\n    from checkpointing import b\n",
        "checkpointing/__init__.py": "from .b import x\n",
        "checkpointing/b.py": "from dlrm_cxl.a import f\nx = 1\n",
        "checkpointing/c.py": "import memory_pool.pool\n",   # one way only: no cycle
    })
    cycles = check_arch.import_cycles(root)
    assert sorted(f.what.split(":")[0] for f in cycles) == [
        "import cycle among checkpointing.b, dlrm_cxl.a",
        "import cycle among memory_pool.pool, memory_pool.table",
    ]


def test_sizes_and_tier_literals(tmp_path):
    pool = "class MemoryPool:\n" + "    x = 1\n" * 399
    root = _tree(tmp_path, {
        "memory_pool/pool.py": pool,
        "dlrm_cxl/big.py": "x = 1\n" * 601,
        "checkpointing/ok.py": "x = 1\n" * 600,
        "memory_pool/tiers.py": 'T = ("dram", "shm", "pmem", "power-sim")\n',
        "dlrm_cxl/cli_args.py": 'choices = ["shm"]\n',
        "dlrm_cxl/model.py": 'x = 1\nif tier == "power-sim":\n    pass\n',
        "checkpointing/notes.txt": 'mentions "pmem"\n',
    })
    assert sorted(str(f) for f in check_arch.sizes(root)) == [
        "size: dlrm_cxl/big.py:1: 601 lines (at most 600)",
        "size: memory_pool/pool.py:1: class MemoryPool is 400 lines (under 400)",
    ]
    assert sorted(f.where for f in check_arch.tier_literals(root)) == [
        "checkpointing/notes.txt:1", "dlrm_cxl/model.py:2"]


def test_the_script_exits_non_zero_on_findings(tmp_path):
    root = _tree(tmp_path, {"memory_pool/a.py": "def f(t):\n    return t._x\n"})
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "check_arch.py"), "--repo", str(root)],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "private: memory_pool/a.py:2: t._x" in bad.stdout
    (root / "memory_pool" / "a.py").write_text("def f(t):\n    return t.x\n")
    good = subprocess.run([sys.executable, str(REPO / "tools" / "check_arch.py"), "--repo", str(root)],
                          capture_output=True, text=True)
    assert good.returncode == 0 and good.stdout == "", good.stdout


def test_checkpointing_uses_only_memory_pools_public_names_and_its_transaction():
    """checkpointing imports from ``memory_pool`` only what its ``__all__`` exports, and writes the
    journal only through ``memory_pool.Transaction`` (no record types, no END, no flush)."""
    import ast

    import memory_pool

    root = Path(__file__).resolve().parents[1] / "checkpointing"
    bad = []
    for f in sorted(root.glob("*.py")):
        text = f.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("memory_pool"):
                if node.module != "memory_pool":
                    bad.append(f"{f.name}:{node.lineno}: from {node.module}")
                bad += [f"{f.name}:{node.lineno}: {a.name}" for a in node.names if a.name not in memory_pool.__all__]
            elif isinstance(node, ast.Import):
                bad += [f"{f.name}:{node.lineno}: import {a.name}" for a in node.names if a.name.startswith("memory_pool.")]
        for word in ("RecordType", ".end(", ".flush("):
            if word in text:
                bad.append(f"{f.name}: {word}")
    assert bad == []
