"""Evaluation: AUC and log loss of a model over batches of a data source, and the held-out
synthetic data that ``train --eval-every`` and ``eval`` use by default."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import SyntheticData
from .model import PoolDLRM

__all__ = ["evaluate", "HeldOutSynthetic", "EVAL_SEED_OFFSET"]

EVAL_SEED_OFFSET = 1_000_003  # synthetic eval batches start here: same problem, batches training never reads


class HeldOutSynthetic:
    """Synthetic batches of the training distribution that training does not read.

    The seed also fixes the true effects of the rows, so held-out data must use the training
    seed; it starts at batch EVAL_SEED_OFFSET instead."""

    def __init__(self, source: SyntheticData, first_batch: int = EVAL_SEED_OFFSET):
        self.source, self.first_batch = source, first_batch

    def iter_batches(self, position=None):
        return self.source.iter_batches(position or {"batch": self.first_batch})


@torch.no_grad()
def evaluate(model: PoolDLRM, source, batches: int) -> dict:
    """AUC and log loss over ``batches`` batches of ``source`` (from its start)."""
    from torchmetrics.functional.classification import binary_auroc

    preds, labels = [], []
    for i, (batch, _) in enumerate(source.iter_batches(None)):
        if i >= batches:
            break
        logits, _ = model(batch.dense, model.plan(batch.sparse))
        preds.append(torch.sigmoid(logits.float().cpu()))
        labels.append(batch.labels)
    p = torch.cat(preds)
    y = torch.cat(labels)
    logloss = float(F.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y))
    auc = float(binary_auroc(p, y.long())) if 0 < float(y.sum()) < y.numel() else float("nan")
    return {"auc": auc, "logloss": logloss, "samples": int(y.numel())}
