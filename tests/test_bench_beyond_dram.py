"""tools/bench_beyond_dram.py --interleave: the variants' processes run in turn, one at a time,
and each variant's time leaves out the time it was stopped."""

from __future__ import annotations

import sys
import time

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
