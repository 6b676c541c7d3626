"""``dlrm-cxl plot``: a PNG of a pool's training metrics (``metrics.jsonl``, :mod:`dlrm_cxl.metrics`).

Three panels over the steps: the loss (each step, and its moving mean over 20 steps), the
throughput (samples/s per step, and its moving median: the first steps of a run and the steps
that waited for a compaction stand out without squashing the rest), and the AUC of the
``--eval-every`` evaluations (a note when there were none). matplotlib draws it off screen (the
Agg backend: no display needed).
"""

from __future__ import annotations

import io
from pathlib import Path

from .errors import InvalidConfigError
from .metrics import Metrics

__all__ = ["plot_metrics"]

_WINDOW = 20  # steps of the moving mean / median


def _moving(values: list[float], window: int, how: str):
    """The mean (or median) of each value and the ``window - 1`` before it (fewer at the start)."""
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    a = np.concatenate([np.full(window - 1, np.nan), np.asarray(values, dtype=np.float64)])
    w = sliding_window_view(a, window)
    return np.nanmedian(w, axis=1) if how == "median" else np.nanmean(w, axis=1)


def plot_metrics(m: Metrics, out, *, title: str = "") -> dict:
    """Draw ``m`` into the PNG file ``out`` (replaced atomically). Returns what was drawn:
    ``{"out", "steps", "first_step", "last_step", "evals", "bytes"}``."""
    try:
        import matplotlib
    except ImportError:
        raise InvalidConfigError("dlrm-cxl plot needs matplotlib, which is not installed",
                                 hint="install it (`pip install matplotlib`; scripts/setup.sh installs it with "
                                      "dlrm-cxl's other dependencies)") from None
    matplotlib.use("Agg", force=True)  # off screen, whatever the environment asks for
    import matplotlib.pyplot as plt

    from memory_pool.durable import atomic_write

    fig, (ax_loss, ax_tput, ax_auc) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    try:
        _series(ax_loss, m.steps, m.loss, "tab:blue", "loss", "mean", "training loss (BCE)", "upper right")
        _series(ax_tput, m.steps, m.samples_per_s, "tab:green", "samples/s", "median", "samples/s", "lower right")

        if m.evals:
            ks = [k for k, _ in m.evals]
            ax_auc.plot(ks, [e.get("auc", float("nan")) for _, e in m.evals], marker="o", color="tab:red")
            ax_auc.set_ylabel("eval AUC")
        else:
            ax_auc.text(0.5, 0.5, "no evaluation recorded (train --eval-every N)", ha="center", va="center",
                        transform=ax_auc.transAxes, color="gray")
            ax_auc.set_yticks([])
        ax_auc.grid(alpha=0.3)
        ax_auc.set_xlabel("step")
        runs = len(m.runs)
        fig.suptitle((title + "\n" if title else "") + f"steps {m.steps[0]}..{m.steps[-1]}"
                     + (f", {runs} runs" if runs > 1 else ""), fontsize="medium")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
    finally:
        plt.close(fig)
    data = buf.getvalue()
    atomic_write(Path(out), data, durable=False)
    return {"out": str(out), "steps": len(m.steps), "first_step": m.steps[0], "last_step": m.steps[-1],
            "evals": len(m.evals), "bytes": len(data)}


def _series(ax, steps, values, color: str, label: str, how: str, ylabel: str, where: str) -> None:
    """A per-step series, faint, and its moving ``how`` (mean or median) over _WINDOW steps."""
    ax.plot(steps, values, lw=0.6, alpha=0.35, color=color, label=label)
    ax.plot(steps, _moving(values, _WINDOW, how), lw=1.5, color=color, label=f"{how} of {_WINDOW} steps")
    ax.set_ylabel(ylabel)
    ax.legend(loc=where, fontsize="small")
    ax.grid(alpha=0.3)
