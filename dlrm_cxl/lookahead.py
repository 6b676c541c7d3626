"""Lookahead for tables behind a DRAM cache, and what the cache and the memory report.

The trainer's prefetch thread (``Trainer.plan_ahead`` inside a :class:`~dlrm_cxl.data.Prefetcher`
of depth ``--prefetch-batches``) plans the batches ahead; with a DRAM cache arena, making a
batch's plan also reads its missing rows from their home into the cache, sorted, on that thread
(``PoolDLRM.plan`` -> ``CachedFusedEmbeddingBags.prefetch`` -> ``CacheArena.prefetch``), into slots
that no running or planned batch needs (Bagpipe's rule; memory_pool/cache_arena.py). So K
planned batches are K batches of lookahead (plus the one the thread is making).

:data:`DEFAULT_PREFETCH_BATCHES` was picked by measurement (docs/tiering-measurements.md).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from checkpointing.undo import MAX_POINTS_KEPT
from memory_pool.overlay import RUNS_DIR
from memory_pool.residency import page_cache_bytes, pool_memory, process_memory

__all__ = ["DEFAULT_PREFETCH_BATCHES", "cache_report", "validate_prefetch_batches", "check_cache_budget",
           "WorkingCopyBound"]

# Measured on `small` with a quarter of the tables as the budget (README): 2 and 4 batches of
# lookahead gave the same step time within noise; more only holds more slots for later batches.
DEFAULT_PREFETCH_BATCHES = 2


def validate_prefetch_batches(k) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"--prefetch-batches must be an int >= 1, got {k!r}")


def cache_report(model, pool, bound=None) -> dict:
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
        cache = {**arena.settled_stats(), "budget_bytes": arena.cfg.budget_bytes, "arena_bytes": arena.nbytes,
                 "slots": sum(g.slots for g in arena.cfg.groups), "rows": sum(g.rows for g in arena.cfg.groups)}
    memory = pool_memory(pool, budget_bytes=pool.dram_cache_bytes, cache_bytes=arena_bytes)
    if bound is not None:  # (a journaled pool's working copy given back: WorkingCopyBound)
        memory.update(bound.as_dict())
    return {"cache": cache, "memory": memory}


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


class WorkingCopyBound:
    """Keeps what a journaled pool holds in DRAM for its tables behind a DRAM cache arena near
    the budget (issue 26).

    Why: on emulated pmem and power-sim the working copy is a private mapping of the images.
    The cache is write-back there (memory_pool/cache_arena.py), but a dirty row it evicts is
    stored into the working copy, and each page first written becomes anonymous memory, held
    until the pool is closed; each page a miss reads stays in the page cache. Over a long run on
    a table larger than DRAM that is all of the table -- more than the machine has. And the
    cache's dirty slots must stay few, or the clock finds no clean slot to evict. Here, at a
    recovery point (a window's end, its transaction handed to the writer) where the working
    copy's anonymous pages (the growth of ``RssAnon`` since the last trim, or since the trainer
    was built with the arena counted) plus the images' page cache (``cachestat``, see
    :data:`MEASURE_EVERY`) exceed what the budget leaves beside the cache arena, or where
    :data:`CLEAN_AT_DIRTY` of a group's slots are dirty, the checkpointer is
    drained and the working copy is given back (``MemoryPool.trim_working_copy``: the committed
    rows into the images' page cache, the images mapped afresh, their clean pages dropped; every
    slot is then clean: ``CacheArena.mark_clean``). So
    the arena plus those pages stay within the budget plus one recovery window's pages (the
    stated slack: a trim waits for a recovery point) plus the pages the kernel has not written
    back yet (dirty, not droppable until written: the next trim drops them). The journal's own
    page cache is reported beside it (docs/tiering-measurements.md).

    Only with ``--checkpoint undo``: without a journal the working copy's changes are nowhere
    else. The pool keeps a row overlay behind the cache (``MemoryPool.bound_working_copy``):
    compactions, and so trims, pack the rows alone in their pages into runs instead of writing
    each into its image page (memory_pool/overlay.py).
    """

    MIN_ALLOWANCE = 0.125
    # The images' page cache is measured by the kernel (memory_pool.residency.page_cache_bytes:
    # ``cachestat``, ~10-30 ms for `kaggle`'s 52 files and runs; ``mincore`` where the kernel has
    # no ``cachestat``, which asks for every page: 83-105 ms), against 0.2 ms for RssAnon. So it
    # is measured again only once this many times its last cost has passed (0.25 % of the run);
    # in between, the last value plus a page per row and member the cache read from the home
    # since stands in (an upper bound: with MADV_RANDOM a miss reads its own page only; ~44 MB a
    # step on `kaggle` at a quarter). With ``mincore`` that bound passed the allowance within a
    # window or two on `kaggle`, and a refresh there costs ~14 ms: measuring more often (100
    # times, 1 %) took 0.66 s of the trainer's thread in 700 steps for nothing.
    MEASURE_EVERY = 400
    PAGE = 4096

    # A write-back arena's slots are all made clean (``CacheArena.mark_clean``) by a trim once
    # this fraction of a group's slots is dirty: its evictions then never write a row into the
    # working copy (``CacheArena._admit``).
    CLEAN_AT_DIRTY = 0.4
    # From this fraction the trim is prepared for: a compaction is asked for at once (the
    # checkpointer's ``compact_soon``, unless one is running), and the trim comes at the first
    # recovery point after it is over. A trim writes home, inline, every row committed since the
    # journal's START: right after a compaction, the rows of the steps it took (a fifth of a
    # compaction's on `kaggle`), instead of ~1 GiB of journal at any other time (6.8 s on the
    # trainer's thread, at ~1,000 steps of `kaggle` behind a quarter budget).
    TRIM_EARLY_AT_DIRTY = 0.3

    def __init__(self, pool, names: list[str], budget: int, ckpt, arena_bytes: int = 0, arena=None):
        self.pool, self.names, self.budget, self.ckpt = pool, list(names), int(budget), ckpt
        self.arena = arena
        # The working copy may grow this much between trims: what the budget leaves beside the
        # cache arena (at least MIN_ALLOWANCE of it, or a budget taken by the arena would trim
        # at every recovery point for little).
        self.allowance = max(self.budget - int(arena_bytes), int(self.MIN_ALLOWANCE * self.budget))
        self.seconds = 0.0
        # The process's anonymous memory without the working copy's pages: at first what it was
        # when the trainer was built plus the arena (its slots are touched as rows come in), then
        # what it is right after each trim (the steps' own buffers included).
        self.floor = process_memory().get("rss_anon", 0) + int(arena_bytes)
        self.peak = 0   # the most the working copy had grown above the floor, at a recovery point
        self.images = [pool.table(n).region.path for n in self.names]
        self._cached = 0           # the images' page cache when last measured
        self._read_at_measure = 0  # _rows_read() then
        self._next_measure = 0.0   # (perf_counter) when to measure it again
        self.refused = False       # the pool refused a trim (not a journaled tier): not asked again
        # A trim since the trainer was built: refreshes need one first where the open replayed
        # journal rows into the working copy, which nothing else lists (none: not needed)
        self._trimmed = pool.stats.journal_rows_at_open == 0
        # The pool's compaction count when dirtiness passed TRIM_EARLY_AT_DIRTY (None: below it,
        # or trimmed since): a trim is due once a compaction ended after that
        self._armed: int | None = None
        pool.bound_working_copy(self.names)
        # Dirty slots made clean once a compaction has put their value home (_clean_compacted):
        # only where a compaction writes through the row overlay (its rows are what a slot is
        # made clean against: with DLRM_CXL_RUNS_MB=0 none ever is) and the checkpointer says
        # which recovery point it covered. The batch each recovery point's step ran as (at most
        # as many points as the checkpointer remembers), and the compactions already looked at.
        self.clean_after_compactions = (os.environ.get("DLRM_CXL_CLEAN_COMPACTED", "1") != "0"
                                        and arena is not None and arena.lists_spilled
                                        and pool.overlay_bound > 0 and hasattr(ckpt, "compacted_through"))
        self._seq_at: dict[int, int] = {}
        self._cleaned_for = pool.stats.compactions
        self.clean_seconds = 0.0

    def _rows_read(self) -> int:
        """Rows times members the cache has read from the home (each a page at most)."""
        if self.arena is None:
            return 0
        return (self.arena.stats.misses + self.arena.stats.rows_prefetched) * self.arena.cfg.members

    def _image_cache(self) -> int:
        now = time.perf_counter()
        if now >= self._next_measure:
            # (the row overlay's runs too: rows taken from them fault their pages in)
            self._cached = page_cache_bytes(self.images + sorted((self.pool.storage_dir / RUNS_DIR).glob("run-*.bin")))
            self._read_at_measure = self._rows_read()
            self._next_measure = now + self.MEASURE_EVERY * (time.perf_counter() - now)
        return self._cached + self.PAGE * (self._rows_read() - self._read_at_measure)

    @classmethod
    def for_trainer(cls, pool, model, ckpt, checkpoint: str):
        """One for a trainer whose model has a DRAM cache over a journaled pool's tables
        (``--checkpoint undo``), else None."""
        bags = getattr(model, "cache_bags", None)
        if bags is None or checkpoint != "undo" or not pool.journaled or not pool.dram_cache_bytes:
            return None
        if not bags.table_names:
            return None
        return cls(pool, bags.table_names, pool.dram_cache_bytes, ckpt, arena_bytes=bags.arena.nbytes, arena=bags.arena)

    def after_commit(self, step: int) -> bool:
        """Called after step ``step``'s commit: gives the working copy back at a recovery point
        when due. True if it did.

        Two ways (both with the cache's lock held: the prefetch thread may not evict a dirty row
        into the working copy meanwhile; and with the checkpointer drained, except for a
        refresh with nothing to write):

        * a **trim** (``MemoryPool.trim_working_copy``): every committed journal row written
          home -- with the pool's row overlay (the default behind a cache), by a compaction:
          the dense pages into the images, the rest packed into a run -- and the images mapped
          afresh; every cache slot is clean then. Where dirty slots pass :data:`CLEAN_AT_DIRTY`
          (or :data:`TRIM_EARLY_AT_DIRTY`, at the first recovery point after a compaction),
          the first time if the open replayed journal rows into the working copy (nothing lists
          them; due at the run's first recovery point whatever it grew), or while an on-demand
          replay of the journal is pending;
        * else a **refresh** (``MemoryPool.trim_working_copy(names, written)``): only the rows the cache
          wrote into the working copy since (``CacheArena.take_spilled``) go into the images, then
          they are mapped afresh: the clean pages the misses read are given back, for the cost
          of a few rows."""
        if self.refused or getattr(self.ckpt, "window_start", None) != step:
            return False
        if self.clean_after_compactions:
            self._seq_at[step] = self.arena.last_ended
            if len(self._seq_at) > MAX_POINTS_KEPT:   # (as the checkpointer forgets its oldest)
                del self._seq_at[min(self._seq_at)]
            self._clean_compacted()
        grown = process_memory().get("rss_anon", 0) - self.floor + self._image_cache()
        self.peak = max(self.peak, grown)
        frac = self.arena.dirty_fraction if self.arena is not None else 0.0
        dirty = frac >= self.CLEAN_AT_DIRTY or (frac >= self.TRIM_EARLY_AT_DIRTY and self._early_trim_due())
        # (a resumed run whose open replayed journal rows into the working copy trims at its first
        # recovery point whatever it grew: those pages were there when the floor was taken, so no
        # growth ever shows them, and nothing but a trim gives them back)
        if grown <= self.allowance and not dirty and self._trimmed:
            return False
        t0 = time.perf_counter()
        full = dirty or self.arena is None or not self._trimmed or self.pool.journal_rows_pending
        done = taken = None
        if not full:
            # Nothing written into the working copy since it was last given back (no dirty row
            # evicted: the usual case while the cache has room): a refresh writes nothing, needs
            # no drained checkpointer and waits for no compaction (Compaction.refresh), so the
            # step after this one waits for nothing.
            with self.arena.paused():
                taken = self.arena.take_spilled()
                if not any(ids.numel() for ids in taken):
                    done = self._refresh(taken)
        if done is None:
            self.ckpt.drain()  # (the window's transaction durable, no compaction running)
            with (self.arena.paused() if self.arena is not None else contextlib.nullcontext()):
                if full:
                    done = self.pool.trim_working_copy(self.names)
                    if done and self.arena is not None:
                        # Every committed row is in the images now, and no step is running: every
                        # slot equals its home (a dirty slot's value is its row's last committed
                        # after-image); what it wrote into the working copy is gone with it.
                        self.arena.take_spilled()
                        self.arena.mark_clean()
                    self._trimmed = self._trimmed or done
                    self._armed = None if done else self._armed
                else:
                    # (rows taken before the drain, and those the prefetch thread evicted during it:
                    # no step ran meanwhile, so every one of them holds a committed value now)
                    done = self._refresh([torch.unique(torch.cat([a, b])) for a, b in zip(taken, self.arena.take_spilled())])
        self.refused = not done
        self.floor = process_memory().get("rss_anon", 0)
        # (the images' clean pages dropped: the estimate starts again from nothing; dirty pages
        # a compaction wrote stay until written, and the next mincore sees them)
        self._cached, self._read_at_measure = 0, self._rows_read()
        self.seconds += time.perf_counter() - t0
        return done

    def _clean_compacted(self) -> None:
        """At the first recovery point after a compaction ended: the dirty slots that no step
        changed since the newest recovery point it put home (``compacted_through``) hold the
        value it wrote, and become clean (``CacheArena.clean_through``), their rows read from
        where it put them (``MemoryPool.pend_compacted``). Why: a trim (below) makes every slot
        clean by writing every committed row home itself, inline: on `kaggle` behind a quarter
        budget, four trims of ~3 s each on the trainer's thread in 600 steps at step ~3,000,
        while each compaction had just written most of those rows home in the background."""
        if self.pool.stats.compactions == self._cleaned_for:
            return
        with self.pool.compactions_settled() as settled:
            if not settled:
                return   # (one is running: at a later recovery point)
            # (read under the hold: one that ended since the check above is this one's too)
            self._cleaned_for = self.pool.stats.compactions
            # (under the images: the journal's START and the overlay's last rows belong together)
            through = self.ckpt.compacted_through()
            if through is None:
                return
            self._seq_at = {s: v for s, v in self._seq_at.items() if s >= through}   # (none older is asked again)
            seq = self._seq_at.get(through)
            if seq is None:   # (a point before this process's first: its steps' batches are not known)
                return
            M = self.arena.cfg.members
            t0 = time.perf_counter()
            with self.arena.paused():
                self.arena.clean_through(seq, lambda g, rows: self.pool.pend_compacted(self.names[g * M:(g + 1) * M], rows))
            self.clean_seconds += time.perf_counter() - t0
        if self._armed is not None and self.arena.dirty_fraction < self.TRIM_EARLY_AT_DIRTY:
            self._armed = None   # (the compaction it asked for made the trim needless)

    def _early_trim_due(self) -> bool:
        """Dirtiness is past TRIM_EARLY_AT_DIRTY: True once a compaction has ended since it
        passed; the first time, a compaction is asked for (unless one is running)."""
        done = self.pool.stats.compactions
        if self._armed is None:
            self._armed = done
            if not self.pool.compacting:
                ask = getattr(self.ckpt, "compact_soon", None)
                if ask is not None:
                    ask()
            return False
        return done > self._armed and not self.pool.compacting

    def _refresh(self, spilled: list) -> bool:
        """``MemoryPool.trim_working_copy(names, written)`` with ``spilled[g]`` written for every
        member of group ``g`` (the arena paused)."""
        M = self.arena.cfg.members
        return self.pool.trim_working_copy(
            self.names, {self.names[g * M + m]: ids for g, ids in enumerate(spilled) for m in range(M)})

    def as_dict(self) -> dict:
        """``trims`` and ``refreshes`` (the pool's counts), ``trim_seconds`` (both), ``clean_seconds``
        (the trainer's time making slots clean after compactions, :meth:`_clean_compacted`), ``trim_refused``,
        ``working_copy_allowance_bytes`` and ``peak_working_copy_bytes`` (the most the working
        copy's anonymous pages and the images' page cache were found to hold at a recovery point)."""
        return {"trims": self.pool.stats.trims, "refreshes": self.pool.stats.refreshes,
                "trim_seconds": round(self.seconds, 3), "clean_seconds": round(self.clean_seconds, 3),
                "trim_refused": self.refused,
                "working_copy_allowance_bytes": self.allowance, "peak_working_copy_bytes": self.peak}
