"""A TorchRec ``KeyedJaggedTensor`` looked up in a pool's tables (``MemoryPool.lookup``): what
TorchRec's ``EmbeddingBagCollection`` does, sum-pooled. Used by ``tools/bench_pool.py`` and the
tests; the trainer takes its own path (dlrm_cxl/model.py)."""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from .errors import InvalidIdsError
from .table import Table
from .validation import validate_ids

__all__ = ["lookup_kjt"]


def lookup_kjt(table: Callable[[str], Table], kjt, tables: Mapping[str, str] | None = None):
    """Sum-pooled lookup of a TorchRec ``KeyedJaggedTensor``.

    Each key is looked up in the table of the same name, or ``tables[key]`` (``table(name)``:
    the pool's table of that name). Returns a TorchRec ``KeyedTensor`` (like
    ``EmbeddingBagCollection``), one [B, dim] block per key.
    """
    from torchrec.sparse.jagged_tensor import KeyedTensor  # (torchrec: imported only when used)

    keys = list(kjt.keys())
    tabs = [table(tables.get(k, k) if tables else k) for k in keys]
    values, lengths = kjt.values(), kjt.lengths()
    B, K = kjt.stride(), len(keys)
    if lengths.numel() != B * K:
        raise InvalidIdsError(f"lookup: KeyedJaggedTensor has {lengths.numel()} lengths, expected "
                              f"{K} keys x batch {B}", hint="variable batch size per key is not supported")
    # A negative length makes the offsets decrease, and torch's embedding_bag then fails with a
    # bare RuntimeError or reads out of bounds (a segfault): refuse it first (B*K values, cheap).
    if lengths.numel() and int(lengths.min()) < 0:
        j = int(torch.nonzero(lengths.reshape(-1) < 0)[0])
        raise InvalidIdsError(
            f"lookup: KeyedJaggedTensor length {int(lengths.reshape(-1)[j])} is negative (key "
            f"{keys[j // B]!r}, bag {j % B} of batch {B})",
            hint="every bag's length must be >= 0; check how the KeyedJaggedTensor was built")
    # Offsets of every bag of every key in one pass: cum[j] = start of bag j in values.
    cum = torch.zeros(B * K + 1, dtype=torch.int64)
    torch.cumsum(lengths.to(torch.int64), 0, out=cum[1:])
    key_start = cum[::B] if B else torch.zeros(K + 1, dtype=torch.int64)
    bounds = key_start.tolist()  # K + 1 entries
    if bounds[-1] != values.numel():
        raise InvalidIdsError(f"lookup: lengths sum to {bounds[-1]} but there are {values.numel()} values")
    bag_starts = (cum[:-1].view(K, B) - key_start[:-1, None]) if B else torch.zeros(K, 0, dtype=torch.int64)
    # Validate every id at once against its table's size; on failure, the per-key check
    # names the key and the id.
    if values.dtype not in (torch.int64, torch.int32) or values.dim() != 1:
        raise InvalidIdsError(f"lookup: ids must be 1-D int64 or int32, got {values.dtype} {tuple(values.shape)}")
    values = values.to(torch.int64)
    if values.numel():
        sizes = [t.num_embeddings for t in tabs]
        lo, hi = torch.aminmax(values)
        ok = int(lo) >= 0 and int(hi) < min(sizes)
        if not ok and int(lo) >= 0 and min(sizes) != max(sizes):
            limit = torch.repeat_interleave(torch.tensor(sizes), torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1]))
            ok = not bool((values >= limit).any())
        if not ok:
            for i, t in enumerate(tabs):
                validate_ids(values[bounds[i]:bounds[i + 1]], t.config)
    outs = [t.pooled_rows(values[bounds[i]:bounds[i + 1]], bag_starts[i]) for i, t in enumerate(tabs)]
    dims = [t.embedding_dim for t in tabs]
    return KeyedTensor(keys=keys, length_per_key=dims, values=torch.cat(outs, dim=1))
