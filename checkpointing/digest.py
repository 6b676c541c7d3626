"""``state_digest``: one hash over the whole training state, to compare pools bit for bit.

Covers, in this order and each under a tag of its own:

* every pool table, by name in sorted order (the name is hashed with the rows): the embedding
  rows and the embedding-optimizer rows (``<table>.adagrad``);
* the dense snapshot's ``model`` (every dense parameter and buffer) and ``optimizer`` (the
  dense optimizer's state_dict);
* its ``data_position`` (where the data stream resumes: a small JSON-able dict, or None) and
  its ``rng`` states (``torch``: the CPU generator's state tensor, ``python``:
  ``random.getstate()``, ``numpy``: ``np.random.get_state()``), when the snapshot has them.
  These are part of what "resumes bit for bit" means: two runs that agree on the model but
  would read different data next, or draw different random numbers, are not the same state.

Hashing is canonical: tensors and ndarrays by dtype, shape and raw bytes; dicts by their keys
in sorted order; lists and tuples alike (a snapshot that went through a serialiser turning one
into the other hashes the same), with their lengths, so nesting is unambiguous; numpy scalars
as the Python numbers they hold; other leaves by their JSON text (``repr`` when not JSON-able).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from memory_pool import InOrder

__all__ = ["state_digest", "model_digest", "state_and_model_digest", "combine_digests"]


def _tensor_head(h, dtype: torch.dtype, shape) -> None:
    """What precedes a tensor's bytes (a table hashed in pieces has the same: _tables_hash)."""
    h.update(f"{dtype}{tuple(shape)}".encode())


def _tensor_bytes(h, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    _tensor_head(h, t.dtype, t.shape)
    if t.numel():
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B"))


def _update_obj(h, obj) -> None:
    if isinstance(obj, torch.Tensor):
        h.update(b"T")
        _tensor_bytes(h, obj)
    elif isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:  # raw bytes of an object array are pointers: hash the values
            h.update(f"O{obj.shape}".encode())
            _update_obj(h, obj.tolist())
        else:
            a = np.ascontiguousarray(obj)
            h.update(f"A{a.dtype.str}{a.shape}".encode())
            h.update(memoryview(a.reshape(-1).view(np.uint8)).cast("B"))
    elif isinstance(obj, np.generic):
        _update_obj(h, obj.item())
    elif isinstance(obj, dict):
        h.update(f"{{{len(obj)}".encode())
        for k in sorted(obj, key=repr):
            h.update(f"<{k!r}>".encode())
            _update_obj(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(f"[{len(obj)}".encode())
        for v in obj:
            _update_obj(h, v)
        h.update(b"]")
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        b = bytes(obj)
        h.update(f"B{len(b)}:".encode())
        h.update(b)
    else:
        h.update(b"J")
        h.update(json.dumps(obj, sort_keys=True, default=repr).encode())
        h.update(b";")


def state_digest(pool, dense_state: dict | None, *, resume: bool = True) -> str:
    """blake2b-256 over the pool's tables and the dense snapshot: model, optimizer, data
    position and RNG states (the last two when ``dense_state`` has them). ``resume=False``:
    the model only (tables, dense parameters, optimizer state) -- the *model digest*, equal for
    two runs that trained the same rows from different files (TSV and its zarr conversion)."""
    h = _tables_hash(pool)
    _dense_hash(h, dense_state, resume)
    return h.hexdigest()


def state_and_model_digest(pool, dense_state: dict | None) -> tuple[str, str]:
    """(:func:`state_digest`, :func:`model_digest`) with the tables read once: they are nearly
    all of the bytes (8.8 GB on `kaggle`, read from the device where they live beyond DRAM),
    and both digests begin with them."""
    h = _tables_hash(pool)
    m = h.copy()
    _dense_hash(h, dense_state, True)
    _dense_hash(m, dense_state, False)
    return h.hexdigest(), m.hexdigest()


_CHUNK_BYTES = 64 << 20   # a table is read and hashed this much at a time


def _tables_hash(pool):
    h = hashlib.blake2b(digest_size=32)
    # (the pieces hashed on a thread of their own while the next one is read: blake2b took 9 s
    # of the 20 of `kaggle`'s closing digests, one after the other)
    with InOrder("dlrm-cxl-digest") as hashing:
        for name in sorted(pool.tables()):
            hashing.drain()  # (h's own updates below come after every piece fed before them)
            h.update(f"[table {name}]".encode())
            t = pool.table(name)
            # (as _tensor_bytes would hash the whole table, read in pieces that change nothing:
            # Table.snapshot; the view would first apply every pending row and flush the cache)
            _tensor_head(h, t.dtype, (t.num_embeddings, t.embedding_dim))
            step = max(1, _CHUNK_BYTES // max(1, t.config.row_bytes))
            for lo in range(0, t.num_embeddings, step):
                rows = t.snapshot(lo, min(lo + step, t.num_embeddings))
                hashing.feed(h.update, memoryview(rows.reshape(-1).view(torch.uint8).numpy()).cast("B"))
    return h


def _dense_hash(h, dense_state: dict | None, resume: bool) -> None:
    if dense_state is not None:
        h.update(b"[model]")
        _update_obj(h, dense_state.get("model", {}))
        h.update(b"[optimizer]")
        _update_obj(h, dense_state.get("optimizer", {}))
        if resume and "data_position" in dense_state:
            h.update(b"[data_position]")
            _update_obj(h, dense_state["data_position"])
        if resume and "rng" in dense_state:
            h.update(b"[rng]")
            _update_obj(h, dense_state["rng"])


def model_digest(pool, dense_state: dict | None) -> str:
    """:func:`state_digest` without the data position and RNG states."""
    return state_digest(pool, dense_state, resume=False)


def combine_digests(digests: list[str]) -> str:
    """The digest of a job of several ranks: a hash over every rank's digest, in rank order."""
    h = hashlib.blake2b(digest_size=32)
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()
