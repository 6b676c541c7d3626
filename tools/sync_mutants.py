#!/usr/bin/env python3
"""Mutation check of the syncs: each sync call site of the durability code disabled in turn, and
the power-loss tests run against it. Every mutant must be caught (some test fails).

    python tools/sync_mutants.py [--list] [--only SUBSTRING] [--tests TESTS] [--jobs 1]

A site is a call of ``fileio.fdatasync``, ``fileio.fsync``, ``fsync_dir`` (and ``FileRegion.sync``,
the image's ``fdatasync``, through ``fileio.fdatasync``) in ``memory_pool/`` and ``checkpointing/``,
plus the layer's own sync of its undo log (``memory_pool/fileio.py``'s ``sync_log``, and each call
of it: after a sync's markers, and before a real sync, ``_log_first``). A mutant is
a copy of the repository's Python packages with that one call replaced by a call that does
nothing (its arguments still evaluated), run with ``PYTHONPATH`` pointing at the copy.

The default tests (``--tests``): ``tests/test_power_loss.py`` (the layer's own tests, the
crash-state sweep on power-sim and pmem, and -- as root with loop devices -- the real power
loss under ext4) plus ``tests/test_pool.py``'s power-sim SIGKILL test, ``tests/test_overlay.py`` and
``tests/test_journal.py`` and the crash matrix of ``tests/test_recovery.py``.

Output: one line per site, ``caught`` with the first failing test, or ``MISSED``; the exit status
is 1 when any mutant is missed. It takes a few minutes a site on two cores.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("memory_pool", "checkpointing", "dlrm_cxl")
SCANNED = ("memory_pool", "checkpointing")
CALL = re.compile(r"\b(fileio\.fdatasync|fileio\.fsync_dir|fileio\.fsync|fsync_dir|os\.fdatasync|sim\.sync_log)\(")
NOOP = "(lambda *_a, **_k: None)("
DEFAULT_TESTS = ["tests/test_power_loss.py", "tests/test_pool.py::test_power_sim_keeps_exactly_the_persisted_rows_after_sigkill",
                 "tests/test_overlay.py", "tests/test_journal.py",
                 "tests/test_recovery.py::test_crash_at_every_phase_then_recover_and_resume_is_bit_exact"]

__all__ = ["Site", "sites", "mutate", "main"]


@dataclass
class Site:
    path: str      # relative to the repository
    line: int      # 1-based
    call: str      # the callee
    text: str      # the line, stripped

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.call}"


def sites(repo: Path = REPO) -> list[Site]:
    """Every sync call site of the durability code."""
    out = []
    for pkg in SCANNED:
        for f in sorted((repo / pkg).glob("*.py")):
            rel = str(f.relative_to(repo))
            lines = f.read_text().splitlines()
            in_sync_log = False
            for i, line in enumerate(lines, 1):
                s = line.strip()
                if s.startswith("def "):
                    in_sync_log = s.startswith("def sync_log")
                if s.startswith(("#", "def ", "\"", "'")) or s.startswith("fsync_dir ="):
                    continue
                for m in CALL.finditer(line):
                    callee = m.group(1)
                    code = line[:m.start()]
                    if "#" in code:
                        continue  # in a comment
                    if rel == "memory_pool/fileio.py" and not in_sync_log and callee != "sim.sync_log":
                        continue  # the layer's own operations are the mechanism, not sites
                    if callee == "os.fdatasync" and rel != "memory_pool/fileio.py":
                        continue
                    out.append(Site(rel, i, callee, s))
    return out


def mutate(site: Site, dest: Path, repo: Path = REPO) -> None:
    """A copy of the packages and tests at ``dest`` with ``site``'s call disabled."""
    for pkg in PACKAGES + ("tests", "tools"):
        shutil.copytree(repo / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml",):
        shutil.copy(repo / f, dest / f)
    f = dest / site.path
    lines = f.read_text().splitlines(keepends=True)
    line = lines[site.line - 1]
    new, n = re.subn(re.escape(site.call) + r"\(", NOOP, line, count=1)
    if n != 1:
        raise RuntimeError(f"{site}: call not found in {line!r}")
    lines[site.line - 1] = new
    f.write_text("".join(lines))


def run_mutant(site: Site, tests: list[str], timeout: float) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="sync-mutant-") as d:
        mutate(site, Path(d))
        env_py = f"{d}"
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        import os

        env = {**os.environ, "PYTHONPATH": env_py}
        try:
            p = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return True, "timed out (counted as caught: the run did not pass)"
        failed = re.findall(r"^FAILED (\S+)", p.stdout, re.M)
        if p.returncode == 0:
            return False, ""
        return True, failed[0] if failed else f"pytest exited {p.returncode}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="list the sites and stop")
    ap.add_argument("--only", default=None, help="only sites whose 'path:line call' contains this")
    ap.add_argument("--tests", nargs="*", default=DEFAULT_TESTS)
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args(argv)
    found = [s for s in sites() if a.only is None or a.only in str(s)]
    if a.list:
        for s in found:
            print(f"{s}    {s.text}")
        return 0
    missed = 0
    for s in found:
        caught, by = run_mutant(s, a.tests, a.timeout)
        missed += not caught
        print(f"{'caught' if caught else 'MISSED'}  {s}  {by}", flush=True)
    print(f"sync-mutants: {len(found)} sites, {len(found) - missed} caught, {missed} missed")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
