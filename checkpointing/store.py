"""On-media layout of the checkpointer: one home for every name and format it writes.

Everything lives in the pool's journal (``memory_pool.journal``, in the pool's tier), as
transactions, one per recovery point::

    UNDO  step k, table, ids, before-images   (tiers where stores reach the surviving medium
                                              directly: shm, real pmem; also every tier when
                                              several ranks may have to roll back past a commit)
    ROWS  step k, table, ids, after-images    (journaled tiers: emulated pmem, power-sim)
    DENSE step k, the dense state as raw bytes (see below)
    END   tag k, {"step": k, "kind": "commit"}    <- the commit record, written last and durably

The transaction of step ``k`` is committed once its ``END`` is durable (the journal syncs the
records first, then the ``END``). Recovery point of a pool: the newest committed step.

Dense state record (``DENSE``): ``[u32 length of the JSON document][document][tensor bytes]``.
The document is the state's tree (dicts, lists, tuples, numbers, strings) with every tensor or
numpy array replaced by ``{"__t__": i}`` and a table ``tensors`` of ``[dtype, shape, byte
offset]``: no pickle, no ``torch.save`` on the per-step path; the bytes are copied straight from
the parameters to where the journal writes the record (:class:`DensePacker`, a ``Fill`` part):
into the segment's mapping on shm, into the aligned buffer of a direct write on a disk.

``<storage_dir>/ckpt/RUNNING-WITHOUT-UNDO``: written while ``--checkpoint none`` trains (rows
change in place with no undo record: a crash then is not recoverable on direct tiers).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from memory_pool import Fill, PoolCorruptError

__all__ = ["ckpt_dir", "RUNNING_MARKER", "DensePacker", "unpack_dense", "commit_doc", "is_commit"]

RUNNING_MARKER = "RUNNING-WITHOUT-UNDO"
_INT = {int}
_LEN = struct.Struct("<I")
_NP = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
       "uint8": torch.uint8, "uint32": torch.int32, "bool": torch.bool, "float16": torch.float16,
       "bfloat16": torch.bfloat16}


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def ckpt_dir(storage_dir: Path) -> Path:
    return Path(storage_dir) / "ckpt"


def commit_doc(step: int) -> dict:
    return {"kind": "commit", "step": step}


def is_commit(txn) -> bool:
    return txn.doc.get("kind") == "commit"


class DensePacker:
    """Packs a dense state (nested dicts/lists/tuples of tensors, numpy arrays and JSON values)
    as the payload of a DENSE record: its document, and its tensors' bytes as one ``Fill`` part
    (one copy, straight from the tensors to where the record is written)."""

    def pack(self, state: dict) -> tuple[list, int]:
        """Payload parts of a DENSE record for ``state`` and their total size. The tensors'
        bytes are read when the record is written (the ``Fill`` part): they must not change
        until then. Their shapes and the document's values are taken now."""
        tensors: list[torch.Tensor] = []
        table: list = []

        def walk(x):
            if isinstance(x, torch.Tensor):
                t = x.detach()
                if t.device.type != "cpu":
                    t = t.cpu()
                if not t.is_contiguous():
                    t = t.contiguous()
                table.append([_dtype_name(t.dtype), list(t.shape)])
                tensors.append(t)
                return {"__t__": len(tensors) - 1}
            if isinstance(x, np.ndarray):
                raw = torch.from_numpy(np.ascontiguousarray(x).reshape(-1).view(np.uint8)).clone()
                return walk(raw) | {"np": str(x.dtype), "shape": list(x.shape)}
            if isinstance(x, dict):
                if not all(isinstance(k, (str, int)) for k in x):
                    raise TypeError(f"dense state keys must be str or int, got {list(x)[:3]}")
                return {"__d__": [[k, walk(v)] for k, v in x.items()]}
            if isinstance(x, (tuple, list)):
                # Python's RNG state is a tuple of 625 ints: one pass in C, not 625 calls.
                flat = list(x) if set(map(type, x)) <= _INT else [walk(v) for v in x]
                return {"__tuple__": flat} if isinstance(x, tuple) else flat
            if isinstance(x, (np.integer, np.floating)):
                return x.item()
            return x

        doc = {"tree": walk(state), "tensors": table}
        sizes = [t.numel() * t.element_size() for t in tensors]
        total = sum(sizes)
        off = 0
        for n, row in zip(sizes, table):
            row.append(off)
            off += n
        flat = [t.reshape(-1).view(torch.uint8) for t, n in zip(tensors, sizes) if n]

        def fill(dest: np.ndarray) -> None:
            # One kernel for every tensor (a copy per tensor would start ~40 parallel regions).
            if flat:
                torch.cat(flat, out=torch.from_numpy(dest))

        head = json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()
        return [_LEN.pack(len(head)) + head, Fill(total, fill)], _LEN.size + len(head) + total


def unpack_dense(payload) -> dict:
    """The dense state of a DENSE payload (tensors are copies: the payload may be reused)."""
    mv = memoryview(payload)
    try:
        (n,) = _LEN.unpack_from(mv)
        doc = json.loads(bytes(mv[_LEN.size:_LEN.size + n]))
        data = mv[_LEN.size + n:]
        tensors = []
        for dtype, shape, off in doc["tensors"]:
            dt = getattr(torch, dtype)
            count = int(np.prod(shape)) if shape else 1
            nbytes = count * torch.empty((), dtype=dt).element_size()
            raw = torch.frombuffer(bytearray(data[off:off + nbytes]), dtype=torch.uint8) if nbytes else \
                torch.empty(0, dtype=torch.uint8)
            tensors.append(raw.view(dt).reshape(shape) if nbytes else torch.empty(shape, dtype=dt))
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, struct.error) as exc:
        raise PoolCorruptError(f"dense state record is malformed: {exc}") from None

    def build(x):
        if isinstance(x, dict):
            if "__t__" in x:
                t = tensors[x["__t__"]]
                if "np" in x:
                    return np.frombuffer(t.numpy().tobytes(), dtype=x["np"]).reshape(x["shape"]).copy()
                return t
            if "__d__" in x:
                return {k: build(v) for k, v in x["__d__"]}
            if "__tuple__" in x:
                return tuple(build(v) for v in x["__tuple__"])
            return {k: build(v) for k, v in x.items()}
        if isinstance(x, list):
            return [build(v) for v in x]
        return x

    return build(doc["tree"])
