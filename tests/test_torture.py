"""The crash-torture tools, run as CI runs them: their summaries must show bit-exact kills that
really landed mid-run (not kills after the end, not kills that left nothing to roll back).

``tools/torture.py --quick``: power-sim, pmem and shm, 3 trials each (~40-50 s on 2 cores).
``tools/torture_distributed.py --quick --trials 1``: one SIGKILLed rank of a 2-process torchrun
job (~30 s). The long modes are documented in the tools' docstrings.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import tool

REPO = Path(__file__).resolve().parents[1]

FINAL_RE = re.compile(r"^(?P<label>[\w-]+): (?P<trials>\d+) trials, (?P<exact>\d+) bit-exact, (?P<diverged>\d+) "
                      r"diverged, (?P<rolled>\d+) rolled back >= 1 step \((?P<pct>\d+%|-)\), (?P<after>\d+) after end "
                      r"\(not counted\)(?P<rest>.*)$", re.M)


def _run(*args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc


def _summaries(stdout: str) -> dict[str, re.Match]:
    return {m.group("label"): m for m in FINAL_RE.finditer(stdout)}


def test_torture_quick_reports_mid_run_rollbacks_on_every_tier():
    proc = _run(str(REPO / "tools" / "torture.py"), "--quick")
    out = proc.stdout
    s = _summaries(out)
    assert set(s) == {"power-sim", "pmem", "shm", "torture"}, out
    total = s["torture"]
    assert int(total["trials"]) == 9 and int(total["exact"]) == 9 and int(total["diverged"]) == 0, out
    assert int(total["rolled"]) >= 1, out  # not vacuous: at least one kill undid a step
    assert out.rstrip().endswith(total.group(0)), "the final line comes last"
    for tier in ("power-sim", "pmem", "shm"):
        m = s[tier]
        assert (m["trials"], m["exact"], m["diverged"]) == ("3", "3", "0"), m.group(0)
        assert re.search(r"rolled-back steps per trial \{[0-9:, ]+\}", m["rest"]), m.group(0)
        assert "final bit-exact" in m["rest"], m.group(0)
        rows = int(re.search(r"rows restored in (\d+)", m["rest"]).group(1))
        if tier != "shm":
            # journaled tiers: the rows of an unfinished step never reached durable media
            assert rows == 0, m.group(0)
        else:
            assert rows <= 3
        kills = [line for line in out.splitlines() if line.startswith(f"[{tier}] trial ")]
        assert len(kills) == 3 and all(line.endswith("bit-exact") for line in kills), out
        after = [line for line in out.splitlines() if line.startswith(f"[{tier}] after end")]
        assert len(after) == int(m["after"]), out
    hist = re.search(r"^rolled-back steps per trial: \{([0-9:, ]*)\}", out, re.M)
    assert hist and sum(int(v) for v in re.findall(r": (\d+)", hist.group(1))) == 9, out
    assert "DIVERGED" not in out and "MISMATCH" not in out, out


def test_a_kill_before_a_resumed_runs_first_step_is_checked_but_not_counted_as_a_trial():
    t = tool("torture")

    def kill(start, completed, lost=(), after_end=False):
        return t.Kill("shm", 1, 0.02, -9, start_step=start, completed=completed, after_end=after_end,
                      lost_steps=list(lost), bit_exact=True)

    early = kill(28, 28)                       # banner of a run resumed at 28, no step seen, nothing lost
    mid = kill(28, 31, lost=[32])              # three steps in: step 32 rolled back
    first_step_lost = kill(28, 28, lost=[29])  # its first step in flight, and rolled back: a trial
    end = kill(0, 40, after_end=True)
    assert early.before_first_step and not mid.before_first_step and not first_step_lost.before_first_step
    assert not end.before_first_step  # (counted as after the end, not twice)
    r = t.TierResult("shm", 2, kills=[early, mid, first_step_lost, end])
    assert r.trials == [mid, first_step_lost]
    c = r.counts()
    assert (c["trials"], c["rolled_back"], c["after_end"], c["before_first_step"]) == (2, 2, 1, 1)
    line = t.summary_line("shm", c)
    m = FINAL_RE.match(line)
    assert m and m["trials"] == "2" and m["pct"] == "100%" and m["after"] == "1", line
    assert "1 before the run's first step (not counted)" in m["rest"], line


def test_torture_with_small_segments_is_bit_exact_through_write_backs_and_the_applied_mark():
    """64 KiB journal segments, each written back into the images as it is sealed, a compaction
    every 256 KiB: on pmem the kills land between write-backs, during them and during
    compactions, and opening after them replays only what follows the applied mark; power-sim
    (no passes, no mark) replays everything."""
    env = {"DLRM_CXL_SEGMENT_MB": "0.0625", "DLRM_CXL_APPLY_MB": "0.0625", "DLRM_CXL_COMPACT_MB": "0.25"}
    proc = _run(str(REPO / "tools" / "torture.py"), "--quick", "--tiers", "pmem,power-sim", env=env)
    s = _summaries(proc.stdout)
    for tier in ("pmem", "power-sim"):
        assert (s[tier]["trials"], s[tier]["exact"], s[tier]["diverged"]) == ("3", "3", "0"), proc.stdout
    assert "DIVERGED" not in proc.stdout and "MISMATCH" not in proc.stdout, proc.stdout


def test_torture_distributed_one_killed_rank_is_bit_exact():
    proc = _run(str(REPO / "tools" / "torture_distributed.py"), "--quick", "--trials", "1", "--min-rolled-back", "0")
    s = _summaries(proc.stdout)
    m = s.get("torture-distributed")
    assert m is not None, proc.stdout
    assert (m["trials"], m["exact"], m["diverged"]) == ("1", "1", "0"), proc.stdout
    trial = [line for line in proc.stdout.splitlines() if line.startswith("trial 1/1: SIGKILL rank ")]
    assert trial and trial[0].endswith("bit-exact") and "2 incarnations" in trial[0], proc.stdout
