"""``state_digest``: one hash over the whole model state, to compare pools bit for bit.

Covers every embedding row and every embedding-optimizer row (all pool tables, by name), every
dense parameter and buffer, and the dense optimizer's state. Not the data position or RNG
states (they are restored too, but two runs that agree on the model agree on those).
"""

from __future__ import annotations

import hashlib
import json

import torch

__all__ = ["state_digest", "combine_digests"]


def _tensor_bytes(h, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B"))


def _update_obj(h, obj) -> None:
    if isinstance(obj, torch.Tensor):
        _tensor_bytes(h, obj)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(f"<{k}>".encode())
            _update_obj(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _update_obj(h, v)
    else:
        h.update(json.dumps(obj, sort_keys=True, default=str).encode())


def state_digest(pool, dense_state: dict | None) -> str:
    """blake2b-256 over the pool's tables and the dense snapshot's model/optimizer state."""
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(pool.tables()):
        h.update(f"[table {name}]".encode())
        _tensor_bytes(h, pool.table(name).view())
    if dense_state is not None:
        h.update(b"[model]")
        _update_obj(h, dense_state.get("model", {}))
        h.update(b"[optimizer]")
        _update_obj(h, dense_state.get("optimizer", {}))
    return h.hexdigest()


def combine_digests(digests: list[str]) -> str:
    """The digest of a job of several ranks: a hash over every rank's digest, in rank order."""
    h = hashlib.blake2b(digest_size=32)
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()
