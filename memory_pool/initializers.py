"""Table initialisation: deterministic in the seed, generated in parallel.

A new ``kaggle`` pool initialises 8.7 GB of rows. With one ``torch.Generator`` (a Mersenne
Twister, serial by construction) that took 36 s of the pool's 52 s creation on shm, and set the
time to the 100th step (issue #26 asks for 1.2x of TorchRec's, model initialisation included).
So the rows are generated here in **blocks** of :data:`INIT_BLOCK_ROWS` rows, each from a
generator of its own (numpy's SFC64, seeded from ``(seed, block)`` through a ``SeedSequence``),
on a few threads (numpy fills an array without the GIL):

* a row's value depends on the seed, its row and the table's width only -- not on the number of
  threads, the chunking or the tier -- so a table is initialised identically on every tier and on
  whichever rank holds it;
* SFC64 fills float32 at ~0.7 s/GB on one core here, against ~2.8 s/GB for ``torch.rand``; with
  the scaling done block by block while it is in cache, and the blocks spread over the cores, the
  generation is no longer what a creation waits for (the tier's writes are).

The distribution is TorchRec's default: uniform in ``[-scale, scale)``, ``x * 2 scale - scale``
for ``x`` uniform in ``[0, 1)`` (float32, 24 random bits each).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np
import torch

from .errors import InvalidConfigError

__all__ = ["INIT_BLOCK_ROWS", "uniform_block", "uniform_chunks", "init_workers"]

INIT_BLOCK_ROWS = 1 << 15  # rows per independently seeded block (a value's definition: never change it)
_PIECE_FLOATS = 1 << 16    # floats generated and scaled at a time (256 KiB: in cache between the two)


def init_workers() -> int:
    """Threads a table's initialisation uses: the cores this process may run on, at most 8
    (``DLRM_CXL_INIT_THREADS`` overrides)."""
    env = os.environ.get("DLRM_CXL_INIT_THREADS")
    if env:
        if not env.strip().isdigit() or int(env) < 1:
            raise InvalidConfigError(f"DLRM_CXL_INIT_THREADS must be a whole number >= 1, got {env!r}",
                                     hint="unset DLRM_CXL_INIT_THREADS to use every core, or give e.g. 2")
        return int(env)
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def uniform_block(seed: int, block: int, scale: float, out: np.ndarray) -> None:
    """Block ``block``'s rows of a table initialised from ``seed``, uniform in
    ``[-scale, scale)``, into ``out`` (float32 [rows, dim], C-contiguous; rows <=
    INIT_BLOCK_ROWS: the last block of a table may be short -- its rows are the same as in a
    full block, as each row's values follow the ones before it in the block's stream)."""
    gen = np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed % (1 << 64), block])))
    flat = out.reshape(-1)
    two_s, s = np.float32(2.0 * scale), np.float32(scale)
    for a in range(0, flat.size, _PIECE_FLOATS):
        piece = flat[a:a + _PIECE_FLOATS]
        gen.random(out=piece, dtype=np.float32)
        np.multiply(piece, two_s, out=piece)
        np.subtract(piece, s, out=piece)


def uniform_chunks(num_rows: int, dim: int, seed: int, scale: float, *,
                   dest: torch.Tensor | None = None, workers: int | None = None
                   ) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first_row, values [rows, dim] float32)`` for every block of a table, in row order,
    generated ``workers`` at a time, a few blocks ahead of the consumer. With ``dest`` (the
    table's own float32 [num_rows, dim] memory, contiguous) each block is generated in place and
    the values yielded are that view of ``dest``; without it each block gets a buffer of its own
    (the consumer writes it wherever the rows live)."""
    workers = init_workers() if workers is None else workers
    blocks = range(0, num_rows, INIT_BLOCK_ROWS)

    def make(a: int) -> torch.Tensor:
        b = min(a + INIT_BLOCK_ROWS, num_rows)
        out = dest[a:b] if dest is not None else torch.empty(b - a, dim, dtype=torch.float32)
        uniform_block(seed, a // INIT_BLOCK_ROWS, scale, out.numpy())
        return out

    if workers <= 1 or len(blocks) <= 1:
        for a in blocks:
            yield a, make(a)
        return
    ahead = 2 * workers  # blocks in flight: bounded, so that buffers stay a few MB each
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dlrm-cxl-init") as pool:
        pending: deque = deque()
        it = iter(blocks)
        try:
            for a in it:
                pending.append((a, pool.submit(make, a)))
                if len(pending) >= ahead:
                    a0, fut = pending.popleft()
                    yield a0, fut.result()
            while pending:
                a0, fut = pending.popleft()
                yield a0, fut.result()
        finally:
            for _, fut in pending:  # (the consumer stopped early: nothing more is started)
                fut.cancel()
