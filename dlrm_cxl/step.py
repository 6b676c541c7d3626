"""One training step's kernel path, behind one interface, chosen once when the trainer is built.

The trainer's step (``Trainer.train_step``) is the same for every path; the call order, with the
checkpointer's (``checkpointing/base.py``)::

    ck.begin_step(k)
    plan                                  # the batch's ids, indexed (made ahead, prefetch thread)
    ck.log_before_image(touched)          # the rows step k will change
    loss, shown, ctx = path.forward(batch, plan)
    (diverged? replayed step's witness?)  # checked before anything of the step is applied
    path.backward_and_update(ck, k, loss, ctx, plan)
                                          #   ... ck.persist() (the write-ahead barrier), the rows
                                          #   change in place, ck.update(dense optimizer step)
    ck.commit(k, witness=...)

Paths (:func:`make_path`):

* :class:`FusedPath`: fbgemm's fused kernels in place on the pool: the barrier is a hook on the
  pooled output's gradient, right before the fused backward updates the rows;
* :class:`ReferencePath`: gather, backward, the batched sparse optimizer, scatter (tables behind
  the reference DRAM cache, ``--kernel reference``);
* :class:`ShardedPath`: a rank of a torchrun job -- the wrapper that does the exchange around the
  reference kernels (dlrm_cxl.distributed), as TorchRec's ``DistributedModelParallel`` wraps a
  model: the trainer does not branch on sharding.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F

from .errors import TrainingDivergedError

__all__ = ["StepPath", "FusedPath", "ReferencePath", "ShardedPath", "make_path", "phase"]


def phase(name: str):
    """A named range for torch.profiler (tools/profile_step.py); next to free when not profiling."""
    return torch.profiler.record_function(f"dlrm_cxl.{name}")


class StepPath(abc.ABC):
    """See the module docstring. ``model``: the PoolDLRM; ``sparse_opt``: its SparseOptimizer;
    ``dense_opt``: the dense optimizer."""

    name = "abstract"

    def __init__(self, model, sparse_opt, dense_opt):
        self.model, self.sparse_opt, self.dense_opt = model, sparse_opt, dense_opt

    @abc.abstractmethod
    def forward(self, batch, plan) -> tuple[torch.Tensor, object, torch.Tensor]:
        """(the loss to differentiate, the loss to report and check -- a tensor or a float --, the
        pooled embeddings whose gradient the update needs)."""

    @abc.abstractmethod
    def backward_and_update(self, ck, k: int, loss: torch.Tensor, pooled: torch.Tensor, plan) -> None:
        """Backward, the write-ahead barrier (``ck.persist()``), the rows' in-place update and the
        dense optimizer step (inside ``ck.update``)."""

    def _apply(self, ck, updates) -> None:
        # "mid-update" fires after half of the tables (after the first, with one table).
        half = max(1, len(updates) // 2)

        def apply():
            self.sparse_opt.apply(updates, between=lambda i: ck.hit("mid-update") if i == half - 1 else None)
            self.dense_opt.step()

        ck.update(apply)


class FusedPath(StepPath):
    name = "fused"

    def forward(self, batch, plan):
        logits, pooled = self.model.forward_fused(batch.dense, plan)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(logits.device))
        return loss, loss.detach(), pooled

    def backward_and_update(self, ck, k, loss, pooled, plan):
        # The gradient of the pooled output is ready just before fbgemm's backward updates the
        # rows in place: the write-ahead barrier goes exactly there, so the undo log's write
        # overlaps the forward and the dense backward.
        pooled.register_hook(lambda g: write_ahead_barrier(ck, k, g))
        loss.backward()
        ck.hit("mid-update")  # rows updated, dense step not yet
        with phase("dense_optimizer"):
            ck.update(self.dense_opt.step)


class ReferencePath(StepPath):
    name = "reference"

    def forward(self, batch, plan):
        logits, pooled = self.model(batch.dense, plan)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(logits.device))
        return loss, loss.detach(), pooled

    def backward_and_update(self, ck, k, loss, pooled, plan):
        loss.backward()
        updates = self.sparse_opt.compute(plan, pooled.grad, ck.before_images())
        ck.persist()
        self._apply(ck, updates)


class ShardedPath(StepPath):
    """A rank's step: its tables' pooled rows for the whole batch go to the samples' ranks
    (all_to_all), the dense part runs on the local samples, the dense gradients are averaged and
    the embedding gradients go back to the tables' owners (dlrm_cxl.distributed)."""

    name = "sharded"

    def __init__(self, model, sparse_opt, dense_opt, dist):
        super().__init__(model, sparse_opt, dense_opt)
        self.dist = dist

    def forward(self, batch, plan):
        d, model = self.dist, self.model
        local = d.local_slice(batch.labels.numel())
        pooled = d.pooled_to_samples(model.pooled(plan)).to(model.dense_device).requires_grad_(True)
        logits = model.forward_pooled(batch.dense[local], pooled)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels[local].to(logits.device))
        # (every rank sees the same global loss: a divergence stops them all together)
        return loss, d.mean(float(loss.detach())), pooled

    def backward_and_update(self, ck, k, loss, pooled, plan):
        d = self.dist
        loss.backward()
        d.average_gradients(self.model.parameters())
        # d(mean over the global batch)/d(pooled) = (1/W) * d(local mean)/d(pooled)
        grad = d.grads_to_owners(pooled.grad / d.world)
        updates = self.sparse_opt.compute(plan, grad, ck.before_images())
        ck.persist()
        self._apply(ck, updates)


def make_path(model, sparse_opt, dense_opt, *, fused: bool, dist=None) -> StepPath:
    """The step path of a trainer (once, at build time)."""
    if dist is not None:
        return ShardedPath(model, sparse_opt, dense_opt, dist)
    return (FusedPath if fused else ReferencePath)(model, sparse_opt, dense_opt)


def write_ahead_barrier(ck, k: int, grad: torch.Tensor) -> None:
    """Right before the fused backward changes rows: refuse a non-finite gradient (it would write
    non-finite rows; the loss can be finite while a gradient is not, e.g. after an overflow in
    the MLP), then wait until the step's before-images are durable."""
    if not _all_finite(grad):
        raise TrainingDivergedError(f"the embedding gradient of step {k} is not finite (the loss is); the "
                                    f"step was not applied, the pool stays at step {k - 1}")
    ck.persist()
    ck.mark_updated()


def _all_finite(t: torch.Tensor) -> bool:
    lo, hi = torch.aminmax(t)  # one pass, no temporary; NaN propagates
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
