"""Evaluation: AUC and log loss of a model over batches of a data source, and the data that
``train --eval-every`` and ``eval`` evaluate on (:func:`eval_source`: one choice for both)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .data import DataSpec, SyntheticData, make_data_source
from .errors import DataFormatError
from .model import PoolDLRM

__all__ = ["evaluate", "eval_source", "HeldOutSynthetic", "EVAL_SEED_OFFSET"]

EVAL_SEED_OFFSET = 1_000_003  # synthetic eval batches start here: same problem, batches training never reads


class HeldOutSynthetic:
    """Synthetic batches of the training distribution that training does not read.

    The seed also fixes the true effects of the rows, so held-out data must use the training
    seed; it starts at batch EVAL_SEED_OFFSET instead."""

    def __init__(self, source: SyntheticData, first_batch: int = EVAL_SEED_OFFSET):
        self.source, self.first_batch = source, first_batch

    def iter_batches(self, position=None):
        return self.source.iter_batches(position or {"batch": self.first_batch})


def eval_source(data: str | os.PathLike | None, spec: DataSpec, *, train_data: str | os.PathLike = "synthetic",
                seed: int = 0, zipf_alpha: float = 1.05, skip_bad_lines: bool = False):
    """The data source that ``dlrm-cxl eval`` and ``train --eval-every`` (``Trainer.evaluate``)
    evaluate on; both call this, so both see the same batches.

    ``data`` is what the user asked for (``eval --data``; ``train --eval-data``); None means the
    data the model was trained on, ``train_data`` (``--data`` of the run, or the ``data`` the pool
    records). ``seed``, ``zipf_alpha``: those of the training run (the pool records them).

    What the user gets:

    * ``"synthetic"`` (asked for, or trained on and nothing else asked for): held-out synthetic
      batches (:class:`HeldOutSynthetic`): the training distribution -- its seed, which also fixes
      the true effects of the rows, and its Zipf alpha -- from batch ``EVAL_SEED_OFFSET`` on, so
      batches training never reads.
    * a file or directory (``--eval-data``/``--data`` of eval, else the training ``--data``): that
      Criteo TSV file or zarr directory from its start; ``skip_bad_lines`` as for training.
    """
    src = data or train_data
    if str(src) == "synthetic":
        return HeldOutSynthetic(SyntheticData(spec, seed=seed, alpha=zipf_alpha))
    return make_data_source(src, spec, seed=seed, skip_bad_lines=skip_bad_lines)


@torch.no_grad()
def evaluate(model: PoolDLRM, source, batches: int) -> dict:
    """AUC and log loss over at most ``batches`` batches of ``source``, from its start, each
    sample once: a file or zarr dataset (a source with ``iter_pass``) is read in one pass and
    never cycled, so one smaller than ``batches`` batches is evaluated whole (``"whole_data"``:
    True; ``"samples"`` says how many). Synthetic data has no end: ``batches`` full batches.

    Returns ``{"auc", "logloss", "samples", "whole_data"}``."""
    from torchmetrics.functional.classification import binary_auroc

    one_pass = getattr(source, "iter_pass", None)
    stream = one_pass() if one_pass is not None else source.iter_batches(None)
    preds, labels = [], []
    whole = one_pass is not None
    for i, (batch, _) in enumerate(stream):
        if i >= batches:
            whole = False  # (a batch was left: the data is larger than what was evaluated)
            break
        logits, _ = model(batch.dense, model.plan(batch.sparse))
        preds.append(torch.sigmoid(logits.float().cpu()))
        labels.append(batch.labels)
    if not preds:
        raise DataFormatError(f"{getattr(source, 'path', 'the data')}: no valid sample to evaluate",
                              hint="check --data (every line was malformed and skipped?)")
    p = torch.cat(preds)
    y = torch.cat(labels)
    logloss = float(F.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y))
    auc = float(binary_auroc(p, y.long())) if 0 < float(y.sum()) < y.numel() else float("nan")
    return {"auc": auc, "logloss": logloss, "samples": int(y.numel()), "whole_data": whole}
