#!/usr/bin/env python3
"""Crash-state checker: the states a power loss may leave, each recovered and compared bit for bit.

    python tools/crash_states.py [--tier power-sim|pmem] [--steps 24] [--kills 12] [--states 8]
                                 [--seed 0] [--pool-dir DIR] [--no-resume]
    python tools/crash_states.py --quick      # what the test suite runs: 3 kills x 4 states

How it works
------------
1. **References.** One pool is stepped ``train --steps 0, 1, ... N`` in one process and the
   ``state_digest`` after every step is kept (``tools/torture.py``'s stepping); the digest of an
   uninterrupted ``train --steps N`` must equal the last one.
2. **Kills.** A fresh pool trains ``tiny`` with the journal, the compaction and the row overlay
   made small (``DLRM_CXL_SEGMENT_MB``, ``DLRM_CXL_COMPACT_MB``, ``DLRM_CXL_RUNS_MB``), so that
   segments roll over, compactions write images and runs, runs are cleaned and the journal's START
   moves within a few steps; it SIGKILLs itself at ``--crash-at K:PHASE`` (a random step K and
   phase, ``random`` included). Every file operation it made went through ``memory_pool/fileio.py``,
   whose undo log says which of them were never synced.
3. **States.** The killed pool is copied once per state, and each copy gets a different power
   loss (``fileio.power_on`` with a :class:`~memory_pool.fileio.Lose`): nothing unsynced reached
   the disk; the first *k* unsynced operations did (prefixes at evenly spread *k*); random subsets
   of them did, writes torn at 4 KiB or 512 B blocks. POSIX allows each of these: unsynced writes
   may reach the disk in any order and in part.
4. **Checks.** ``dlrm-cxl recover --json`` on each state must succeed (a power loss is not damage:
   exit 0), at a committed step no more than 2 behind the step the trainer died in, with a
   ``state_digest`` equal to the reference's at that step. The "nothing unsynced" state of each kill
   is then trained on to N, and its digest must equal the uninterrupted run's.

Exit status: 0 when every state recovered bit-exactly, 1 otherwise, 2 when the references
disagree. The last line reads ``crash-states: S states from K kills, S bit-exact, 0 failed``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from checkpointing.crash import STEP_PHASES  # noqa: E402
from memory_pool import fileio  # noqa: E402
from torture import Cli, parse_digest  # noqa: E402

__all__ = ["SMALL_THRESHOLDS", "State", "Sweep", "sweep", "main"]

# Thresholds that make every ordering path of the journaled tiers run within a few tiny steps.
SMALL_THRESHOLDS = {"DLRM_CXL_SEGMENT_MB": "0.0625", "DLRM_CXL_COMPACT_MB": "0.25", "DLRM_CXL_RUNS_MB": "0.05"}
BEHIND = 2   # a recovered step may be this many behind the step the trainer died in


@dataclass
class State:
    kill: str            # "K:PHASE"
    lose: str            # the power loss, in words
    unsynced: int = 0    # unsynced operations the killed pool held
    undone: int = 0      # of them taken back
    committed: int | None = None
    problem: str = ""


@dataclass
class Sweep:
    states: list = field(default_factory=list)
    resumed: int = 0
    reference_failed: str = ""

    @property
    def failed(self) -> list:
        return [s for s in self.states if s.problem]


def _losses(unsynced: int, n: int, rng: random.Random) -> list[tuple[str, fileio.Lose]]:
    """``n`` power losses for a pool holding ``unsynced`` unsynced operations."""
    out = [("nothing unsynced kept", fileio.Lose("all"))]
    prefixes = sorted({max(1, unsynced * i // max(1, n // 2)) for i in range(1, n // 2 + 1)}) if unsynced else []
    out += [(f"first {k} of {unsynced} kept", fileio.Lose("prefix", keep=k)) for k in prefixes]
    while len(out) < n:
        seed, block = rng.randrange(1 << 30), rng.choice([4096, 512])
        out.append((f"random subset (seed {seed}), torn at {block} B", fileio.Lose("subset", seed=seed, block=block)))
    return out[:n]


def _recover(cli: Cli, pool: Path) -> tuple[int, dict | None, str]:
    rec = cli.run(["recover", "--pool", str(pool), "--json"], timeout=600)
    try:
        return rec.returncode, json.loads(rec.stdout), rec.stderr
    except ValueError:
        return rec.returncode, None, rec.stderr or rec.stdout


def sweep(*, tier: str = "power-sim", steps: int = 24, kills: int = 12, states: int = 8, seed: int = 0,
          pool_dir: Path, resume: bool = True, log=print, window: int | None = 1,
          phases: tuple[str, ...] | None = None) -> Sweep:
    """``window``: the trainer's --window (1, the default: a recovery point with its rows every
    step, the most syncs per step; None: the recovery budget chooses). ``phases``: kill ``i``
    at ``phases[i % len(phases)]`` (default: a phase drawn from every step phase and
    ``random``). A ``random`` kill may land where nothing is unsynced; ``mid-dense`` never does
    (the crash comes between a recovery point's dense-state write and its sync)."""
    rng = random.Random(seed)
    env = dict(SMALL_THRESHOLDS)
    if tier == "pmem":
        env[fileio.ENV] = "1"
    flags = ["--preset", "tiny", "--tier", tier, "--seed", str(seed), "--threads", "1", "--no-progress",
             *(["--window", str(window)] if window is not None else [])]
    res = Sweep()
    cli = Cli(env=env)
    try:
        ref = cli.step_digests(["train", "--pool", str(pool_dir / "reference"), *flags], steps)
        full = cli.run(["train", "--pool", str(pool_dir / "uninterrupted"), "--steps", str(steps), *flags])
        if full.returncode != 0 or parse_digest(full.stdout) != ref[steps]:
            res.reference_failed = f"uninterrupted run: rc {full.returncode}, digest != stepped reference"
            return res
        log(f"crash-states: references for {steps} steps of tiny on {tier}: ok")
        for i in range(kills):
            k, phase = rng.randrange(2, steps), rng.choice(STEP_PHASES + ("random",))
            if phases:
                phase = phases[i % len(phases)]
            killed = pool_dir / f"kill-{i}"
            run = cli.run(["train", "--pool", str(killed), "--steps", str(steps), "--crash-at", f"{k}:{phase}", *flags])
            label = f"{k}:{phase}"
            if run.returncode != -9:
                res.states.append(State(label, "-", problem=f"trainer exited {run.returncode}, not by SIGKILL: "
                                                             f"{run.stderr.strip()[-500:]}"))
                continue
            unsynced = fileio.unsynced_count(killed)
            for j, (words, lose) in enumerate(_losses(unsynced, states, rng)):
                st = State(label, words, unsynced)
                copy = pool_dir / f"kill-{i}-state-{j}"
                shutil.copytree(killed, copy, symlinks=True)
                st.undone = fileio.power_on(copy, lose).undone
                rc, rep, err = _recover(cli, copy)
                if rc != 0 or rep is None:
                    st.problem = f"recover exited {rc} after a plain power loss: {err.strip()[-500:]}"
                else:
                    c = st.committed = rep["committed_step"]
                    if c is None or c < k - BEHIND:
                        st.problem = f"recovered to step {c}, more than {BEHIND} behind step {k}"
                    elif rep["state_digest"] != ref.get(c):
                        st.problem = f"digest at step {c} differs from the reference"
                    elif resume and j == 0:
                        done = cli.run(["train", "--pool", str(copy), "--steps", str(steps), *flags])
                        if done.returncode != 0 or parse_digest(done.stdout) != ref[steps]:
                            st.problem = f"resumed to {steps}: rc {done.returncode}, digest != uninterrupted"
                        else:
                            res.resumed += 1
                log(f"  kill {label:>16}  {words:<44} unsynced {unsynced:>4} undone {st.undone:>4} -> "
                    f"step {st.committed}  {'ok' if not st.problem else 'FAILED: ' + st.problem}")
                res.states.append(st)
                shutil.rmtree(copy, ignore_errors=True)
            shutil.rmtree(killed, ignore_errors=True)
    finally:
        cli.close()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tier", default="power-sim", choices=["power-sim", "pmem"])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kills", type=int, default=12)
    ap.add_argument("--states", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-dir", type=Path, default=None)
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument("--window", default="1", help="the trainer's --window (default 1); 'budget': none given")
    ap.add_argument("--quick", action="store_true", help="3 kills x 4 states, 16 steps")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.kills, a.states = 16, 3, 4
    with tempfile.TemporaryDirectory(prefix="crash-states-", dir=a.pool_dir) as d:
        res = sweep(tier=a.tier, steps=a.steps, kills=a.kills, states=a.states, seed=a.seed, pool_dir=Path(d),
                    window=None if a.window == "budget" else int(a.window),
                    resume=not a.no_resume)
    if res.reference_failed:
        print(f"crash-states: reference failed: {res.reference_failed}")
        return 2
    n, bad = len(res.states), len(res.failed)
    print(f"crash-states: {n} states from {len({s.kill for s in res.states})} kills, {n - bad} bit-exact, "
          f"{bad} failed ({res.resumed} resumed to the end bit-exactly)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
