"""On-demand replay (memory_pool/ondemand.py): ``MemoryPool.open(..., replay="on-demand")`` reads
and verifies the journal like an eager open, but applies each committed row to the working copy
only when something first needs it -- and the pool then holds exactly what an eager open holds,
whatever reads, writes, compacts or crashes in between."""

from __future__ import annotations

import pytest
import torch

from memory_pool import MemoryPool
from memory_pool.errors import InvalidConfigError, PoolCorruptError
from memory_pool.journal import RecordType

from test_pool import all_rows, new_pool

ROWS, DIM = 4096, 16
JOURNALED = ["pmem", "power-sim"]


def journaled_pool(path, tier) -> torch.Tensor:
    """A pool whose image holds its first values and whose journal holds three committed
    transactions, the later ones overwriting rows of the earlier ones (the newest must win).
    Returns every row as the pool must hold them."""
    pool, t, ref = new_pool(path, tier, rows=ROWS, dim=DIM)
    for k, rows in enumerate((torch.arange(0, 600), torch.arange(300, 900), torch.arange(0, 4096, 7))):
        vals = torch.full((rows.numel(), DIM), 100.0 + k) + rows[:, None].float() / ROWS
        t.write(rows, vals)
        pool.persist()
        ref[rows] = vals
    pool.close()  # no compaction: the rows are only in the journal (and the image is older)
    return ref


def working_copy(pool, name="t") -> torch.Tensor:
    """The table as the working copy holds it now, without applying anything (the fused
    kernels' view: ``arena_tensor(on_demand=True)``)."""
    t = pool.table(name)
    flat = pool.arena_tensor(torch.float32, on_demand=True)
    start = t.arena_offset // 4
    return flat[start:start + t.num_embeddings * t.embedding_dim].view(t.num_embeddings, t.embedding_dim).clone()


@pytest.mark.parametrize("tier", JOURNALED)
def test_an_on_demand_open_applies_a_row_when_it_is_first_read_and_ends_equal_to_an_eager_open(tier, tmp_path):
    ref = journaled_pool(tmp_path / "p", tier)
    with MemoryPool.open(tmp_path / "p", read_only=True) as eager:
        assert torch.equal(all_rows(eager.table("t")), ref)
        assert eager.rows_pending == 0
    with MemoryPool.open(tmp_path / "p", replay="on-demand") as pool:
        pending = pool.rows_pending
        assert pending == pool.stats.rows_deferred == 900 + len(range(0, 4096, 7)) - len(range(0, 900, 7))
        before = working_copy(pool)
        assert not torch.equal(before, ref)  # deferred: the working copy still holds the image's rows
        assert torch.equal(before[1000:1001], ref[1000:1001])  # (a row the journal never held)
        ids = torch.tensor([5, 5, 450, 1000, 4095])  # a duplicate; a row not pending; the newest txn's row
        assert torch.equal(pool.table("t").read(ids), ref[ids])
        assert pool.rows_pending == pending - 3  # 5, 450, 4095 (4095 = 7 * 585)
        now = working_copy(pool)
        assert torch.equal(now[ids], ref[ids])
        assert not torch.equal(now, ref)
        assert torch.equal(all_rows(pool.table("t")), ref)
        assert pool.rows_pending == 0 and pool.stats.rows_replayed == pending
        assert torch.equal(working_copy(pool), ref)


@pytest.mark.parametrize("tier", JOURNALED)
def test_ready_applies_exactly_the_rows_a_fused_reader_asks_for(tier, tmp_path):
    ref = journaled_pool(tmp_path / "p", tier)
    with MemoryPool.open(tmp_path / "p", replay="on-demand") as pool:
        t = pool.table("t")
        ids = torch.arange(290, 310)
        assert not torch.equal(working_copy(pool)[ids], ref[ids])
        pool.ready([(t, ids)])
        assert torch.equal(working_copy(pool)[ids], ref[ids])
        assert not torch.equal(working_copy(pool)[310:320], ref[310:320])
        pool.arena_tensor()  # without on_demand: every row first
        assert pool.rows_pending == 0
        assert torch.equal(working_copy(pool), ref)


@pytest.mark.parametrize("tier", JOURNALED)
def test_a_pending_row_overwritten_before_it_was_read_keeps_the_new_value_through_compaction_and_reopen(tier, tmp_path):
    ref = journaled_pool(tmp_path / "p", tier)
    with MemoryPool.open(tmp_path / "p", replay="on-demand") as pool:
        t = pool.table("t")
        ids = torch.tensor([0, 350, 700])
        new = torch.full((3, DIM), -7.0)
        t.write(ids, new)
        pool.persist()
        ref[ids] = new
        assert torch.equal(t.read(ids), new)
        pool.compact()
        assert torch.equal(all_rows(t), ref)
    with MemoryPool.open(tmp_path / "p", read_only=True) as again:
        assert torch.equal(all_rows(again.table("t")), ref)


@pytest.mark.parametrize("tier", JOURNALED)
def test_a_compaction_applies_the_rows_no_step_needed_before_it_drops_their_journal(tier, tmp_path):
    ref = journaled_pool(tmp_path / "p", tier)
    with MemoryPool.open(tmp_path / "p", replay="on-demand") as pool:
        first = pool.journal.start_seq
        t = pool.table("t")
        t.write(torch.tensor([2000]), torch.full((1, DIM), 3.0))
        pool.persist()
        ref[2000] = 3.0
        assert pool.rows_pending > 0
        pool.compact()
        assert pool.journal.start_seq > first  # the segments the pending rows were in are gone
        assert pool.rows_pending == 0
        assert torch.equal(working_copy(pool), ref)
        # and the freed segments are reused by new transactions without disturbing anything
        for k in range(3):
            t.write(torch.arange(k * 10, k * 10 + 10), torch.full((10, DIM), float(k)))
            pool.persist()
            ref[k * 10:k * 10 + 10] = float(k)
        assert torch.equal(all_rows(t), ref)


@pytest.mark.parametrize("tier", JOURNALED)
def test_a_crash_before_the_pending_rows_were_applied_replays_them_again(tier, tmp_path, run_py):
    ref = journaled_pool(tmp_path / "p", tier)
    # A writer that reads a few rows, commits a change of one and is killed, the rest unapplied.
    proc = run_py(f"""
import os, signal, torch
from memory_pool import MemoryPool
pool = MemoryPool.open({str(tmp_path / "p")!r}, replay="on-demand")
t = pool.table("t")
t.read(torch.arange(10))
t.write(torch.tensor([20]), torch.full((1, {DIM}), 9.0))
pool.persist()
assert pool.rows_pending > 0
os.kill(os.getpid(), signal.SIGKILL)
""", check=False)
    assert proc.returncode == -9, proc.stderr
    ref[20] = 9.0
    with MemoryPool.open(tmp_path / "p", replay="on-demand") as pool:
        assert torch.equal(all_rows(pool.table("t")), ref)


@pytest.mark.parametrize("tier", JOURNALED)
def test_an_on_demand_open_refuses_a_damaged_journal_as_an_eager_open_does(tier, tmp_path):
    journaled_pool(tmp_path / "p", tier)
    with MemoryPool.open(tmp_path / "p", read_only=True) as pool:
        ref = next(r for txn in pool.journal.txns for r in txn.records if r.type == RecordType.ROWS)
    with open(ref.segment, "r+b") as f:  # one bit of a committed row's payload
        f.seek(ref.payload_offset + ref.length - 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    for replay in ("eager", "on-demand"):
        with pytest.raises(PoolCorruptError, match="checksum"):
            MemoryPool.open(tmp_path / "p", replay=replay)


def test_an_unknown_replay_mode_is_refused_with_the_modes(tmp_path):
    journaled_pool(tmp_path / "p", "pmem")
    with pytest.raises(InvalidConfigError, match="on-demand"):
        MemoryPool.open(tmp_path / "p", replay="lazy")


@pytest.mark.parametrize("tier", JOURNALED)
def test_a_cache_miss_of_a_pending_row_takes_the_journals_value_into_its_slot_and_leaves_the_home_alone(tier, tmp_path):
    """A DRAM cache's miss of a row whose newest value is still only in the journal takes that
    value into its slot (``Replayer.peek``) instead of applying it to the working copy first --
    a copy-on-write fault and a read of the image's page, for a value the slot then holds
    anyway. The row stays pending; the next read of the home applies it."""
    from dlrm_cxl.fused import bind_cached

    path = tmp_path / "p"
    with MemoryPool.create(path, tier=tier) as pool:
        pool.create_table("t", 200, 4, init="uniform", seed=5)
        pool.create_table("t.adagrad", 200, 1, init="zeros")
        pool.table("t").write(torch.arange(4), torch.full((4, 4), 3.0))
        pool.table("t.adagrad").write(torch.arange(4), torch.full((4, 1), 2.0))
        pool.persist()
    pool = MemoryPool.open(path, dram_cache_bytes=64 << 10, replay="on-demand")
    try:
        arena = bind_cached(pool, [pool.table("t")], [pool.table("t.adagrad")], optimizer="rowwise_adagrad",
                            lr=0.1, eps=1e-8, batch_size=4).arena
        assert pool.journal_rows_pending == 8
        home = working_copy(pool)
        assert not torch.equal(home[:4], torch.full((4, 4), 3.0))    # (the image's older value)
        arena.prefetch([torch.arange(6)])
        g = arena.groups[0]
        slot = g.row_slot[:4].to(torch.int64)
        assert torch.equal(g.slots[0][slot], torch.full((4, 4), 3.0))
        assert torch.equal(g.slots[1][slot], torch.full((4, 1), 2.0))
        # (rows 4 and 5 never trained: created; nothing read from the home)
        assert arena.stats.rows_from_log == 8 and arena.stats.rows_created == 2 and arena.stats.bytes_read_home == 0
        assert pool.journal_rows_pending == 8 and torch.equal(working_copy(pool)[:4], home[:4])
        assert torch.equal(pool.table("t").read(torch.arange(4)), torch.full((4, 4), 3.0))
        assert torch.equal(pool.table("t").view()[:4], torch.full((4, 4), 3.0))   # (applied now)
    finally:
        pool.close()
