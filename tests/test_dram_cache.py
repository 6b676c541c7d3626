"""The DRAM cache arena that fbgemm's fused kernels run on (memory_pool/cache_arena.py,
dlrm_cxl/fused.py: bind_cached): real pools, real mappings, compared with the uncached fused
path and with uninterrupted runs (no mocks of the pool)."""

from __future__ import annotations

import itertools
import os
import re
import threading
import zipfile

import pytest
import torch

from dlrm_cxl.lookahead import WorkingCopyBound
from dlrm_cxl.model import PRESETS, state_table_name
from dlrm_cxl.options import TrainOptions
from dlrm_cxl.trainer import Trainer
from memory_pool import MemoryPool
from memory_pool import cache_arena
from memory_pool.cache_arena import CacheArena, CacheArenaConfig, CacheTooSmallError
from test_recovery import digest_of, killed

TINY = PRESETS["tiny"]
SPEC = [(f, n, (TINY.embedding_dim, 1)) for f, n in zip(TINY.feature_names, TINY.num_embeddings)]
# One batch of every table (64 rows each) and a fifth of the rest: most steps evict rows.
MIN = CacheArenaConfig.min_budget(SPEC, TINY.batch_size)
BUDGET = MIN + (TINY.table_bytes - MIN) // 5
N = 50
# Recovery points (where the working copy is trimmed or refreshed) every WINDOW steps, in the tests
# that count trims: the default window follows the measured step time, and a loaded machine (the
# suite on every core) gave one run 3 refreshes where the test wanted more than 3.
WINDOW = 4


def train(pool, steps, **kw):
    kw.setdefault("tier", "shm")
    t = Trainer(TrainOptions(pool=str(pool), steps=steps, threads=1, progress=False, **kw), TINY, log=lambda s: None)
    try:
        summary = t.run()
        return t.digest(), summary, t
    finally:
        t.close()


@pytest.fixture(scope="module")
def uncached(root):
    """The uncached fused path: N steps, and the digest at N // 2 (for resumed runs)."""
    half, _, _ = train(root / "plain-half", N // 2)
    full, _, _ = train(root / "plain", N)
    return {N // 2: half, N: full}


# --------------------------------------------------------------------------- the arena itself


def two_tables(path, tier="shm"):
    pool = MemoryPool.create(path, tier=tier)
    a = pool.create_table("a", 100, 4, init="uniform", seed=1)
    b = pool.create_table("b", 50, 4, init="uniform", seed=2)
    sa = pool.create_table("a.adagrad", 100, 1, init="uniform", seed=3)
    sb = pool.create_table("b.adagrad", 50, 1, init="uniform", seed=4)
    return pool, [[a, sa], [b, sb]]


def arena_for(members, slots, write_back=False, homes=None, **kw):
    cfg = CacheArenaConfig(tuple(
        __import__("memory_pool.cache_arena", fromlist=["x"]).CacheGroupConfig(ms[0].name, ms[0].num_embeddings,
                                                                               (4, 1), s)
        for ms, s in zip(members, slots)), budget_bytes=0)
    return CacheArena(cfg, homes or [[m.view() for m in ms] for ms in members], write_back=write_back, **kw)


def arena_homes(pool, members):
    """Each member's home as a view of the pool's arena (as ``dlrm_cxl.fused`` gives them): a
    whole-arena flush then writes every group with one scatter per member."""
    flat = pool.arena_tensor(torch.float32)
    return [[flat[m.arena_offset // 4:m.arena_offset // 4 + m.num_embeddings * m.embedding_dim].view(
        m.num_embeddings, m.embedding_dim) for m in ms] for ms in members]


def test_ids_are_remapped_to_slots_holding_their_rows_duplicates_and_across_tables(tmp_path):
    pool, members = two_tables(tmp_path / "p")
    arena = arena_for(members, (10, 10))
    ids_a = torch.tensor([7, 3, 7, 7, 99])          # duplicates
    ids_b = torch.tensor([3, 7, 49])                # the same ids in another table
    rows = [torch.unique(ids_a), torch.unique(ids_b)]
    seq, slots = arena.begin(rows, torch.cat([ids_a, ids_b]), [5, 3])
    sa, sb = slots[:5], slots[5:]
    assert sa[0] == sa[2] == sa[3] and len(set(sa.tolist())) == 3       # one slot per distinct row
    for g, (ids, s) in enumerate(((ids_a, sa), (ids_b, sb))):
        w, m = arena.groups[g].slots
        assert torch.equal(w[s], members[g][0].view()[ids])               # weights ...
        assert torch.equal(m[s], members[g][1].view()[ids])               # ... and their optimizer state
    # the kernels see group g at its offset: table a's slot of id 3 is not table b's
    flat = arena.flat[0].view(-1, 4)
    assert torch.equal(flat[sa[1]], members[0][0].view()[3]) and torch.equal(flat[10 + sb[0]], members[1][0].view()[3])
    arena.end(rows, seq)
    pool.close()


def test_a_batch_needing_more_rows_than_the_cache_holds_is_refused_and_changes_nothing(tmp_path):
    pool, members = two_tables(tmp_path / "p")
    arena = arena_for(members, (4, 4))
    before = arena._map.clone()
    ids = torch.arange(5)
    with pytest.raises(CacheTooSmallError, match="5 distinct rows of table 'a'.*4 slots") as e:
        arena.begin([ids, torch.tensor([0])], torch.cat([ids, torch.tensor([0])]), [5, 1])
    assert "--dram-cache" in e.value.hint and e.value.exit_code == 2
    assert torch.equal(arena._map, before)
    pool.close()


def test_a_step_that_admits_rows_while_a_prefetch_lets_go_of_the_lock_leaves_one_slot_per_row(tmp_path,
                                                                                             monkeypatch):
    """The prefetch thread lets go of the arena's lock between groups, so a step may begin in
    between and admit rows the prefetched batch also missed: those are then stamped for the
    planned batch, not read into a second slot."""
    pool, members = two_tables(tmp_path / "p")
    arena = arena_for(members, (10, 10))
    step = [torch.tensor([7]), torch.tensor([5, 6, 8])]
    planned = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])]
    first = arena.prefetch([torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)])  # (the step's turn)
    still, began = CacheArena._still_missing, []

    def a_step_begins(self, gi, miss, seq):
        if gi == 1 and not began:  # (the lock let go after group 0)
            began.append(self.begin(step, torch.cat(step), [1, 3], seq=first))
        return still(self, gi, miss, seq)

    monkeypatch.setattr(CacheArena, "_still_missing", a_step_begins)
    seq = arena.prefetch(planned)
    assert began and seq > first
    g = arena.groups[1]
    held = g.slot_row[g.slot_row >= 0]
    assert held.numel() == len(set(held.tolist())) == 4                     # 4, 5, 6, 8 and nothing twice
    for r in (4, 5, 6):
        s = int(g.row_slot[r])
        assert s >= 0 and int(g.slot_row[s]) == r and int(g.stamp[s]) >= seq  # (kept for the planned batch)
        assert torch.equal(g.slots[0][s], members[1][0].view()[r])
    assert arena.stats.rows_prefetched == 3 + 1                              # 1, 2, 3 and 4: not 5 or 6 again
    pool.close()


def _begin_checked(arena, members, rows, seq=None):
    """begin() for one id per distinct row; asserts each slot holds its row's home value."""
    seq, slots = arena.begin(rows, torch.cat(rows), [r.numel() for r in rows], seq=seq)
    for g, (ids, s) in enumerate(zip(rows, slots.split([r.numel() for r in rows]))):
        for m in range(2):
            assert bool((s >= 0).all()) and torch.equal(arena.groups[g].slots[m][s], members[g][m].view()[ids])
    return seq, slots


def test_a_batch_the_prefetch_made_resident_whole_begins_without_looking_its_rows_up_again(tmp_path, monkeypatch):
    """begin() of a batch whose every row the prefetch admitted only translates its ids: the
    same slots as a lookup, and the rows' ref bits already set (as the lookup set them)."""
    pool, members = two_tables(tmp_path / "p")
    arena = arena_for(members, (10, 10))
    looked, stamp = [], CacheArena._stamp_hits
    monkeypatch.setattr(CacheArena, "_stamp_hits", lambda self, *a: looked.append(a[-1]) or stamp(self, *a))
    rows = [torch.tensor([1, 7]), torch.tensor([3])]
    seq = arena.prefetch(rows)
    assert looked == [seq]
    assert all(bool(g.ref[g.row_slot[r].long()].all()) for g, r in zip(arena.groups, rows))
    _, slots = _begin_checked(arena, members, rows, seq)
    assert looked == [seq] and arena.stats.hits == arena.stats.rows_needed == 3
    arena.end(rows, seq)
    other = [torch.tensor([1, 7]), torch.tensor([3])]  # (equal rows, another list: not the batch planned)
    seq2 = arena.prefetch(other)
    _, again = _begin_checked(arena, members, [r.clone() for r in other], seq2)
    assert looked == [seq, seq2, seq2] and torch.equal(again, slots)     # looked up: the plan's rows were not given
    pool.close()


def test_a_step_that_steals_a_prefetched_batchs_slot_makes_that_batch_look_its_rows_up_again(tmp_path):
    """A step whose prefetch was skipped (no free slot then) may take a slot of a batch planned
    after it that was prefetched whole; that batch's begin then reads the row again instead of
    translating its ids to a slot that holds another row."""
    pool, members = two_tables(tmp_path / "p")
    arena = arena_for(members, (2, 10))
    none = torch.empty(0, dtype=torch.int64)
    first = [torch.tensor([0, 1]), none]
    s0 = arena.prefetch(first)                                   # a's two slots
    s1 = arena.prefetch([torch.tensor([2]), none])               # no free slot: left to its step
    _begin_checked(arena, members, first, s0)
    arena.end(first, s0)
    late = [torch.tensor([3, 4]), none]
    s2 = arena.prefetch(late)                                    # the slots s0 freed, whole
    assert s2 in arena._complete and s1 not in arena._complete
    _begin_checked(arena, members, [torch.tensor([2]), none], s1)  # steals one of s2's slots
    assert arena.stats.prefetch_stolen == 1
    arena.end([torch.tensor([2]), none], s1)
    _begin_checked(arena, members, late, s2)                     # 3 or 4 read again, not slot -1
    assert arena.stats.misses == 2                               # 2 at s1's begin, the stolen one at s2's
    pool.close()


def test_ids_given_to_the_prefetch_are_translated_there_and_again_at_begin_after_a_steal(tmp_path, monkeypatch):
    """A batch prefetched whole with its ids has them translated to slots by the prefetch: its
    begin gives those (the same tensor) without translating, and its end marks those slots dirty.
    A steal after the prefetch makes begin translate again: every slot it gives holds its row."""
    pool, members = two_tables(tmp_path / "p")
    arena = arena_for(members, (2, 10), write_back=True)
    calls, translate = [], CacheArena._translate
    monkeypatch.setattr(CacheArena, "_translate", lambda self, *a: calls.append(a[-2]) or translate(self, *a))
    none = torch.empty(0, dtype=torch.int64)
    first = [torch.tensor([0, 1]), torch.tensor([4])]
    ids = torch.tensor([1, 0, 1, 4, 4])                          # (duplicates: ids, not rows)
    s0 = arena.prefetch(first, None, ids, [3, 2])
    assert len(calls) == 1 and calls[0] is ids and s0 in arena._complete
    s1 = arena.prefetch([torch.tensor([2]), none], None, torch.tensor([2]), [1, 0])  # no free slot: its step's
    assert s1 not in arena._complete and len(calls) == 1
    pre = arena._complete[s0][2][0]
    got = arena.begin(first, ids, [3, 2], seq=s0)[1]
    assert len(calls) == 1 and got is pre
    assert torch.equal(got, torch.tensor([1, 0, 1, 0, 0]))     # (a's slots 0, 1; b's slot 0)
    arena.end(first, s0)
    assert arena.dirty_slots == 3
    late = [torch.tensor([3, 4]), none]
    late_ids = torch.tensor([4, 3, 4])
    s2 = arena.prefetch(late, None, late_ids, [3, 0])
    assert s2 in arena._complete and len(calls) == 2
    arena.begin([torch.tensor([2]), none], torch.tensor([2]), [1, 0], seq=s1)  # steals s2's slot
    arena.end([torch.tensor([2]), none], s1)
    assert arena.stats.prefetch_stolen == 1
    _, slots = arena.begin(late, late_ids, [3, 0], seq=s2)
    assert len(calls) == 4                                       # s1's begin, and s2's again
    g = arena.groups[0]
    assert torch.equal(g.slot_row[slots], late_ids) and torch.equal(g.slots[0][slots], members[0][0].view()[late_ids])
    arena.end(late, s2)
    with arena.lock:   # (a step's end is settled by the next holder of the lock: every reader takes it)
        assert bool(g.dirty[slots].all())
    pool.close()


def test_a_steal_while_a_prefetch_lets_go_of_the_lock_leaves_that_batch_to_look_its_rows_up(tmp_path, monkeypatch):
    """A slot taken from planned batches between two groups of a prefetch (the lock let go)
    may be one the prefetch just filled: that batch does not count as prefetched whole."""
    pool, members = two_tables(tmp_path / "p")
    arena = arena_for(members, (10, 10))
    still = CacheArena._still_missing

    def a_step_steals(self, gi, miss, seq):
        if gi == 1:
            with self.lock:
                self._took_planned_slots()
        return still(self, gi, miss, seq)

    monkeypatch.setattr(CacheArena, "_still_missing", a_step_steals)
    seq = arena.prefetch([torch.tensor([1, 2]), torch.tensor([3])])
    assert seq not in arena._complete
    monkeypatch.setattr(CacheArena, "_still_missing", still)
    assert arena.prefetch([torch.tensor([4]), torch.tensor([5])]) in arena._complete
    pool.close()


def test_a_filling_cache_takes_its_never_used_slots_in_order_as_the_clock_would_then_goes_round():
    """While a group still has slots that never held a row, from the clock's hand on, a miss
    takes the next of them as one range (no scan of their stamps); it is the scan's choice,
    slot for slot, and once the hand goes round the clock scans again (second chance)."""
    from memory_pool.cache_clock import clock_victims

    def group(S):
        return cache_arena._Group(None, [], [], torch.full((S,), -1, dtype=torch.int32),
                                  torch.full((S,), -1, dtype=torch.int64), torch.full((S,), -1, dtype=torch.int64),
                                  torch.zeros(S, dtype=torch.bool), torch.zeros(S, dtype=torch.bool))

    fast, scan = group(10), group(10)
    scan.untouched = False   # (the scan alone: as if the hand had gone round)
    for seq, (m, floor, ref) in enumerate(((3, 0, None), (4, 0, None), (4, 2, None), (2, 9, 1))):
        if ref is not None:
            fast.ref[ref] = scan.ref[ref] = True   # (slot 1's row needed again: passed over once)
        a, b = clock_victims(fast, m, floor), clock_victims(scan, m, floor)
        assert a is not None and torch.equal(a, b) and fast.hand == scan.hand, (seq, a, b)
        fast.stamp[a] = scan.stamp[b] = seq
        if seq == 0:
            assert fast.untouched and fast.hand == 3   # (the range: taken without a scan)
    assert not fast.untouched                             # (gone round: scans from then on)
    assert a.tolist() == [2, 3]                           # (slot 1 kept: its second chance)


def test_rows_updated_then_evicted_are_read_back_updated_and_pool_writes_refresh_slots(tmp_path):
    """Write-through: a row changed in its slot reaches the home at the step's end, so an
    eviction writes nothing and a later miss reads the new value; a write to the home by the
    pool (an aborted step's before-images, recovery) refreshes the slot."""
    pool, members = two_tables(tmp_path / "p", tier="pmem")
    arena = arena_for(members, (2, 2))
    (a, sa), _ = members
    for m in (0, 1):
        a.use_cache(arena.member(0, 0)), sa.use_cache(arena.member(0, 1))
    r = [torch.tensor([5, 6]), torch.empty(0, dtype=torch.int64)]
    seq, slots = arena.begin(r, torch.tensor([5, 6]), [2, 0])
    arena.flat[0].view(-1, 4)[slots] += 1.0                 # what the fused update does in place
    arena.flat[1][slots] += 2.0
    new_w, new_m = arena.flat[0].view(-1, 4)[slots].clone(), arena.flat[1][slots].clone()
    arena.end(r, seq)
    assert torch.equal(a.view()[[5, 6]], new_w) and torch.equal(sa.view()[[5, 6]].flatten(), new_m)
    seq, _ = arena.begin([torch.tensor([1, 2]), r[1]], torch.tensor([1, 2]), [2, 0])   # evicts 5 and 6
    arena.end([torch.tensor([1, 2]), r[1]], seq)
    assert arena.stats.evictions == 2 and int((arena.groups[0].row_slot[[5, 6]] >= 0).sum()) == 0
    seq, slots = arena.begin([torch.tensor([5]), r[1]], torch.tensor([5]), [1, 0])      # read back
    assert torch.equal(arena.flat[0].view(-1, 4)[slots[0]], new_w[0])
    a.write(torch.tensor([5]), torch.full((1, 4), 9.0))          # the pool's own write path
    assert torch.equal(arena.flat[0].view(-1, 4)[slots[0]], torch.full((4,), 9.0))
    assert torch.equal(a.read(torch.tensor([5, 6])), torch.cat([torch.full((1, 4), 9.0), new_w[1:]]))
    pool.close()


@pytest.mark.parametrize("tier,write_back", [("shm", False), ("pmem", True)])
def test_the_checkpointers_gathers_read_a_write_through_caches_home_grouped_and_a_write_back_cache_through_it(
        tmp_path, tier, write_back):
    """Write-through (real pmem's arena; shm's with ``DLRM_CXL_DIRECT_WRITE_BACK=0``): the home
    holds every row's current value, so the tables behind the cache join their row size's group,
    one gather over the pool's arena, and read the same bytes as each table's own view.
    Write-back (a journaled tier): a slot may be newer than its home, so each table is read
    through its cache, and a changed slot's value is what it reads."""
    pool, members = two_tables(tmp_path / "p", tier=tier)
    arena = arena_for(members, (3, 3), write_back=write_back)
    for ms, gi in zip(members, (0, 1)):
        for m, t in enumerate(ms):
            t.use_cache(arena.member(gi, m))
    rows = [torch.tensor([2, 7, 9]), torch.tensor([0, 4])]
    seq, slots = arena.begin(rows, torch.cat(rows), [3, 2])
    arena.flat[0].view(-1, 4)[slots] += 1.0          # the fused update, in the slots
    arena.end(rows, seq)
    pairs = [(members[0][0], rows[0]), (members[1][0], rows[1]), (members[0][1], rows[0]), (members[1][1], rows[1])]
    gathers = pool.row_gathers(pairs)
    if write_back:
        assert [g.idx for g in gathers] == [[0], [1], [2], [3]] and all(g.read is not None for g in gathers)
    else:
        assert sorted(g.idx for g in gathers) == [[0, 1], [2, 3]] and all(g.grouped for g in gathers)
    got = pool.rows_per_pair(pairs, pool.copy_row_gathers(gathers))
    for (t, ids), g in zip(pairs, got):
        current = t.current_rows(ids)   # (through the cache where it holds newer rows, else the home)
        assert torch.equal(g.reshape(current.shape), current), t.name
    changed = arena.flat[0].view(-1, 4)[slots[:3]]
    assert torch.equal(got[0], changed)               # the update is what either reads
    pool.close()


@pytest.mark.parametrize("write_back", [True, False])
def test_a_steps_end_does_not_wait_for_the_lock_and_is_settled_before_the_next_holder_reads(tmp_path, write_back):
    """The prefetch thread holds the arena's lock while it admits rows; a step's end hands its
    dirty marks and the floor over instead of waiting for it, and the next holder of the lock
    settles them before it reads a mark or takes a slot."""
    pool, members = two_tables(tmp_path / "p", tier="pmem" if write_back else "shm")
    arena = arena_for(members, (4, 4), write_back=write_back)
    rows = [torch.tensor([1, 3, 5]), torch.tensor([2])]
    seq, slots = arena.begin(rows, torch.cat(rows), [3, 1])
    held, release = threading.Event(), threading.Event()

    def holder():
        with arena.lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(30)
        ended = threading.Thread(target=arena.end, args=(rows, seq))
        ended.start()
        ended.join(10)
        assert not ended.is_alive(), "the step's end waited for the lock"
    finally:
        release.set()
        t.join(30)
    assert arena.dirty_slots == (4 if write_back else 0)   # (settled by this read's lock)
    with arena.lock:
        assert bool(arena.groups[0].dirty[slots[:3]].all()) == write_back
    # Its slots are free to take now: a batch of other rows fills the cache past them.
    later = [torch.tensor([0, 6, 7, 8]), torch.tensor([0, 1, 3, 4])]
    seq2, _ = arena.begin(later, torch.cat(later), [4, 4])
    assert arena.stats.evictions == 4 and arena.stats.dirty_evictions == (4 if write_back else 0)
    arena.end(later, seq2)
    # A batch the prefetch made resident whole, its ids translated, begins without the lock too.
    ahead = [torch.tensor([6, 7]), torch.tensor([1])]
    ids = torch.cat(ahead)
    seq3 = arena.prefetch(ahead, None, ids, [2, 1])
    held.clear(), release.clear()
    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(30)
        began = []
        b = threading.Thread(target=lambda: began.append(arena.begin(ahead, ids, [2, 1], seq=seq3)))
        b.start()
        b.join(10)
        assert not b.is_alive() and began[0][0] == seq3, "the step's begin waited for the lock"
    finally:
        release.set()
        t.join(30)
    arena.end(ahead, seq3)
    st = arena.settled_stats()   # (what a report reads: the lock-free begin counted, its 3 rows hits)
    assert (st["steps"], st["rows_needed"], st["hits"], st["misses"]) == (3, 4 + 8 + 3, 3, 4 + 8)
    g = arena.groups[0]
    with arena.lock:
        assert torch.equal(g.slot_row[began[0][1][:2]], ahead[0])   # its slots hold its rows
    pool.close()


def test_a_write_back_arena_keeps_a_steps_rows_in_their_slots_and_every_reader_sees_them(tmp_path):
    """Write-back (journaled tiers): a step's rows stay in their slots, dirty -- the home (the
    working copy) is not written -- yet the checkpointer's gathers, ``persist``, reads and
    ``view`` all see the new values; a dirty row evicted is written home first; after
    ``mark_clean`` an eviction writes nothing."""
    pool, members = two_tables(tmp_path / "p", tier="pmem")
    arena = arena_for(members, (2, 2), write_back=True)
    (a, sa), _ = members
    a.use_cache(arena.member(0, 0)), sa.use_cache(arena.member(0, 1))
    home = a.region.tensor
    old = home[[5, 6]].clone()
    none = torch.empty(0, dtype=torch.int64)
    r = [torch.tensor([5, 6]), none]
    seq, slots = arena.begin(r, torch.tensor([5, 6]), [2, 0])
    arena.flat[0].view(-1, 4)[slots] += 1.0                 # what the fused update does in place
    arena.flat[1][slots] += 2.0
    new_w = arena.flat[0].view(-1, 4)[slots].clone()
    arena.end(r, seq)
    assert torch.equal(home[[5, 6]], old) and not torch.equal(old, new_w)      # the home: not written
    assert arena.dirty_slots == 2
    assert torch.equal(a.current_rows(torch.tensor([5, 6])), new_w)
    assert torch.equal(a.read(torch.tensor([6, 5])), new_w.flip(0))
    (idx, rows), = [g for g in pool.gather_row_groups([(a, torch.tensor([5, 6]))])]
    assert torch.equal(rows, new_w)                                            # the journal's after-images
    seq, slots = arena.begin([torch.tensor([1, 2]), none], torch.tensor([1, 2]), [2, 0])   # evicts 5 and 6
    arena.flat[0].view(-1, 4)[slots] += 3.0
    arena.end([torch.tensor([1, 2]), none], seq)
    assert arena.stats.dirty_evictions == 2 and torch.equal(home[[5, 6]], new_w)      # written home first
    now = a.current_rows(torch.tensor([1, 2]))
    assert not torch.equal(home[[1, 2]], now)
    assert torch.equal(a.view()[[1, 2]], now) and arena.stats.flushes == 2            # view(): flushed first
    arena.mark_clean()
    seq, _ = arena.begin([torch.tensor([7, 8]), none], torch.tensor([7, 8]), [2, 0])
    assert arena.stats.dirty_evictions == 2 and arena.dirty_slots == 0
    pool.close()


def test_a_direct_homes_write_back_cache_goes_home_at_a_recovery_point_and_keeps_before_images_grouped(tmp_path):
    """A direct home (shm) behind a write-back arena flushed at recovery points: a step's rows
    stay in their slots (the home is not written), readers see them through the cache, the undo
    log's before-images (rows the window has not touched: clean) are one gather per row size
    over the pool's arena, and ``flush_caches`` -- the checkpointer's call at a recovery point --
    writes every dirty row of every group home, listing nothing for a working copy's refresh."""
    pool, members = two_tables(tmp_path / "p")
    arena = arena_for(members, (3, 3), write_back=True, homes=arena_homes(pool, members),
                      flushed_at_recovery_points=True)
    assert arena._whole is not None
    for ms, gi in zip(members, (0, 1)):
        for m, t in enumerate(ms):
            t.use_cache(arena.member(gi, m))
    (a, sa), (b, sb) = members
    rows = [torch.tensor([2, 7, 9]), torch.tensor([0, 4])]
    old = [a.region.tensor[rows[0]].clone(), b.region.tensor[rows[1]].clone(), sb.region.tensor[rows[1]].clone()]
    seq, slots = arena.begin(rows, torch.cat(rows), [3, 2])
    slots = slots + torch.tensor([0, 0, 0, 3, 3])     # (each table's slots at its offset in the arena)
    arena.flat[0].view(-1, 4)[slots] += 1.0          # the fused update, in the slots
    arena.flat[1][slots] += 2.0
    arena.end(rows, seq)
    assert arena.dirty_slots == 5
    assert torch.equal(a.region.tensor[rows[0]], old[0]) and torch.equal(b.region.tensor[rows[1]], old[1])
    new = [a.current_rows(rows[0]), b.current_rows(rows[1]), sb.current_rows(rows[1])]
    assert not torch.equal(new[0], old[0]) and not torch.equal(new[2], old[2])
    pairs = [(a, rows[0]), (b, rows[1]), (sa, rows[0]), (sb, rows[1])]
    assert all(g.read is not None for g in pool.row_gathers(pairs))            # readers: through the cache
    before = pool.row_gathers(pairs, before_images=True)
    assert sorted(g.idx for g in before) == [[0, 1], [2, 3]] and all(g.grouped for g in before)
    assert pool.flush_caches() == 5 and arena.dirty_slots == 0 and arena.stats.flushes == 5
    assert torch.equal(a.region.tensor[rows[0]], new[0]) and torch.equal(b.region.tensor[rows[1]], new[1])
    assert torch.equal(sb.region.tensor[rows[1]], new[2])
    assert pool.flush_caches() == 0                                             # clean now: nothing to write
    assert [x.numel() for x in arena.take_spilled()] == [0, 0]
    # No recovery point for 70 steps (``--checkpoint none``): the list of slots marked, past a
    # sixteenth of the slots, is dropped for a scan of the marks; the flush still finds them all.
    for _ in range(70):
        seq, slots = arena.begin(rows, torch.cat(rows), [3, 2])
        arena.flat[0].view(-1, 4)[slots + torch.tensor([0, 0, 0, 3, 3])] += 1.0
        arena.end(rows, seq)
    assert arena.dirty_slots == 5 and arena._dirty_list is None
    assert pool.flush_caches() == 5 and arena._dirty_list == []
    assert torch.equal(a.region.tensor[rows[0]], a.current_rows(rows[0]))
    assert torch.allclose(a.region.tensor[rows[0]], new[0] + 70.0)   # (changed since the first flush)
    pool.close()


def test_a_journaled_homes_misses_are_requested_a_run_of_pages_at_a_time(tmp_path):
    """``Region.will_need``: the pages of the rows a cache is about to read, adjacent pages in
    one read request (rows of 256 bytes: 16 a page); a direct tier's home needs none."""
    with MemoryPool.create(tmp_path / "p", tier="pmem") as pool:
        t = pool.create_table("t", 4096, 64)
        assert t.region.will_need(torch.tensor([0, 1, 15])) == 1                 # page 0
        assert t.region.will_need(torch.tensor([0, 16, 40])) == 1                # pages 0, 1, 2: one run
        assert t.region.will_need(torch.tensor([0, 17, 100, 4095])) == 3         # pages 0-1, 6, 255
        assert t.region.will_need(torch.empty(0, dtype=torch.int64)) == 0
    with MemoryPool.create(tmp_path / "s", tier="shm") as pool:
        assert pool.create_table("t", 4096, 64).region.will_need(torch.tensor([0, 100])) == 0


def test_a_budget_too_small_for_one_batch_is_refused_before_a_pool_is_made(tmp_path):
    with pytest.raises(CacheTooSmallError, match="cannot hold one batch") as e:
        train(tmp_path / "p", 3, dram_cache_bytes=MIN - 1)
    assert e.value.exit_code == 2 and "--dram-cache to at least" in e.value.hint
    assert not (tmp_path / "p").exists()
    CacheArenaConfig.for_budget(MIN, SPEC, batch_rows=TINY.batch_size)  # (the bound is exact)


def test_a_budget_caches_small_tables_whole_and_splits_the_rest_equally_among_the_big_ones():
    """The split is max-min fair: every table gets the same number of slots beyond one batch,
    up to all its rows. A table small enough is cached whole (the proportional split left a
    mid-sized table a share of its rows, which it then evicted and read back every step), the
    big ones share what is left equally, and no slot more fits the budget."""
    from memory_pool.cache_config import META_BYTES_PER_SLOT

    spec = [("tiny", 10, (8, 1)), ("mid", 3_000, (8, 1)), ("big", 1_000_000, (8, 1)), ("huge", 5_000_000, (8, 1))]
    slot = 4 * 9 + META_BYTES_PER_SLOT
    budget = CacheArenaConfig.min_budget(spec, 100) + (3_000 - 100 + 2 * 50_000) * slot + slot - 1
    c = CacheArenaConfig.for_budget(budget, spec, batch_rows=100)
    assert [(g.name, g.slots) for g in c.groups] == [("tiny", 10), ("mid", 3_000), ("big", 50_100), ("huge", 50_100)]
    assert c.nbytes <= budget < c.nbytes + slot                   # one slot more does not fit
    # A budget past every table's rows caches every row; one batch's worth caches one batch.
    full = CacheArenaConfig.for_budget(10 ** 10, spec, batch_rows=100)
    assert [g.slots for g in full.groups] == [10, 3_000, 1_000_000, 5_000_000]
    least = CacheArenaConfig.for_budget(CacheArenaConfig.min_budget(spec, 100), spec, batch_rows=100)
    assert [g.slots for g in least.groups] == [10, 100, 100, 100]


# --------------------------------------------------------------------------- a journaled working copy, bounded


def anonymous_bytes_at(addr: int) -> int:
    """The anonymous memory of the mapping holding ``addr`` (``/proc/self/smaps``): the
    copy-on-write pages of a private file mapping."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Anonymous:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_trimming_a_journaled_working_copy_gives_its_pages_back_and_keeps_every_value(tmp_path, tier, monkeypatch):
    """``trim_working_copy``: the private pages a journaled tier's working copy holds (anonymous
    memory, one per page written) are given back, and every row still reads its committed
    value -- now, and after the pool is closed and opened again. (Written home in place, with
    no row overlay: ``DLRM_CXL_RUNS_MB=0``; with one, tests/test_cache_overlay.py.)"""
    monkeypatch.setenv("DLRM_CXL_RUNS_MB", "0")
    path = tmp_path / "p"
    pool = MemoryPool.create(path, tier=tier)
    t = pool.create_table("t", 1 << 15, 64, init="uniform", seed=1)         # 8 MiB, 2,048 pages
    pool.bound_working_copy(["t"])
    ids = torch.arange(0, 1 << 15, 8)                                        # two rows in every page
    t.write(ids, torch.randn(ids.numel(), 64))
    t.persist()                                                              # committed to the journal
    expected = t.view().clone()
    image = t.region.path
    assert not torch.equal(torch.from_file(str(image), size=expected.numel()).view_as(expected), expected)
    assert anonymous_bytes_at(t.view().data_ptr()) >= 8 << 20               # (every page written: copied)
    assert pool.trim_working_copy(["t"]) and pool.stats.trims == 1
    assert anonymous_bytes_at(t.view().data_ptr()) == 0
    assert torch.equal(t.view(), expected)
    # (the committed rows are in the image's page cache now: what the fresh mapping reads)
    assert torch.equal(torch.from_file(str(image), size=expected.numel()).view_as(expected), expected)
    t.write(torch.tensor([3]), torch.full((1, 64), 7.0))                     # and it still trains
    t.persist()
    expected[3] = 7.0
    pool.close()
    with MemoryPool.open(path) as again:
        assert torch.equal(again.table("t").view(), expected)


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_a_refresh_with_nothing_written_gives_the_pages_back_without_waiting_for_a_compaction(tmp_path, tier,
                                                                                             monkeypatch):
    """A recovery point where the working copy grew only by the pages misses read (no dirty row
    evicted into it) refreshes it with nothing to write: its pages are dropped where they are
    (the file pages it mapped, and the image's clean page cache), every row reads the same, and
    nothing waits for the compactor -- the trainer neither drains its checkpointer for it
    (``WorkingCopyBound.after_commit``) nor stops behind a write-back pass."""
    from memory_pool.compaction import Compaction
    from memory_pool.residency import page_cache_bytes

    path = tmp_path / "p"
    pool = MemoryPool.create(path, tier=tier)
    t = pool.create_table("t", 1 << 15, 64, init="uniform", seed=1)         # 8 MiB, 2,048 pages
    pool.bound_working_copy(["t"])
    t.write(torch.arange(0, 1 << 15, 64), torch.randn(512, 64))
    t.persist()
    assert pool.trim_working_copy(["t"]) and pool.stats.trims == 1          # (every committed row home)
    expected = t.view().clone()                                              # (reads every page)
    assert page_cache_bytes([t.region.path]) >= 4 << 20

    def no_wait(self, *a, **k):
        raise AssertionError("a refresh with nothing to write waited for the compactor")

    monkeypatch.setattr(Compaction, "wait", no_wait)
    assert pool.trim_working_copy(["t"], {"t": torch.empty(0, dtype=torch.int64)}) and pool.stats.refreshes == 1
    monkeypatch.undo()
    assert page_cache_bytes([t.region.path]) < 1 << 20                       # the pages given back
    assert torch.equal(t.view(), expected)
    pool.close()
    with MemoryPool.open(path) as again:
        assert torch.equal(again.table("t").view(), expected)


def test_the_image_pages_a_write_back_pass_wrote_are_given_back_by_the_pass_itself(tmp_path, monkeypatch):
    """Behind a DRAM cache the images' page cache counts in the budget. A write-back pass dirties
    a page per row it writes, through a mapping of its own; left mapped and dirty, nothing could
    drop them, and they piled up pass after pass (2.3 GB behind `kaggle`'s 2.2 GB budget). The
    pass writes them out and drops them itself, on the compactor's thread (a refresh on the
    trainer's thread only reclaims clean pages): once it is over, the image holds no page in the
    page cache, and every row reads the same, now and after a reopen."""
    from memory_pool.residency import page_cache_bytes

    monkeypatch.setenv("DLRM_CXL_SEGMENT_MB", str(64 / 1024))                 # 64 KiB segments
    monkeypatch.setenv("DLRM_CXL_RUNS_MB", "0")                              # (passes: no row overlay)
    path = tmp_path / "p"
    pool = MemoryPool.create(path, tier="pmem")
    t = pool.create_table("t", 1 << 15, 64, init="uniform", seed=1)         # 8 MiB, 2,048 pages
    pool.bound_working_copy(["t"])
    assert pool.trim_working_copy(["t"])                                     # (the first one: a trim)
    for k in range(8):                                                       # a row in every page
        t.write(torch.arange(k, 1 << 15, 16), torch.full(((1 << 15) // 16, 64), float(k)))
        t.persist()
    expected = t.view().clone()
    assert pool.trim_working_copy(["t"], {"t": torch.empty(0, dtype=torch.int64)})  # (view()'s pages)
    pool.apply(wait=True)
    assert pool.stats.applies >= 1 and pool.stats.bytes_written_back >= 2 << 20
    assert page_cache_bytes([t.region.path]) < 1 << 20, "the pass's pages stayed in the page cache"
    assert torch.equal(t.view(), expected)
    pool.close()
    with MemoryPool.open(path) as again:
        assert torch.equal(again.table("t").view(), expected)


def test_trimming_is_refused_on_a_direct_tier(tmp_path):
    """On a direct tier (shm: the working copy is the device) nothing is done. (A journaled pool
    with a row overlay trims through it: tests/test_cache_overlay.py.)"""
    with MemoryPool.create(tmp_path / "s", tier="shm") as pool:
        pool.create_table("t", 64, 4)
        assert not pool.trim_working_copy(["t"])
        assert not pool.trim_working_copy(["t"], {"t": torch.empty(0, dtype=torch.int64)})
        assert pool.stats.trims == pool.stats.refreshes == 0


# --------------------------------------------------------------------------- training on the cache


@pytest.mark.parametrize("tier,k", [("shm", 2), ("pmem", 1), ("shm", 4), ("power-sim", 2)])
def test_cached_fused_path_is_bit_identical_to_the_uncached_over_50_steps_with_evictions(root, uncached, tier, k,
                                                                                          monkeypatch):
    """(On the journaled tiers the working copy is also given back at recovery points -- at
    nearly every one with this budget, which the arena fills -- so the digest checks the trims:
    tiny's homes are all below the size where dirtiness counts, so it is made to count here,
    and trims compact through the row overlay, whose rows are read back from its runs.)"""
    if tier in ("pmem", "power-sim"):
        monkeypatch.setattr(cache_arena, "DIRTY_FROM_HOME_BYTES", 0)
    digest, summary, t = train(root / f"cached-{tier}-{k}", N, tier=tier, dram_cache_bytes=BUDGET,
                               prefetch_batches=k, window=WINDOW)
    if tier in ("pmem", "power-sim"):
        m = summary.pool_stats["memory"]
        assert m["trims"] >= 1 and m["trims"] + m["refreshes"] > 3 and summary.pool_stats["trims"] == m["trims"]
        p = summary.pool_stats
        assert p["bytes_to_runs"] > 0 and p["run_rows_replayed"] > 0, p  # (rows read back from the runs)
    else:
        assert "trims" not in summary.pool_stats["memory"]
    c = summary.pool_stats["cache"]
    assert c["evictions"] > 1000 and c["misses"] + c["rows_prefetched"] > c["slots"], c
    # (Whether some rows were still missing when their step began is the prefetch thread's
    # timing: on a loaded machine it once kept ahead of all 50 steps, a hit rate of 1. The
    # step's own admissions are tested on the arena itself, above.)
    assert c["rows_prefetched"] > 0 and 0 < c["hit_rate"] <= 1 and c["bytes_written_home"] > 0
    # (rows never trained created from the initializer, not read: memory_pool/fresh.py)
    assert 0 < c["rows_created"] < c["misses"] + c["rows_prefetched"], c
    assert summary.pool_stats["memory"]["budget_bytes"] == BUDGET and summary.pool_stats["memory"]["vm_rss"] > 0
    assert t.model.cache_bags is not None and t.fused  # (fbgemm's kernels, not the reference path)
    assert digest == uncached[N]


def test_a_direct_homes_cache_writes_each_row_home_once_a_window_and_leaves_the_home_exact(root, uncached,
                                                                                              monkeypatch):
    """A direct home's write-back arena, flushed at every recovery point, against the same run
    written through (``DLRM_CXL_DIRECT_WRITE_BACK=0``): the same digest as the uncached run,
    fewer bytes written home (a row changed in several steps of a window goes home once), and
    the home alone -- the pool reopened without a cache -- holds the trained model."""
    stats = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("DLRM_CXL_DIRECT_WRITE_BACK", mode)
        path = root / f"direct-shm-{mode}"
        digest, summary, t = train(path, N, dram_cache_bytes=BUDGET, window=WINDOW)
        assert digest == uncached[N] and t.model.cache_bags.arena.flushed_at_recovery_points == (mode == "1")
        stats[mode] = summary.pool_stats["cache"]
        assert train(path, N)[0] == uncached[N]   # (reopened, no cache: the home itself)
    assert stats["1"]["flushes"] > 0 and stats["0"]["flushes"] == 0
    assert stats["1"]["bytes_written_home"] < 0.8 * stats["0"]["bytes_written_home"], stats


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
@pytest.mark.parametrize("dirty", ["ignored", "cleaned"])
def test_refreshing_or_trimming_a_journaled_working_copy_keeps_every_row(root, uncached, tier, dirty, monkeypatch):
    """A refresh maps the images afresh without the trim's pass over the journal: only the rows
    the cache wrote into the working copy (dirty rows evicted) go into the images first.
    ``ignored``: dirtiness never asks for a trim, so after the first trim every recovery point
    refreshes, with thousands of dirty rows evicted into the working copy in between.
    ``cleaned``: every table's dirtiness counts (tiny's homes are all below the size where it
    does), so trims clean the slots again and again."""
    if dirty == "ignored":
        monkeypatch.setattr(WorkingCopyBound, "CLEAN_AT_DIRTY", 2.0)
    else:
        monkeypatch.setattr(cache_arena, "DIRTY_FROM_HOME_BYTES", 0)
    digest, summary, _ = train(root / f"refresh-{tier}-{dirty}", N, tier=tier, dram_cache_bytes=BUDGET, window=WINDOW)
    m, c = summary.pool_stats["memory"], summary.pool_stats["cache"]
    if dirty == "ignored":
        # (no trim at all: the open replayed nothing into the working copy, and the refreshes
        # list every row written into it since -- WorkingCopyBound)
        assert m["trims"] == 0 and m["refreshes"] > 3 and c["dirty_evictions"] > 1000, (m, c)
    else:
        assert m["trims"] > 3, (m, c)
    assert digest == uncached[N]


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_dirty_slots_a_compaction_put_home_become_clean_and_read_its_value_back_after_eviction(
        root, uncached, tier, monkeypatch):
    """A background compaction writes home (in place, or into its run) the newest committed
    value of every row changed up to a recovery point; at the next recovery point the dirty
    slots no step changed since become clean without a trim (``WorkingCopyBound._clean_compacted``),
    their rows read from where the compaction put them. Here the working copy is never given
    back (no trim, no refresh: each would make every run row pending again, and hide a row
    left reading the working copy), compactions come every few steps, and the arena holds two
    fifths of the rows: cleaned slots are evicted without a write and read back from the runs
    and the images -- and every row stays right. (With the rows left reading the working copy
    -- ``Overlay.pend_absorbed`` made to change no ``where`` -- this run's digest differs from
    the uncached run's.)"""
    monkeypatch.setattr(cache_arena, "DIRTY_FROM_HOME_BYTES", 0)  # (tiny's dirtiness counts)
    monkeypatch.setattr(WorkingCopyBound, "CLEAN_AT_DIRTY", 2.0)
    monkeypatch.setattr(WorkingCopyBound, "TRIM_EARLY_AT_DIRTY", 2.0)
    monkeypatch.setattr(WorkingCopyBound, "MIN_ALLOWANCE", 10 ** 6)
    monkeypatch.setenv("DLRM_CXL_COMPACT_MB", str(256 / 1024))
    monkeypatch.setenv("DLRM_CXL_SEGMENT_MB", str(64 / 1024))
    # Each recovery point first waits for the compaction running, if any: the cleaning itself
    # does not wait (Compaction.settled), so on a loaded machine a compaction still running at
    # every recovery point after the one before it left fewer slots to clean (80 in one CI run).
    clean = WorkingCopyBound._clean_compacted

    def settled_first(self):
        self.pool.wait_compaction()
        return clean(self)

    monkeypatch.setattr(WorkingCopyBound, "_clean_compacted", settled_first)
    budget = MIN + (TINY.table_bytes - MIN) * 2 // 5
    digest, summary, _ = train(root / f"clean-compacted-{tier}", N, tier=tier, dram_cache_bytes=budget, window=WINDOW)
    m, c, p = summary.pool_stats["memory"], summary.pool_stats["cache"], summary.pool_stats
    assert m["trims"] == 0 and m["refreshes"] == 0 and p["compactions"] >= 3, (m, p)
    assert c["cleaned"] > 100 and c["rows_from_log"] > 0 and c["evictions"] > c["dirty_evictions"], c
    assert digest == uncached[N]


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_a_trim_for_dirty_slots_comes_right_after_the_compaction_it_asks_for(root, uncached, tier, monkeypatch):
    """Dirty slots past ``TRIM_EARLY_AT_DIRTY`` ask the checkpointer for a compaction (the
    journal's own threshold is out of reach here, and the immediate trim is off), and the trim
    comes at the first recovery point after that compaction ended: every trim follows a
    compaction of its own, the journal then holds only what was committed since, and every row
    stays right."""
    from memory_pool.pool import MemoryPool as Pool

    monkeypatch.setattr(cache_arena, "DIRTY_FROM_HOME_BYTES", 0)  # (tiny's dirtiness counts)
    monkeypatch.setattr(WorkingCopyBound, "CLEAN_AT_DIRTY", 2.0)
    monkeypatch.setenv("DLRM_CXL_COMPACT_MB", "4096")
    seen = []  # (compactions ended, journal bytes) at each trim
    trim = Pool.trim_working_copy

    def spy(self, names, written=None):
        if written is None:
            seen.append((self.stats.compactions, self.journal.live_bytes))
        return trim(self, names, written)

    monkeypatch.setattr(Pool, "trim_working_copy", spy)
    digest, summary, _ = train(root / f"early-trim-{tier}", N, tier=tier, dram_cache_bytes=BUDGET, window=WINDOW)
    ends = [c for c, _ in seen]
    assert len(seen) >= 2 and ends[0] >= 1 and all(a < b for a, b in zip(ends, ends[1:])), seen
    assert summary.pool_stats["memory"]["trims"] == len(seen) and summary.pool_stats["compactions"] >= len(seen)
    assert digest == uncached[N]


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
@pytest.mark.parametrize("runs", ["in-place", "overlay"])
def test_write_back_passes_refreshes_and_trims_interleaved_keep_every_row(root, uncached, tier, runs, monkeypatch):
    """Emulated pmem writes sealed journal segments back into the images between compactions
    (apply passes, record after record); a refresh writes the dirty rows the cache evicted into
    the images, and no older record is written over them afterwards (``Compaction.refresh``)
    -- except rows cached again and changed since their eviction, whose home copy is older
    than their slot: a trim must still write their newer records (``CacheArena.take_spilled``
    leaves them out; with them in, this run diverged). Here a pass follows nearly every seal,
    and every recovery point gives the working copy back (the arena fills a tenth of the
    rest), a trim at every third (the group's dirtiness reads as full there), a refresh at the
    others: a fixed schedule, where the real dirtiness made it depend on the machine's speed.
    Power-sim makes no passes between compactions: only the trims' own. ``overlay``: the same
    schedule with the row overlay a pool behind a cache keeps by default -- no passes; trims
    compact through it, and background compactions (a tiny threshold) come between them, so
    that rows move into runs, are made pending again by every refresh and trim, are taken
    back, evicted dirty and written home by refreshes, and tombstoned."""
    if runs == "in-place":
        monkeypatch.setenv("DLRM_CXL_RUNS_MB", "0")
    else:
        monkeypatch.setenv("DLRM_CXL_COMPACT_MB", str(256 / 1024))
    points = itertools.count()
    monkeypatch.setattr(cache_arena.CacheArena, "dirty_fraction",
                        property(lambda self: 1.0 if next(points) % 3 == 2 else 0.0))
    monkeypatch.setenv("DLRM_CXL_SEGMENT_MB", str(64 / 1024))
    monkeypatch.setenv("DLRM_CXL_APPLY_MB", str(16 / 1024))
    budget = MIN + (TINY.table_bytes - MIN) // 10
    digest, summary, _ = train(root / f"refresh-apply-{tier}-{runs}", N, tier=tier, dram_cache_bytes=budget, window=WINDOW)
    m, c, p = summary.pool_stats["memory"], summary.pool_stats["cache"], summary.pool_stats
    assert m["trims"] >= 3 and m["refreshes"] >= 6 and c["dirty_evictions"] > 1000, m
    if runs == "in-place":
        assert p["applies"] >= (4 if tier == "pmem" else m["trims"]), (p["applies"], m)
    else:
        assert p["applies"] == 0 and p["compactions"] > m["trims"], (p, m)
        assert p["bytes_to_runs"] > 0 and p["run_rows_replayed"] > 0, p
    assert digest == uncached[N]


def test_the_optimizer_states_homes_stay_in_memory_through_trims_and_train_bit_identical(root, uncached, monkeypatch):
    """On a journaled tier the optimizer state's homes (row-wise Adagrad: 4 bytes a row) are
    kept in the page cache when they are small beside the budget (``fused.PINNED_STATE_SHARE``;
    tiny's are too big for the default share, so it is raised here): a miss then reads its
    weights' page only. A trim drops the weights' images from the page cache, never the
    states'; and the run stays bit-identical to the uncached one."""
    from dlrm_cxl import fused
    from memory_pool.residency import PAGE, page_cache_bytes

    monkeypatch.setattr(fused, "PINNED_STATE_SHARE", 1)
    monkeypatch.setattr(cache_arena, "DIRTY_FROM_HOME_BYTES", 0)  # (trims: tiny's dirtiness counts)
    t = Trainer(TrainOptions(pool=str(root / "pinned"), steps=N, threads=1, progress=False, tier="pmem",
                             dram_cache_bytes=BUDGET, window=WINDOW), TINY, log=lambda s: None)
    try:
        summary = t.run()
        digest = t.digest()
        weights = [t.pool.table(f) for f in TINY.feature_names]
        states = [t.pool.table(state_table_name(f)) for f in TINY.feature_names]
        assert all(s.region.keep_cached for s in states) and not any(w.region.keep_cached for w in weights)
        m = summary.pool_stats["memory"]
        assert m["trims"] >= 1 and m["trims"] + m["refreshes"] > 3, m
        # (the states' pages read in whole, as their read-ahead asks for: a page the run's misses
        # did not fault in may not be cached yet -- POSIX_FADV_WILLNEED is a hint -- and the
        # closing digest no longer reads a cached row's home)
        for s in states:
            with open(s.region.path, "rb") as f:
                f.read()
        whole = sum(-(-s.region.nbytes // PAGE) * PAGE for s in states)
        assert page_cache_bytes(s.region.path for s in states) == whole
        t.pool.compact()  # (every image written back and synced: its pages clean, droppable)
        t.pool.trim_working_copy([w.name for w in weights + states])  # (one more, right now)
        assert page_cache_bytes(s.region.path for s in states) == whole
        assert page_cache_bytes(w.region.path for w in weights) == 0
    finally:
        t.close()
    assert digest == uncached[N]


def _read_ahead_window(path) -> int:
    """The device's read-ahead window under ``path`` (bytes; 128 KiB if it cannot be read)."""
    dev = os.stat(path).st_dev
    for q in (f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/read_ahead_kb",
              f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/../queue/read_ahead_kb"):
        try:
            return int(open(q).read()) << 10
        except (OSError, ValueError):
            pass
    return 128 << 10


def test_a_read_ahead_caches_a_whole_image_larger_than_the_devices_read_ahead_window(tmp_path):
    """``FileRegion.read_ahead`` (the optimizer states kept in memory behind a cache) brings the
    whole image into the page cache: one POSIX_FADV_WILLNEED reads at most the device's
    read-ahead window (8 MiB here), so it asks piece by piece."""
    import time

    from memory_pool.residency import PAGE, page_cache_bytes

    size = 2 * _read_ahead_window(tmp_path) + (1 << 20)
    pool = MemoryPool.create(tmp_path / "p", tier="pmem")
    try:
        t = pool.create_table("states", size // 4, 1, init="uniform", seed=1)
        r = t.region
        r.drop_cache()
        before = page_cache_bytes([r.path])
        r.read_ahead()
        whole = -(-r.nbytes // PAGE) * PAGE
        deadline = time.monotonic() + 20
        while page_cache_bytes([r.path]) < whole and time.monotonic() < deadline:
            time.sleep(0.05)  # (the reads are queued, not waited for)
        assert before < whole // 2 and page_cache_bytes([r.path]) == whole
    finally:
        pool.close()


def test_prefetched_batches_that_are_never_trained_change_nothing(root, uncached):
    pool = root / "unused"
    _, _, t = train(pool, N // 2, dram_cache_bytes=BUDGET)
    # (the run's own prefetch thread planned batches past the end; plan three more by hand)
    t = Trainer(TrainOptions(pool=str(pool), steps=N, threads=1, progress=False, tier="shm",
                             dram_cache_bytes=BUDGET), TINY, log=lambda s: None)
    try:
        batches = t.source.iter_batches(None)
        for _ in range(3):
            plan = t.plan(next(batches)[0])
            assert plan.cache_seq is not None
        assert t.model.cache_bags.arena.stats.rows_prefetched > 0
    finally:
        t.close()
    assert train(pool, N, dram_cache_bytes=BUDGET)[0] == uncached[N]


# --------------------------------------------------------------------------- crashes


@pytest.mark.parametrize("tier,phase", [("shm", "mid-update"), ("shm", "random"), ("pmem", "after-update"),
                                        ("pmem", "random")])
def test_sigkill_with_the_cache_active_recovers_bit_exact(cli, root, uncached, tier, phase):
    """A real SIGKILL (``--crash-at``) with the cache arena and its prefetch active: the resumed
    run ends at the uncached uninterrupted run's digest."""
    pool = root / f"crash-{tier}-{phase}"
    flags = ["--preset", "tiny", "--tier", tier, "--threads", "1", "--no-progress", "--dram-cache", BUDGET]
    crash = cli.run(["train", "--pool", pool, *flags, "--steps", N, "--crash-at", f"{N // 2}:{phase}"])
    assert killed(crash), (crash.returncode, crash.stderr[-3000:])
    res = cli.run(["train", "--pool", pool, *flags, "--steps", N])
    assert digest_of(res) == uncached[N], res.stdout[-2000:]
    assert "dram cache:" in res.stdout and "hit rate" in res.stdout
    # A direct tier's crash leaves no record of the rows still initial: the resumed run reads
    # every miss. A journaled tier keeps it (memory_pool/fresh.py): the resumed run creates some.
    created = re.search(r" ([\d,]+) of the rows missed never trained \(created, not read\)", res.stdout)
    assert created is not None, res.stdout[-2000:]
    assert (int(created.group(1).replace(",", "")) > 0) == (tier == "pmem"), res.stdout[-2000:]


def _assert_every_crc32_right(path):
    """Each record of the zip at ``path`` checks against its central directory's crc32
    (``testzip``), and the data descriptor after its bytes (what torch's writer puts there,
    and what a streaming unzip checks) holds the same crc32."""
    import struct
    import zlib

    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        assert zf.testzip() is None
        for info in zf.infolist():
            f.seek(info.header_offset)
            head = f.read(30)
            n, m = struct.unpack_from("<HH", head, 26)
            f.seek(info.header_offset + 30 + n + m)
            data = f.read(info.file_size)
            sig, crc = struct.unpack("<4sI", f.read(8))
            assert sig == b"PK\x07\x08" and crc == info.CRC == zlib.crc32(data), info.filename


def test_an_export_streams_the_newest_rows_of_a_pool_behind_a_cache_and_leaves_its_pending_rows_pending(tmp_path):
    """``export`` of a pool trained behind a write-back cache on emulated pmem: each table's
    newest rows (what ``Table.view`` shows once it has applied the rows still pending) read in
    pieces through ``Table.snapshot`` and streamed to the file, with nothing applied to the
    working copy and no scratch file left beside the output."""
    from dlrm_cxl.model import to_torchrec_state_dict
    from dlrm_cxl.export import write_torchrec_state
    from dlrm_cxl.model_io import open_model

    pool = tmp_path / "p"
    train(pool, 16, tier="pmem", dram_cache_bytes=BUDGET, window=WINDOW)
    out = tmp_path / "out" / "dlrm.pt"
    out.parent.mkdir()
    p, _, model = open_model(pool, replay="on-demand")   # (as `dlrm-cxl export` opens it)
    try:
        pending = p.rows_pending
        assert pending > 0   # (rows newer than the home: the export must read them)
        n = write_torchrec_state(model, out)
        assert p.rows_pending == pending and n == out.stat().st_size
        assert os.listdir(out.parent) == ["dlrm.pt"]
        _assert_every_crc32_right(out)
        got = torch.load(out, weights_only=True)
        ref = to_torchrec_state_dict(model)   # (Table.view: the pending rows applied first)
        assert p.rows_pending < pending
        assert list(got) == list(ref)
        for k, v in ref.items():
            assert got[k].numpy().tobytes() == v.numpy().tobytes(), k
    finally:
        p.close()


def test_a_digest_reads_the_rows_the_cache_and_the_journal_hold_newer_and_changes_nothing(tmp_path):
    """The state digest of a trainer behind a write-back cache, on emulated pmem, read while the
    cache holds dirty rows and a resumed run's journal rows are still pending (Table.snapshot;
    rows never trained are made from the initializer, not read): nothing is flushed or
    applied, and it equals an uninterrupted uncached run's."""
    pool = tmp_path / "p"
    train(pool, 8, tier="pmem", dram_cache_bytes=BUDGET, window=WINDOW)
    t = Trainer(TrainOptions(pool=str(pool), steps=16, threads=1, progress=False, tier="pmem",
                             dram_cache_bytes=BUDGET, window=WINDOW), TINY, log=lambda s: None)
    try:
        t.run()
        arena = t.model.cache_bags.arena
        dirty, pending = arena.dirty_slots, t.pool.rows_pending
        assert dirty > 0 and pending > 0   # (both sources of newer rows are there to be read)
        digest = t.digest()
        assert (arena.dirty_slots, t.pool.rows_pending) == (dirty, pending)
    finally:
        t.close()
    assert digest == train(tmp_path / "plain", 16)[0]
