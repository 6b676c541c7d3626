"""Training on several processes with torch.distributed (``torchrun ... -m dlrm_cxl train``).

Layout: ``--pool DIR`` holds ``job.json`` (world size, model, seed, data) and one pool per rank,
``DIR/rank-R``. Tables are sharded table-wise: feature ``f`` (its rows and its Adagrad state)
lives in the pool of rank ``f % world_size``. The dense part is data-parallel.

One step on rank ``r`` of ``W`` (global batch ``B``, local batch ``B/W``):

1. every rank reads the same global batch (so every rank knows every id: no id exchange);
2. pooled lookups of the rank's own tables for the whole batch, ``[B, F_r, D]``;
3. ``all_to_all``: each rank receives, for its own samples, the pooled vectors of every
   feature, ``[B/W, F, D]``; dense forward and backward on the local samples;
4. dense gradients: one ``all_reduce`` (mean); embedding gradients: the reverse
   ``all_to_all`` gives each rank the gradient of its own features for the whole batch;
5. each rank undo-logs and updates exactly its own touched rows.

Coordinated commit: every rank checkpoints on the same schedule (recovery windows of the same
length, the smallest any rank chose: checkpointing.policy); each step an ``all_reduce(MIN)`` of the ranks' newest durable commits gives the newest
*globally* committed step G. A rank keeps its undo records and dense snapshots back to G, so
after any crash every rank can roll back to G — also a rank that had committed more (it is
ahead of the others). At start-up the ranks agree on G the same way and recover to it.

Crash injection (``--crash-rank R --crash-at STEP:PHASE``) fires on rank R only, and only in
the first incarnation of the job (``TORCHELASTIC_RESTART_COUNT`` 0): a rank brought back by
torchrun's elastic restart does not crash again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from checkpointing.digest import combine_digests
from checkpointing.job import JOB_FILE, read_job_file, write_job_file
from checkpointing.jobdir import RANK_PREFIX, rank_dir
from memory_pool import destroy_pool

from .errors import ConfigMismatchError, PoolFormatError

__all__ = ["DistContext", "init_distributed", "is_distributed_env", "job_file", "combine_digests",
           "owned_features"]

def is_distributed_env() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def job_file(path) -> Path:
    return Path(path) / JOB_FILE


def owned_features(num_features: int, rank: int, world: int) -> list[int]:
    """Table-wise sharding: feature f lives on rank f % world."""
    return [f for f in range(num_features) if f % world == rank]


@dataclass
class DistContext:
    rank: int
    world: int
    device: torch.device          # where collectives run (cpu for gloo, cuda for nccl)
    num_features: int
    comm_seconds: float = 0.0     # time in the embedding all_to_alls and the dense all_reduce
    coord_seconds: float = 0.0    # time agreeing on the globally committed step
    features_of: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        self.features_of = [owned_features(self.num_features, r, self.world) for r in range(self.world)]

    @property
    def features(self) -> list[int]:
        return self.features_of[self.rank]

    # -- the coordinator protocol of UndoLogCheckpointer
    def global_min(self, value: int) -> int:
        t0 = time.perf_counter()
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        self.coord_seconds += time.perf_counter() - t0
        return int(t.item())

    def all_true(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def any_true(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        dist.barrier()

    def local_slice(self, batch_size: int) -> slice:
        if batch_size % self.world:
            raise ValueError(f"batch size {batch_size} must be divisible by the world size {self.world}")
        b = batch_size // self.world
        return slice(self.rank * b, (self.rank + 1) * b)

    # -- embedding exchange
    def pooled_to_samples(self, own: torch.Tensor) -> torch.Tensor:
        """[B, F_r, D] pooled rows of this rank's features -> [B/W, F, D] for this rank's samples."""
        B, Fr, D = own.shape
        W, b = self.world, B // self.world
        t0 = time.perf_counter()
        send = own.to(self.device).contiguous().view(-1)  # already ordered by destination (sample blocks)
        recv_sizes = [b * len(fs) * D for fs in self.features_of]
        recv = torch.empty(sum(recv_sizes), dtype=own.dtype, device=self.device)
        dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=[b * Fr * D] * W)
        out = torch.empty(b, self.num_features, D, dtype=own.dtype, device=self.device)
        for chunk, fs in zip(torch.split(recv, recv_sizes), self.features_of):
            if fs:
                out[:, fs, :] = chunk.view(b, len(fs), D)
        self.comm_seconds += time.perf_counter() - t0
        return out

    def grads_to_owners(self, grad: torch.Tensor) -> torch.Tensor:
        """[B/W, F, D] gradient of this rank's samples -> [B, F_r, D] for this rank's features."""
        b, _, D = grad.shape
        t0 = time.perf_counter()
        parts = [grad[:, fs, :].contiguous().view(-1) for fs in self.features_of]
        send = torch.cat(parts).to(self.device)
        Fr = len(self.features)
        recv = torch.empty(self.world * b * Fr * D, dtype=grad.dtype, device=self.device)
        dist.all_to_all_single(recv, send, output_split_sizes=[b * Fr * D] * self.world,
                               input_split_sizes=[p.numel() for p in parts])
        self.comm_seconds += time.perf_counter() - t0
        return recv.view(self.world * b, Fr, D)

    def average_gradients(self, params) -> None:
        """Data-parallel dense part: one all_reduce over all gradients, then divide by W."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        t0 = time.perf_counter()
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.device)
        dist.all_reduce(flat)
        flat /= self.world
        off = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[off:off + n].view_as(g))
            off += n
        self.comm_seconds += time.perf_counter() - t0

    def mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item()) / self.world

    def gather_strings(self, s: str) -> list[str]:
        out = [None] * self.world
        dist.all_gather_object(out, s)
        return out


def _incarnation_store(rank: int, world: int) -> dist.Store:
    """The rendezvous store of this incarnation of the job.

    torchrun's elastic restart reuses one store for every incarnation; with the default keys a
    restarted rank can read the address a dead rank published before the restart, and gloo's
    connect then fails ("Connection refused") or hangs. Prefixing the keys with the restart
    count gives every incarnation keys of its own."""
    from datetime import timedelta

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                          is_master=(rank == 0 and not agent), timeout=timedelta(minutes=5),
                          wait_for_workers=False)
    return dist.PrefixStore(f"dlrm-cxl/incarnation-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def init_distributed(device: str, num_features: int) -> DistContext:
    """Join the job torchrun started (env:// rendezvous): gloo on CPU, NCCL on CUDA."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend=backend, store=_incarnation_store(rank, world), rank=rank,
                                world_size=world)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        comm = torch.device("cuda", local)
    else:
        comm = torch.device("cpu")
    if num_features < world:
        raise ValueError(f"{world} ranks but only {num_features} tables: table-wise sharding needs one per rank")
    return DistContext(rank, world, comm, num_features)


def prepare_job_dir(path, ctx: DistContext, *, fresh: bool, job: dict, log) -> bool:
    """Create or check ``DIR/job.json``; returns whether the rank pools already exist (on every rank).

    ``job.json`` carries a crc32 (:func:`checkpointing.job.write_job_file`) and is verified on
    every rank (:func:`checkpointing.job.read_job_file`). Every rank calls this (it runs collectives)."""
    path = Path(path)
    if fresh and ctx.rank == 0 and path.exists():
        for d in sorted(path.glob(f"{RANK_PREFIX}*")):
            destroy_pool(d)
        try:
            job_file(path).unlink()
        except FileNotFoundError:
            pass
        log(f"--fresh: removed the pools under {path}")
    ctx.barrier()
    if ctx.rank == 0 and not job_file(path).exists():
        if path.exists() and (path / "pool.json").exists():
            raise ConfigMismatchError(f"{path} is a single-process pool; it cannot be trained by {ctx.world} ranks")
        path.mkdir(parents=True, exist_ok=True)
        write_job_file(path, {**job, "world_size": ctx.world})  # with its crc32, atomically
    ctx.barrier()
    stored = read_job_file(path)  # verified: a damaged or truncated job.json is PoolCorruptError
    if stored.get("world_size") != ctx.world:
        raise ConfigMismatchError(
            f"{path} was created by {stored.get('world_size')} ranks, this job has {ctx.world}",
            hint=f"run torchrun with --nproc_per_node {stored.get('world_size')}, or --fresh")
    mine = (rank_dir(path, ctx.rank) / "pool.json").exists()
    every, some = ctx.all_true(mine), ctx.any_true(mine)
    if some and not every:
        raise PoolFormatError(f"{path}: some ranks have a pool and some do not (creation was interrupted)",
                              hint="start over with --fresh")
    return every
