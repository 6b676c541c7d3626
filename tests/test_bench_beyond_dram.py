"""tools/bench_beyond_dram.py --interleave: the variants' processes run in turn, one at a time,
and each variant's time leaves out the time it was stopped."""

from __future__ import annotations

import sys
import time

import pytest

from helpers import tool as load_tool


def test_a_gates_clock_leaves_out_the_time_it_waited_for_its_turn(monkeypatch, capsys):
    tool = load_tool("bench_beyond_dram")

    class SlowParent:
        def readline(self):
            time.sleep(0.3)   # (the other variants' turns)
            return "go\n"

    monkeypatch.setattr(sys, "stdin", SlowParent())
    gate = tool.Gate(4)
    c0 = time.perf_counter() - gate.clock()
    for k in range(1, 10):
        gate.at(k)
    # three stretches began (steps 1, 5, 9), each after a wait the clock does not count
    assert capsys.readouterr().out.split() == ["AT", "1", "AT", "5", "AT", "9"]
    assert gate.waited >= 0.9
    assert abs((time.perf_counter() - gate.clock()) - c0 - gate.waited) < 0.05


def test_interleaved_variants_take_turns_of_n_steps_and_each_reports_its_own_run(tmp_path):
    tool = load_tool("bench_beyond_dram")
    children = []
    for v in ("memory", "pmem+cache"):
        cmd = [sys.executable, tool.__file__, "--one", f"{v}@2", "--preset", "small", "--warmup", "1",
               "--steps", "4", "--root", str(tmp_path), "--interleave", "2", "--threads", "1"]
        children.append((v, cmd, None))
    results, turns = tool.run_interleaved(children)
    # each brought alone to its first step, then stretches of 2 steps in turn, every other
    # cycle in reverse order: the second variant runs twice in a row at each reversal
    assert turns == [("memory", 1), ("pmem+cache", 1),
                     ("memory", 3), ("pmem+cache", 3), ("pmem+cache", 5), ("memory", 5)]
    assert {r["variant"] for r in results.values()} == {"memory", "pmem+cache"}
    assert all(r["samples_per_s"] > 0 for r in results.values())
    assert results["pmem+cache"]["cache"]["rows_needed"] > 0 and "cache" not in results["memory"]
    assert list(tmp_path.iterdir()) == []   # (each variant's pool destroyed)


def test_a_malformed_variant_environment_is_refused_before_anything_runs(tmp_path, capsys):
    tool = load_tool("bench_beyond_dram")
    assert tool.variant_env("pmem+cache[A=1;B=x=2]") == {"A": "1", "B": "x=2"}
    assert tool.variant_env("pmem+cache") == {}
    for bad in ("pmem+cache[DLRM_CXL_COMPACT_MB]", "pmem+cache[A=1", "pmem+cache[=1]"):
        with pytest.raises(SystemExit) as e:
            tool.main(["--preset", "small", "--variants", f"memory,{bad}", "--root", str(tmp_path)])
        assert e.value.code == 2
        assert "NAME=value" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_each_child_has_a_pool_of_its_own_and_a_failed_runs_pools_are_removed(tmp_path):
    from memory_pool import MemoryPool

    tool = load_tool("bench_beyond_dram")
    children = [(f"pmem+cache@{k}", [], None) for k in (1, 2)]
    paths = [tool.pool_dir(tmp_path, name) for name, _, _ in children]
    assert paths[0] != paths[1]   # (two lookaheads of one variant, at once under --interleave)
    for p in paths:
        MemoryPool.create(p, tier="pmem").close()
    tool.remove_pools(tmp_path, children)
    assert list(tmp_path.iterdir()) == []
