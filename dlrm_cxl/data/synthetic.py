"""Synthetic data: :class:`SyntheticData`, deterministic learnable batches with Zipf-distributed ids
for any spec (batch ``k`` is a pure function of ``(seed, k)``)."""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from memory_pool.validation import is_int

from .batch import Batch, DataSpec, bad_position, make_batch, nonneg_int, validate_spec

_M64 = (1 << 64) - 1
_PERM_PRIME = (1 << 61) - 1  # Mersenne prime: gcd(P, n) == 1 for every table size n < P


def _mix64(x: int) -> int:
    """splitmix64 finaliser on a Python int (for per-feature constants)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix64_np(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised over uint64 (wrapping arithmetic)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


class SyntheticData:
    """Deterministic, learnable synthetic data with Zipf-distributed ids, for any spec.

    * Batch ``k`` is a pure function of ``(seed, k)``: it comes from a PCG64 generator seeded with
      ``SeedSequence([seed, k])``, using only ``Generator.random`` (whose stream NumPy keeps stable).
    * Ids: a rank is drawn from a continuous power law with exponent ``alpha`` on ``[1, n+1)`` by
      inverse CDF (``alpha=0``: uniform), then mapped to a row with the bijection
      ``row = (rank * (P mod n) + salt_f) mod n`` (P = 2**61-1), so hot rows are scattered.
    * Dense: standard normal (Box-Muller), float32.
    * Labels: ``Bernoulli(sigmoid(w . dense / sqrt(num_dense) + effect_scale * sum_{f < informative}
      effect(f, row_f)))`` where ``w`` and the per-row "true effects" in ``[-1, 1]`` are fixed
      hashes of ``(seed, f, row)`` (:meth:`row_effect`), so a model can learn them.
    """

    def __init__(self, spec: DataSpec, seed: int = 0, alpha: float = 1.05,
                 informative: int = 3, effect_scale: float = 2.0):
        validate_spec(spec)
        if not is_int(seed, numpy=True) or not (0 <= seed <= _M64):
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        alpha = float(alpha)
        if not math.isfinite(alpha) or alpha < 0:
            raise ValueError(f"alpha must be a finite float >= 0, got {alpha!r}")
        self.spec = spec
        self.seed = int(seed)
        self.alpha = alpha
        self.informative = max(0, min(int(informative), spec.num_sparse))
        self.effect_scale = float(effect_scale)
        n = np.asarray(spec.num_embeddings, dtype=np.int64)
        self._n = n[:, None]  # [F, 1]
        self._n_f = (n.astype(np.float64) + 1.0)[:, None]
        self._mult = np.array([_PERM_PRIME % int(x) for x in n], dtype=np.int64)[:, None]
        self._salt = np.array(
            [_mix64(self.seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019 * (f + 1)) % int(x)
             for f, x in enumerate(n)], dtype=np.int64)[:, None]
        self._feat_key = np.array(
            [_mix64(self.seed ^ _mix64(0xD1B54A32D192ED03 * (f + 7))) for f in range(spec.num_sparse)],
            dtype=np.uint64)
        if spec.num_dense:
            wkeys = np.array([_mix64(self.seed * 31 + 0xA0761D6478BD642F + j)
                              for j in range(spec.num_dense)], dtype=np.uint64)
            self.dense_weights = ((_mix64_np(wkeys) >> np.uint64(11)).astype(np.float64)
                                  * 2.0 ** -52 - 1.0)
        else:
            self.dense_weights = np.zeros(0)
        if abs(1.0 - alpha) > 1e-9:
            self._e = 1.0 - alpha
            self._top = self._n_f ** self._e - 1.0  # (n+1)^(1-a) - 1
        else:
            self._e = 0.0
            self._top = np.log(self._n_f)

    def popularity_rank(self, feature: int, rows: np.ndarray) -> np.ndarray:
        """Rank (0: the most frequent) of ``rows`` of feature index ``feature``: the inverse of
        the bijection that scatters ranks over rows (see the class docstring)."""
        n = int(self._n[feature, 0])
        rows = np.asarray(rows, dtype=np.int64)
        if n == 1:
            return np.zeros_like(rows)
        inv = pow(int(self._mult[feature, 0]), -1, n)  # (P mod n is coprime to n)
        # (Python ints: (row - salt) * inv overflows int64 for tables of millions of rows)
        return ((rows.astype(object) - int(self._salt[feature, 0])) * inv % n).astype(np.int64)

    def row_effect(self, feature: int, rows: np.ndarray) -> np.ndarray:
        """The fixed "true" effect in [-1, 1] of ``rows`` of feature index ``feature``."""
        h = _mix64_np(np.asarray(rows, dtype=np.int64).astype(np.uint64) ^ self._feat_key[feature])
        return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -52 - 1.0

    def _ids(self, u: np.ndarray) -> np.ndarray:
        """u: uniforms [F, B] in [0, 1) -> rows [F, B] int64."""
        if self._e != 0.0:
            x = (1.0 + u * self._top) ** (1.0 / self._e)
        else:
            x = np.exp(u * self._top)
        rank = np.clip(np.floor(x).astype(np.int64) - 1, 0, self._n - 1)
        return (rank * self._mult + self._salt) % self._n

    def logits(self, dense: np.ndarray, ids_fb: np.ndarray) -> np.ndarray:
        """True logits for dense [B, D] and ids [F, B] (feature-major)."""
        z = np.zeros(ids_fb.shape[1], dtype=np.float64)
        if self.spec.num_dense:
            z += dense.astype(np.float64) @ self.dense_weights / math.sqrt(self.spec.num_dense)
        for f in range(self.informative):
            z += self.effect_scale * self.row_effect(f, ids_fb[f])
        return z

    def batch(self, k: int) -> Batch:
        if not is_int(k, numpy=True) or k < 0:
            raise ValueError(f"batch index must be an int >= 0, got {k!r}")
        b, nd, nf = self.spec.batch_size, self.spec.num_dense, self.spec.num_sparse
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, int(k)])))
        ids = self._ids(rng.random((nf, b)))
        u1 = 1.0 - rng.random((b, nd))  # (0, 1]
        u2 = rng.random((b, nd))
        dense = (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).astype(np.float32)
        p = 1.0 / (1.0 + np.exp(-self.logits(dense, ids)))
        labels = (rng.random(b) < p).astype(np.float32)
        return make_batch(dense, ids.T, labels, self.spec.feature_names)

    def iter_batches(self, position: dict | None = None) -> Iterator[tuple[Batch, dict]]:
        """Yield ``(batch(k), {"batch": k + 1})`` for k from ``position["batch"]`` (0) on."""
        if position is None:
            k = 0
        elif isinstance(position, dict) and nonneg_int(position, "batch"):
            k = int(position["batch"])
        else:
            raise bad_position("synthetic", position, '{"batch": int >= 0}')
        while True:
            yield self.batch(k), {"batch": k + 1}
            k += 1

    def __iter__(self) -> Iterator[tuple[Batch, dict]]:
        return self.iter_batches()
