"""Lookahead for tables behind a DRAM cache, and what the cache and the memory report.

The trainer's prefetch thread (``Trainer.plan_ahead`` inside a :class:`~dlrm_cxl.data.Prefetcher`
of depth ``--prefetch-batches``) plans the batches ahead; with a DRAM cache arena, making a
batch's plan also reads its missing rows from their home into the cache, sorted, on that thread
(``PoolDLRM.plan`` -> ``CachedFusedEmbeddingBags.prefetch`` -> ``CacheArena.prefetch``), into slots
that no running or planned batch needs (Bagpipe's rule; memory_pool/cache_arena.py). So K
planned batches are K batches of lookahead (plus the one the thread is making).

:data:`DEFAULT_PREFETCH_BATCHES` was picked by measurement (README, "Tables larger than DRAM").
"""

from __future__ import annotations

from memory_pool.residency import pool_memory

__all__ = ["DEFAULT_PREFETCH_BATCHES", "cache_report", "validate_prefetch_batches", "check_cache_budget"]

# Measured on `small` with a quarter of the tables as the budget (README): 2 and 4 batches of
# lookahead gave the same step time within noise; more only holds more slots for later batches.
DEFAULT_PREFETCH_BATCHES = 2


def validate_prefetch_batches(k) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"--prefetch-batches must be an int >= 1, got {k!r}")


def cache_report(model, pool) -> dict:
    """``{"cache": ..., "memory": ...}`` for a train summary's ``pool_stats``: the DRAM cache's
    counters (hit rate, rows prefetched, the time steps waited for rows; None without a cache)
    and the memory the process and the pool use against the DRAM budget
    (:func:`memory_pool.residency.pool_memory`)."""
    bags = getattr(model, "cache_bags", None)
    cache = None
    arena_bytes = 0
    if bags is not None:
        arena = bags.arena
        arena_bytes = arena.nbytes
        cache = {**arena.stats.as_dict(), "budget_bytes": arena.cfg.budget_bytes, "arena_bytes": arena.nbytes,
                 "slots": sum(g.slots for g in arena.cfg.groups), "rows": sum(g.rows for g in arena.cfg.groups)}
    return {"cache": cache, "memory": pool_memory(pool, budget_bytes=pool.dram_cache_bytes, cache_bytes=arena_bytes)}


def check_cache_budget(budget_bytes: int | None, cfg) -> None:
    """Refuse, before a pool is made, a ``--dram-cache`` budget that is smaller than the model's
    tables and cannot hold one batch of them (:class:`~memory_pool.cache_arena.CacheTooSmallError`,
    exit 2, naming the budget that would do): the split ``bind_cached`` will make."""
    if budget_bytes is None or budget_bytes >= cfg.table_bytes:
        return
    from memory_pool.cache_arena import CacheArenaConfig

    dims = (cfg.embedding_dim, 1) if cfg.embedding_optimizer.kind == "rowwise_adagrad" else (cfg.embedding_dim,)
    CacheArenaConfig.for_budget(budget_bytes, [(f, n, dims) for f, n in zip(cfg.feature_names, cfg.num_embeddings)],
                                batch_rows=cfg.batch_size)
