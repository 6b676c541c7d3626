#!/usr/bin/env python3
"""The architecture rules of issue #27, checked over the product packages (``memory_pool``,
``checkpointing``, ``dlrm_cxl``):

1. **private reaches**: no module uses another object's private member, ``obj._x`` where ``obj``
   is not ``self``, ``cls`` or ``super()`` (a module's private name counts too:
   ``module._x``, ``from module import _x``); dunder names are public. A private name of another
   library that cannot be avoided goes into ``ALLOWED`` by name (none is needed today).
2. **import cycles** among the project's modules, counting every import: at module level, inside
   a function and under ``if TYPE_CHECKING:``.
3. **sizes**: no module over ``MAX_MODULE_LINES`` lines; ``class MemoryPool`` under
   ``MAX_POOL_CLASS_LINES``.
4. **tier literals**: ``"shm"``, ``"pmem"``, ``"power-sim"``, ``"dram"`` appear only in the tier
   module and the CLI's parser (``TIER_LITERAL_FILES``).

``python tools/check_arch.py`` prints one line per finding and exits 1 if there is any (0: none).
``tests/test_architecture.py`` runs the same checks, so the rules are kept.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("memory_pool", "checkpointing", "dlrm_cxl")

MAX_MODULE_LINES = 600
MAX_POOL_CLASS_LINES = 400   # (strictly under)

# Private members of other libraries the product cannot do without, each as (the expression
# before the dot, the name): ("torch", "_C") would allow ``torch._C``. None today.
ALLOWED: frozenset[tuple[str, str]] = frozenset()

TIER_LITERAL = re.compile(r'"shm"|"pmem"|"power-sim"|"dram"')
TIER_LITERAL_FILES = {"memory_pool/tiers.py", "dlrm_cxl/cli_args.py"}


@dataclass(frozen=True, order=True)
class Finding:
    rule: str
    where: str   # path:line (or a module's name for a cycle)
    what: str

    @property
    def path(self) -> str:
        return self.where.split(":", 1)[0]

    def __str__(self) -> str:
        return f"{self.rule}: {self.where}: {self.what}"


def product_files(root: Path = REPO) -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# -- 1. private reaches
def private_reaches(root: Path = REPO) -> list[Finding]:
    out = []
    for path in product_files(root):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                v = node.value
                if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                    continue
                if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                    continue
                if (ast.unparse(v), node.attr) in ALLOWED:
                    continue
                out.append(Finding("private", f"{_rel(path, root)}:{node.lineno}",
                                   f"{ast.unparse(v)}.{node.attr}"))
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if _private(alias.name):
                        mod = "." * node.level + (node.module or "")
                        out.append(Finding("private", f"{_rel(path, root)}:{node.lineno}",
                                           f"from {mod} import {alias.name}"))
    return out


# -- 2. import cycles
def _imports(path: Path, modules: set[str], root: Path) -> dict[str, int]:
    """The project modules ``path`` imports (anywhere in it) -> the line of the first import."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        if name in modules and name != me:
            found.setdefault(name, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                add(sub if sub in modules else target, node.lineno)
    return found


def import_cycles(root: Path = REPO) -> list[Finding]:
    files = {module_name(p, root): p for p in product_files(root)}
    graph = {m: _imports(p, set(files), root) for m, p in files.items()}
    # Tarjan's strongly connected components: each one of more than one module holds a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for m in sorted(graph):
        if m not in index:
            visit(m)
    out = []
    for comp in sorted(sccs):
        members = set(comp)
        edges = ", ".join(f"{a} -> {b} ({_rel(files[a], root)}:{line})"
                          for a in comp for b, line in sorted(graph[a].items()) if b in members)
        out.append(Finding("cycle", comp[0], f"import cycle among {', '.join(comp)}: {edges}"))
    return out


# -- 3. sizes
def sizes(root: Path = REPO) -> list[Finding]:
    out = []
    for path in product_files(root):
        text = path.read_text()
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES:
            out.append(Finding("size", f"{_rel(path, root)}:1", f"{n} lines (at most {MAX_MODULE_LINES})"))
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef) and node.name == "MemoryPool":
                lines = node.end_lineno - node.lineno + 1
                if lines >= MAX_POOL_CLASS_LINES:
                    out.append(Finding("size", f"{_rel(path, root)}:{node.lineno}",
                                       f"class MemoryPool is {lines} lines (under {MAX_POOL_CLASS_LINES})"))
    return out


# -- 4. tier literals (what `grep -rn '"shm"\|"pmem"\|"power-sim"\|"dram"' memory_pool checkpointing
#    dlrm_cxl` shows: every text file of the packages, not only the Python ones)
def tier_literals(root: Path = REPO) -> list[Finding]:
    out = []
    for path in sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts):
        rel = _rel(path, root)
        if rel in TIER_LITERAL_FILES:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if TIER_LITERAL.search(line):
                out.append(Finding("tier-literal", f"{rel}:{i}", line.strip()))
    return out


CHECKS = {"private": private_reaches, "cycle": import_cycles, "size": sizes, "tier-literal": tier_literals}


def findings(root: Path = REPO) -> list[Finding]:
    return [f for check in CHECKS.values() for f in check(root)]


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout to check (default: this one)")
    ap.add_argument("--check", choices=sorted(CHECKS), action="append", help="only these checks (repeatable)")
    args = ap.parse_args(argv)
    found = [f for name in (args.check or CHECKS) for f in CHECKS[name](args.repo.resolve())]
    for f in found:
        print(f)
    print(f"{len(found)} finding{'s' if len(found) != 1 else ''}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
