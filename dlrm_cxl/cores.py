"""A core for the background compaction: the steps run on one intra-op thread fewer while one runs.

Why: the compactor's thread (``memory_pool.persistence.Compactor``) does seconds of work beside
the steps. On this 2-core machine it took one of the two cores from a step's two-thread ops,
and the other thread then waited at each op's barrier for the one preempted: `kaggle` behind a
2.2 GB cache ran its steps during a compaction at 150-600 ms instead of ~80 (6.2-6.5 s of such
steps in 600). With the step on one thread while a compaction runs, those steps took 0.7-1.0 s
in all, and 600 steps ran at 24,170 and 22,120 samples/s against 21,804 and 21,461
(docs/tiering-measurements.md). (Running the compactor at ``SCHED_IDLE`` instead starved it.)

Only where it changes no result: a step must be bit-identical whatever the thread count, or a
replay after a crash -- whose steps meet compactions at other times -- would not reproduce its
losses (``ReplayMismatchError``). torch's CPU ops split their work by shape and thread count,
not by data, so :func:`thread_count_invariant` checks the model's own dense layers once, at
the batch size, forward and backward, on its own random inputs, with both counts (the fused
embedding kernels were checked by a run: `kaggle`, 12 steps, ``--threads 1`` and 2, the same
``state_digest``). Where it differs, the count is left alone. ``DLRM_CXL_YIELD_CORE=0`` turns it
off.

It differed on the Intel Xeon host of 2026-12-06: in MKL's default mode its GEMMs split the
`kaggle` MLPs' work at batch 2048 by thread count, the probe said no and no step yielded. MKL's
mode is pinned since to ``AUTO,STRICT`` when ``dlrm_cxl`` is imported (dlrm_cxl/arithmetic.py:
the same bits on any count, at ~1 % of the MLPs' time), and each run records the
mode a replay must run in (``replay_source.check_replay_settings``).
The compaction's first phase, reading its journal in (``Compaction.reading``), yields nothing:
the pool's ``compactor_computing`` is False until it computes.
"""

from __future__ import annotations

import os

import torch

__all__ = ["CoreYield", "thread_count_invariant"]


def thread_count_invariant(model, batch_size: int, num_dense: int, threads: int) -> bool:
    """Whether ``model``'s bottom and top MLPs (``dense_arch``, ``over_arch``) give bit-identical
    outputs and parameter gradients on ``threads`` and ``threads - 1`` intra-op threads. Touches
    no state: its inputs come from a generator of its own, its gradients are returned, not
    accumulated."""
    arches = [(a, n) for a, n in ((getattr(model, "dense_arch", None), num_dense),
                                  (getattr(model, "over_arch", None), None)) if a is not None]
    if not arches:
        return False
    before = torch.get_num_threads()
    try:
        results = []
        for n in (threads, threads - 1):
            torch.set_num_threads(n)
            gen = torch.Generator().manual_seed(0)   # (the same inputs for both counts)
            out = []
            for arch, width in arches:
                params = [p for p in arch.parameters() if p.requires_grad]
                if width is None:  # (the top MLP: its first layer's width)
                    width = next(p for p in arch.parameters() if p.dim() == 2).shape[1]
                y = arch(torch.randn(batch_size, width, generator=gen))
                out.append(y.detach())
                out.extend(torch.autograd.grad(y.square().sum(), params))
            results.append(out)
        return all(torch.equal(a, b) for a, b in zip(*results))
    finally:
        torch.set_num_threads(before)


class CoreYield:
    """Called before every step (``Trainer.train_step``): one intra-op thread fewer while the
    pool's background compaction runs, all of them otherwise (see the module)."""

    def __init__(self, pool, model, batch_size: int, num_dense: int):
        self.pool = pool
        self.threads = torch.get_num_threads()
        self.enabled = self.threads >= 2 and os.environ.get("DLRM_CXL_YIELD_CORE", "1") != "0"
        self._probe = lambda: thread_count_invariant(model, batch_size, num_dense, self.threads)
        self._checked = False   # (the probe runs at the first compaction: ~0.1 s on `kaggle`)
        self.steps_yielded = 0

    def before_step(self) -> None:
        if not self.enabled:
            return
        # (not while it only reads its journal in: Compaction.reading)
        compacting = self.pool.compacting and self.pool.compactor_computing
        if compacting and not self._checked:
            self._checked = True
            self.enabled = self._probe()
            if not self.enabled:
                return
        want = self.threads - 1 if compacting else self.threads
        if want != self.threads:
            self.steps_yielded += 1
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def restore(self) -> None:
        if self.enabled and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
