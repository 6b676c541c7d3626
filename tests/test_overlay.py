"""The row overlay (memory_pool/overlay.py): a compaction writes dense pages home in place and
packs the other rows into runs; runs are cleaned first in, first out; opening applies them
(eagerly or on demand); damage is refused; a SIGKILL at any point of a compaction recovers.

Every check compares against a reference kept in the test (the values written and persisted),
and reads the table images themselves where it claims something about them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import file_system, flip
from memory_pool import MemoryPool, PoolVersionError
from memory_pool.header import HEADER, read_header
from memory_pool.overlay import MANIFEST, RUNS_DIR, Run, RunCorruptError

ROWS, DIM = 4096, 64          # 256-byte rows: 16 a page, 256 pages
PER_PAGE = 4096 // (DIM * 4)


@pytest.fixture
def runs_mb(monkeypatch):
    """Set the overlay's bound (MiB) for this test; pools below 2 GiB have none by default."""
    def set_(mb):
        monkeypatch.setenv("DLRM_CXL_RUNS_MB", str(mb))
    set_(64)
    return set_


def _image(pool_dir, name="a") -> torch.Tensor:
    """The table image on disk, as the file holds it (not the pool's working copy)."""
    raw = np.fromfile(pool_dir / "tables" / f"{name}.bin", dtype=np.float32)
    return torch.from_numpy(raw.copy()).view(-1, DIM)


def _runs(pool_dir) -> list[str]:
    doc = json.loads((pool_dir / RUNS_DIR / MANIFEST).read_text())
    return [r["file"] for r in doc["runs"]]


def _new_pool(path, tier="power-sim"):
    pool = MemoryPool.create(path, tier=tier)
    t = pool.create_table("a", ROWS, DIM, init="uniform", seed=1)
    return pool, t, t.read(torch.arange(ROWS)).clone()


def _write(pool, t, ref, ids, seed):
    ids = torch.as_tensor(ids, dtype=torch.int64)
    vals = torch.randn(ids.numel(), DIM, generator=torch.Generator().manual_seed(seed))
    t.write(ids, vals)
    ref[ids] = vals
    pool.persist()


@pytest.mark.parametrize("tier", ["pmem", "power-sim"])
def test_a_compaction_writes_dense_pages_home_and_packs_the_other_rows_into_a_run(tmp_pool_dir, runs_mb, tier):
    pool, t, ref = _new_pool(tmp_pool_dir, tier)
    before = _image(tmp_pool_dir).clone()
    dense = list(range(16, 16 + PER_PAGE // 2))        # half of page 1: goes home
    sparse = [5 * PER_PAGE + 3, 9 * PER_PAGE + 1, 200 * PER_PAGE]  # alone in their pages: into a run
    _write(pool, t, ref, dense + sparse, 1)
    pool.compact()
    pool.close()
    image = _image(tmp_pool_dir)
    assert torch.equal(image[dense], ref[dense])        # home, in place
    assert torch.equal(image[sparse], before[sparse])   # not home: the image keeps the old values
    runs = _runs(tmp_pool_dir)
    assert len(runs) == 1
    run = Run.open(tmp_pool_dir / RUNS_DIR / runs[0])
    assert run.tables["a"].ids.tolist() == sorted(sparse) and run.tables["a"].tombs.numel() == 0
    run.close()
    assert read_header(tmp_pool_dir)["format_version"] == 3
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(tmp_pool_dir, replay=replay) as p:
            assert torch.equal(p.table("a").read(sparse), ref[sparse]), replay
            assert torch.equal(p.table("a").view(), ref), replay


def test_an_on_demand_open_applies_a_run_row_when_it_is_first_read(tmp_pool_dir, runs_mb):
    pool, t, ref = _new_pool(tmp_pool_dir)
    sparse = [3 * PER_PAGE, 7 * PER_PAGE, 11 * PER_PAGE]
    _write(pool, t, ref, sparse, 2)
    pool.compact()
    pool.close()
    with MemoryPool.open(tmp_pool_dir, replay="on-demand") as p:
        assert p.rows_pending == 3 and p.stats.run_rows_replayed == 0
        a = p.table("a")
        assert torch.equal(a._region.tensor[sparse[0]], _image(tmp_pool_dir)[sparse[0]])  # not applied yet
        assert torch.equal(a.read([sparse[0]]), ref[[sparse[0]]])
        assert p.rows_pending == 2 and p.stats.run_rows_replayed == 1
        a.write([sparse[1]], torch.full((1, DIM), 3.0))   # a write applies it first, then overwrites it
        assert p.rows_pending == 1
        assert torch.equal(a.read([sparse[1]]), torch.full((1, DIM), 3.0))


def test_a_tables_pending_run_rows_are_searched_in_their_runs_until_its_sixteenth_read_then_found_all_at_once(
        tmp_pool_dir, runs_mb):
    # After an open every run row is pending. A read of a few of them searches the runs they are
    # in; only a table read again and again (SOURCE_AFTER) has all its pending rows found at once
    # (Overlay._source): a replay after a crash reads a few steps' rows. Both ways read the same.
    from memory_pool.overlay import SOURCE_AFTER

    pool, t, ref = _new_pool(tmp_pool_dir)
    first = [k * PER_PAGE for k in range(0, 40, 2)]
    second = [k * PER_PAGE + 5 for k in range(1, 41, 2)]
    _write(pool, t, ref, first, 3)
    pool.compact()                                        # run 1
    _write(pool, t, ref, second + first[:4], 4)          # run 2: newer values of 4 of run 1's rows
    pool.compact()
    pool.close()
    rows = sorted(first + second)
    assert SOURCE_AFTER < len(rows)
    with MemoryPool.open(tmp_pool_dir, replay="on-demand") as p:
        ov, a = p._compaction.overlay, p.table("a")
        assert len(ov.runs) == 2 and p.rows_pending == len(rows)
        for k, r in enumerate(rows, 1):
            assert torch.equal(a.read([r]), ref[[r]]), r
            built = isinstance(ov._sources.get("a"), tuple)
            assert built == (k >= SOURCE_AFTER), k
        assert p.rows_pending == 0
        assert torch.equal(a.view(), ref)


@pytest.mark.parametrize("dense", [False, True], ids=["rows-copied", "rows-gathered"])
def test_a_row_pending_from_the_run_being_written_reads_its_newest_value_from_the_compactions_plan(
        tmp_pool_dir, runs_mb, monkeypatch, dense):
    """A row of a compaction's records that is pending from an older run (a DRAM cache's trim
    gave the working copy back: ``Overlay.repend``) is pending from the new run (``where`` =
    -NEW) from the compaction's plan on: a read before the run is written takes its value from
    the plan, whether the plan holds its rows copied or to be gathered as the run is written
    (a page of the records went home: runfile.Gathered)."""
    from memory_pool import overlay_compaction as oc
    from memory_pool.runfile import Gathered
    pool, t, ref = _new_pool(tmp_pool_dir)
    sparse = [3 * PER_PAGE, 7 * PER_PAGE, 11 * PER_PAGE]
    _write(pool, t, ref, sparse, 2)
    pool.compact()
    ov = pool._compaction.overlay
    _write(pool, t, ref, (list(range(16, 16 + PER_PAGE // 2)) if dense else []) + sparse, 3)
    ov.repend(["a"])   # (as a trim does: the rows are read from their run again)
    assert bool((ov.where["a"][sparse] < 0).all())
    seen, real = [], oc.write_run

    def peek_first(path, gen, tables, **kw):
        seen.append((type(tables["a"][2]), ov.where["a"][sparse].tolist(), ov.peek("a", torch.tensor(sparse))))
        return real(path, gen, tables, **kw)

    monkeypatch.setattr(oc, "write_run", peek_first)
    pool.compact()
    pool.close()
    assert [s[:2] for s in seen] == [(Gathered if dense else torch.Tensor, [-oc.NEW] * 3)]
    mask, vals = seen[0][2]
    assert bool(mask.all()) and torch.equal(vals.view(torch.float32), ref[sparse])


def test_a_carried_row_written_home_later_leaves_a_tombstone_so_its_old_run_value_no_longer_counts(
        tmp_pool_dir, runs_mb):
    pool, t, ref = _new_pool(tmp_pool_dir)
    x, y = 10 * PER_PAGE, 20 * PER_PAGE           # each alone in its page: carried in run 1
    _write(pool, t, ref, [x, y], 3)
    pool.compact()
    # Next window: x again and three neighbours of each (4 rows of 16: a quarter of the page):
    # both pages go home, x with its new value, y with its run value (not in this window).
    _write(pool, t, ref, [x, x + 1, x + 2, x + 3, y + 1, y + 2, y + 3], 4)
    pool.compact()
    pool.close()
    image = _image(tmp_pool_dir)
    assert torch.equal(image[[x, y]], ref[[x, y]])
    runs = _runs(tmp_pool_dir)
    assert len(runs) == 2
    newest = Run.open(tmp_pool_dir / RUNS_DIR / runs[-1])
    assert newest.tables["a"].tombs.tolist() == [x, y] and newest.tables["a"].ids.numel() == 0
    newest.close()
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(tmp_pool_dir, replay=replay) as p:
            assert p.rows_pending == 0                        # the run 1 values do not count
            assert torch.equal(p.table("a").view(), ref), replay


def test_runs_are_cleaned_first_in_first_out_and_their_live_rows_move_on(tmp_pool_dir, runs_mb):
    runs_mb(0.2)    # ~200 KiB of runs: one window's sparse rows are ~40 KiB
    g = torch.Generator().manual_seed(5)
    pool, t, ref = _new_pool(tmp_pool_dir)
    seen = []
    for r in range(12):
        pages = torch.randperm(ROWS // PER_PAGE, generator=g)[:150]
        _write(pool, t, ref, pages * PER_PAGE + r % PER_PAGE, 10 + r)   # one row per page: all sparse
        pool.compact()
        seen.append(_runs(tmp_pool_dir))
        assert torch.equal(t.view(), ref)
    assert len({f for s in seen for f in s}) > len(seen[-1]) + 3        # old runs were dropped ...
    files = {p.name for p in (tmp_pool_dir / RUNS_DIR).glob("run-*.bin")}
    assert files == set(seen[-1])                                       # ... and their files deleted
    assert pool.describe()["overlay"]["bytes"] < 2 * 0.2 * 2**20
    pool.close()
    with MemoryPool.open(tmp_pool_dir, replay="on-demand") as p:
        assert torch.equal(p.table("a").view(), ref)


def test_a_cleaned_runs_live_rows_merge_in_order_with_a_compaction_whose_dense_pages_went_home(tmp_pool_dir, runs_mb):
    """A compaction with dense pages keeps only its other rows for its run (gathered from the
    records' rows when the run is written); a run cleaned meanwhile merges its live rows in
    among them. The newest run then holds every row of both, sorted, each with its newest
    value -- read from the run file itself -- and the pool reads the same after a reopen."""
    from memory_pool.overlay_compaction import _merge_sorted

    runs_mb(0.2)
    g = torch.Generator().manual_seed(7)
    pool, t, ref = _new_pool(tmp_pool_dir)
    merged_in = 0
    for r in range(12):
        pages = torch.randperm(ROWS // PER_PAGE, generator=g)[:140]
        dense = pages[:2] * PER_PAGE                     # two pages of which half the rows change: home
        dense = (dense.unsqueeze(1) + torch.arange(PER_PAGE // 2)).flatten()
        sparse = pages[2:] * PER_PAGE + r % PER_PAGE     # one row a page: into the run
        _write(pool, t, ref, torch.cat([dense, sparse]), 40 + r)
        pool.compact()
        assert torch.equal(_image(tmp_pool_dir)[dense], ref[dense])
        newest = Run.open(tmp_pool_dir / RUNS_DIR / _runs(tmp_pool_dir)[-1])
        ids = newest.tables["a"].ids
        assert torch.equal(ids, torch.unique(ids))                        # sorted, distinct
        assert not set(dense.tolist()) & set(ids.tolist())
        merged_in += bool(set(ids.tolist()) - set(sparse.tolist()))       # an older run's rows merged in
        assert torch.equal(newest.rows("a", ids).view(torch.float32).view(-1, DIM), ref[ids])
        newest.close()
        assert torch.equal(t.view(), ref)
    assert merged_in >= 3
    pool.close()
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(tmp_pool_dir, replay=replay) as p:
            assert torch.equal(p.table("a").view(), ref), replay
    # the merge itself, against a sort of the union
    u = torch.randperm(10_000, generator=g)[:3000]
    a, b = torch.sort(u[:1000])[0], torch.sort(u[1000:])[0]
    merged, at_a, at_b = _merge_sorted(a, b)
    assert torch.equal(merged, torch.sort(u)[0]) and torch.equal(merged[at_a], a) and torch.equal(merged[at_b], b)


def test_an_evicted_runs_rows_take_the_newer_runs_rows_of_their_pages_home_with_them(tmp_pool_dir, runs_mb):
    """When the live rows alone pass 3/4 of the bound, the oldest run's rows go home in place --
    a page read and written each. The rows of newer runs in those pages go with them (their
    page is written anyway), tombstoned in the new run, so the newer run's values of them no
    longer count: after a reopen too."""
    runs_mb(0.07)   # three runs of ~26 KiB pass it; their 300 live rows (79 KiB) pass 3/4 of it
    pool, t, ref = _new_pool(tmp_pool_dir)
    pages = torch.arange(100)
    first, mates, other = pages * PER_PAGE, pages * PER_PAGE + 1, (pages + 100) * PER_PAGE + 2
    for rows, seed in ((first, 30), (mates, 31), (other, 32)):   # each alone in its page, per run
        _write(pool, t, ref, rows, seed)
        pool.compact()
    runs = _runs(tmp_pool_dir)
    assert len(runs) == 2                                                  # the first run evicted
    image = _image(tmp_pool_dir)
    assert torch.equal(image[first], ref[first])
    assert torch.equal(image[mates], ref[mates])                          # went home with them
    assert not torch.equal(image[other], ref[other])                      # (a run's only)
    newest = Run.open(tmp_pool_dir / RUNS_DIR / runs[-1])
    assert newest.tables["a"].tombs.tolist() == mates.tolist()
    newest.close()
    assert torch.equal(t.view(), ref)
    pool.close()
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(tmp_pool_dir, replay=replay) as p:
            assert torch.equal(p.table("a").view(), ref), replay


def test_a_bound_of_zero_writes_every_run_row_home_and_drops_the_runs(tmp_pool_dir, runs_mb):
    pool, t, ref = _new_pool(tmp_pool_dir)
    sparse = [2 * PER_PAGE, 40 * PER_PAGE + 5, 99 * PER_PAGE + 9]
    _write(pool, t, ref, sparse, 6)
    pool.compact()
    assert len(_runs(tmp_pool_dir)) == 1
    runs_mb(0)
    _write(pool, t, ref, [50 * PER_PAGE], 7)
    pool.compact()
    pool.close()
    assert _runs(tmp_pool_dir) == [] and not list((tmp_pool_dir / RUNS_DIR).glob("run-*.bin"))
    assert torch.equal(_image(tmp_pool_dir), ref)    # everything home


def _pool_with_a_run(tmp_pool_dir):
    pool, t, ref = _new_pool(tmp_pool_dir)
    sparse = [4 * PER_PAGE, 8 * PER_PAGE, 12 * PER_PAGE]
    _write(pool, t, ref, sparse, 8)
    pool.compact()
    pool.close()
    return tmp_pool_dir / RUNS_DIR / _runs(tmp_pool_dir)[0], ref, sparse


def _files(d):
    return {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != "LOCK"}


@pytest.mark.parametrize("where", ["header", "index", "manifest", "missing", "truncated"])
def test_a_damaged_run_or_manifest_is_refused_at_open_and_nothing_changes(tmp_pool_dir, runs_mb, where):
    run, _, _ = _pool_with_a_run(tmp_pool_dir)
    if where == "header":
        flip(run, 20)
    elif where == "index":
        flip(run, 4096 + 40)          # the index starts at 4 KiB
    elif where == "manifest":
        flip(tmp_pool_dir / RUNS_DIR / MANIFEST, 30)
    elif where == "missing":
        run.unlink()
    else:
        with open(run, "r+b") as f:
            f.truncate(run.stat().st_size - 100)
    before = _files(tmp_pool_dir)
    for replay in ("eager", "on-demand"):
        with pytest.raises(RunCorruptError) as err:
            MemoryPool.open(tmp_pool_dir, replay=replay)
        assert err.value.exit_code == 4
    assert _files(tmp_pool_dir) == before


def test_a_bit_flip_in_a_runs_rows_is_refused_when_the_row_is_read(tmp_pool_dir, runs_mb):
    run, ref, sparse = _pool_with_a_run(tmp_pool_dir)
    head = run.read_bytes()[:64]
    data_off = int.from_bytes(head[40:48], "little")     # (HEAD: data offset after magic..index len)
    flip(run, data_off + 256 + 17)                       # in the second row's bytes
    with MemoryPool.open(tmp_pool_dir, replay="on-demand") as p:   # rows are verified when read
        with pytest.raises(RunCorruptError):
            p.table("a").read([sparse[1]])
    with pytest.raises(RunCorruptError):
        MemoryPool.open(tmp_pool_dir)                                # an eager open reads them all


def test_run_files_no_manifest_names_are_removed_by_a_writer_and_ignored_by_a_reader(tmp_pool_dir, runs_mb):
    run, ref, _ = _pool_with_a_run(tmp_pool_dir)
    stray = run.with_name("run-00000000000000ff.bin")
    stray.write_bytes(b"left by a crash")
    with MemoryPool.open(tmp_pool_dir, read_only=True) as p:
        assert torch.equal(p.table("a").view(), ref)
    assert stray.exists()
    with MemoryPool.open(tmp_pool_dir) as p:
        assert torch.equal(p.table("a").view(), ref)
    assert not stray.exists() and run.exists()


def test_a_pool_of_a_later_format_version_is_refused(tmp_pool_dir, runs_mb):
    _pool_with_a_run(tmp_pool_dir)
    doc = json.loads((tmp_pool_dir / HEADER).read_text())
    assert doc["format_version"] == 3
    from memory_pool.durable import json_with_crc
    (tmp_pool_dir / HEADER).write_bytes(json_with_crc({**doc, "format_version": 4}))
    with pytest.raises(PoolVersionError):
        MemoryPool.open(tmp_pool_dir)


def test_a_bulk_load_replaces_the_run_values_of_its_table_durably(tmp_pool_dir, runs_mb):
    run, ref, sparse = _pool_with_a_run(tmp_pool_dir)
    new = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(9))
    with MemoryPool.open(tmp_pool_dir) as p:
        p.table("a").load_(new)
        assert torch.equal(p.table("a").view(), new)
    for replay in ("eager", "on-demand"):
        with MemoryPool.open(tmp_pool_dir, replay=replay) as p:
            assert torch.equal(p.table("a").view(), new), replay


CHILD = r"""
import os, sys, torch
os.environ["DLRM_CXL_RUNS_MB"] = "64"
from memory_pool import MemoryPool
import memory_pool.overlay as O
import memory_pool.overlay_compaction as OC
path, phase, saved = sys.argv[1], sys.argv[2], sys.argv[3]

def die_after(obj, name):
    orig = getattr(obj, name)
    def wrapper(*a, **kw):
        out = orig(*a, **kw)
        os.kill(os.getpid(), 9)
        return out
    setattr(obj, name, wrapper)

with MemoryPool.open(path) as pool:
    a = pool.table("a")
    g = torch.Generator().manual_seed(11)
    for r in range(3):
        ids = torch.unique(torch.cat([torch.randint(0, a.num_embeddings, (40,), generator=g), torch.arange(32)]))
        a.write(ids, torch.randn(ids.numel(), a.embedding_dim, generator=g))
        pool.persist()
    torch.save(a.read(torch.arange(a.num_embeddings)), saved)
    a.write([1], torch.full((1, a.embedding_dim), -5.0))   # never persisted: lost with the process
    if phase == "run-written":
        die_after(OC, "write_run")
    elif phase == "images-synced":
        die_after(pool._compaction, "_sync_images")
    elif phase == "manifest":
        die_after(O.Overlay, "commit")
    elif phase == "start-moved":
        die_after(pool.journal, "reclaim")   # the journal's START moved, the cleaned runs not deleted
    pool.compact()
raise SystemExit("not killed")
"""


@pytest.mark.parametrize("phase", ["run-written", "images-synced", "manifest", "start-moved"])
def test_a_sigkill_at_any_point_of_a_compaction_with_runs_recovers_the_persisted_rows(tmp_pool_dir, tmp_path,
                                                                                     run_py, runs_mb, phase):
    _, ref, _ = _pool_with_a_run(tmp_pool_dir)        # runs from an earlier compaction too
    saved = tmp_path / "want.pt"
    proc = run_py(CHILD, tmp_pool_dir, phase, saved, check=False)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-3000:])
    want = torch.load(saved)
    assert not torch.equal(want, ref)
    for replay in ("eager", "on-demand", "eager"):    # (and again: idempotent)
        with MemoryPool.open(tmp_pool_dir, replay=replay) as p:
            assert torch.equal(p.table("a").view(), want), (phase, replay)
    with MemoryPool.open(tmp_pool_dir) as p:          # and it still compacts
        p.table("a").write([2 * PER_PAGE], torch.full((1, DIM), 42.0))
        p.persist()
        p.compact()
    want[2 * PER_PAGE] = 42.0
    with MemoryPool.open(tmp_pool_dir) as p:
        assert torch.equal(p.table("a").view(), want)


def test_training_through_runs_ends_with_the_digest_of_training_without_them_and_resumes_bit_exact(
        tmp_path, monkeypatch):
    """The overlay changes where rows are kept, never their values: a run compacting every few
    steps through runs (cleaned too: a small bound) ends with the state of one that writes
    everything home, and so does one resumed in the middle (its run rows applied on demand)."""
    from dlrm_cxl.model import PRESETS
    from dlrm_cxl.options import TrainOptions
    from dlrm_cxl.trainer import Trainer

    monkeypatch.setenv("DLRM_CXL_SEGMENT_MB", "0.0625")
    monkeypatch.setenv("DLRM_CXL_COMPACT_MB", "0.25")

    def train(pool, steps, runs):
        monkeypatch.setenv("DLRM_CXL_RUNS_MB", runs)
        # (a fixed window: compactions start at recovery points, and the recovery budget's
        # windows follow the machine's speed -- a fast one would make few in 40 steps)
        tr = Trainer(TrainOptions(pool=str(pool), steps=steps, threads=1, progress=False, tier="power-sim",
                                  window=4), PRESETS["tiny"], log=lambda s: None)
        try:
            tr.run()
            return tr.digest(), tr.pool.describe()["overlay"], tr.pool.stats
        finally:
            tr.close()

    plain, none, _ = train(tmp_path / "plain", 40, "0")
    assert none is None
    through, ov, stats = train(tmp_path / "runs", 40, "0.05")
    # (how many compactions is timing: one that runs when the next is due makes it wait for a
    # later recovery point: 3 or 4 here, loaded or not, where this asked for 3)
    assert ov["runs"] >= 1 and stats.bytes_to_runs > 0 and stats.compactions >= 2
    assert through == plain
    train(tmp_path / "resumed", 20, "0.05")
    resumed, ov, stats = train(tmp_path / "resumed", 40, "0.05")
    assert stats.run_rows_replayed > 0
    assert resumed == plain


def test_a_run_row_no_step_read_since_the_open_is_read_from_the_image_once_its_page_goes_home(tmp_pool_dir, runs_mb):
    """A row still pending from a run when a compaction writes its page home: its run value no
    longer counts afterwards, and the working copy's copy of that page (taken when a neighbour
    was written) holds the image's old value of it. It stays pending, now from the image
    (``HOME``): the first read takes the value the compaction wrote there."""
    pool, t, ref = _new_pool(tmp_pool_dir)
    x = 30 * PER_PAGE
    _write(pool, t, ref, [x], 12)                     # x alone in its page: into a run
    pool.compact()
    pool.close()
    with MemoryPool.open(tmp_pool_dir, replay="on-demand") as p:
        a = p.table("a")
        assert p.rows_pending == 1
        _write(p, a, ref, [x + 1, x + 2, x + 3], 13)  # the page's working copy is copied now
        assert p.rows_pending == 1                     # (x was not read)
        p.compact()                                    # 4 rows of 16: the page goes home, x from its run
        assert torch.equal(_image(tmp_pool_dir)[x], ref[x])
        assert not torch.equal(a._region.tensor[x], ref[x])   # the working copy's page: the old value
        assert p.rows_pending == 1                     # pending, from the image
        assert torch.equal(a.read([x]), ref[[x]])
        assert p.rows_pending == 0
        assert torch.equal(a.view(), ref)
    with MemoryPool.open(tmp_pool_dir) as p:
        assert torch.equal(p.table("a").view(), ref)


def test_inspect_says_how_many_rows_the_overlay_keeps_out_of_the_images(tmp_pool_dir, runs_mb, capsys):
    from dlrm_cxl.cli import main

    _pool_with_a_run(tmp_pool_dir)
    assert main(["inspect", "--pool", str(tmp_pool_dir), "--no-digest"]) == 0
    out = capsys.readouterr().out
    assert "format v3" in out and "row overlay: 1 runs" in out and " 3 rows kept out of the images" in out
    assert main(["inspect", "--pool", str(tmp_pool_dir), "--json", "--no-digest"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["overlay"]["runs"] == 1 and info["overlay"]["rows"] == 3


def test_a_resumed_train_says_how_many_run_rows_it_left_to_apply(tmp_path, monkeypatch, capsys):
    from dlrm_cxl.cli import main

    for k, v in {"DLRM_CXL_SEGMENT_MB": "0.0625", "DLRM_CXL_COMPACT_MB": "0.25", "DLRM_CXL_RUNS_MB": "0.05"}.items():
        monkeypatch.setenv(k, v)
    pool = tmp_path / "pool"
    args = ["train", "--pool", str(pool), "--preset", "tiny", "--tier", "pmem", "--threads", "1", "--no-progress"]
    assert main(args + ["--steps", "30"]) == 0
    capsys.readouterr()
    assert main(args + ["--steps", "32", "-v"]) == 0  # (the replay on demand's lines are details: -v)
    out = capsys.readouterr().out
    import re
    m = re.search(r"pool opened in \d+ ms; ([\d,]+) journal rows and ([\d,]+) rows of the row overlay's runs are "
                  r"applied as the steps first read them", out)
    assert m and int(m.group(2).replace(",", "")) > 0, out
    assert re.search(r"^replay on demand: .* \(and ([\d,]+) rows of the row overlay's runs, ([\d,]+) of them applied "
                     r"since\)$", out, re.M), out


@pytest.mark.parametrize("sizes", [(1,), (3, 5000, 17), (40000, 123456, 0, 7)])
def test_a_run_written_with_direct_writes_is_the_same_file_as_through_the_page_cache_and_leaves_none_cached(tmp_path, sizes):
    # write_run's O_DIRECT path (a staging buffer, the block checksums taken there, a padded
    # last block cut back) against the page-cache path: byte for byte, and read back row for row.
    from memory_pool.residency import page_cache_bytes
    from memory_pool.runfile import write_run
    g = torch.Generator().manual_seed(len(sizes))
    tables = {}
    for i, n in enumerate(sizes):
        rb = (260, 72, 1024, 8)[i % 4]
        ids = torch.sort(torch.randperm(1_000_000, generator=g)[:n]).values
        rows = torch.randint(0, 255, (n, rb), dtype=torch.uint8, generator=g)
        tables[f"t{i}"] = (rb, ids, rows, torch.tensor([2, 9, 40]))
    files, cached = {}, {}
    for direct in (True, False):
        path = tmp_path / f"run-{direct}.bin"
        assert write_run(path, 7, tables, direct=direct) == path.stat().st_size
        files[direct], cached[direct] = path, page_cache_bytes([path])
        run = Run.open(path)
        try:
            for name, (_, ids, rows, _) in tables.items():
                assert torch.equal(run.rows(name, ids), rows), name
        finally:
            run.close()
    assert files[True].read_bytes() == files[False].read_bytes()
    # The direct path skips the page-cache path's POSIX_FADV_DONTNEED: none of the run's pages
    # may be left in the page cache (which a DRAM cache's budget counts). Where the files are in
    # memory anyway (tmpfs) there is nothing to tell apart.
    if file_system(tmp_path) != "tmpfs":
        assert cached[True] == 0



def test_a_runs_blocks_are_asked_for_a_run_of_adjacent_blocks_at_a_time_and_come_in_untouched(tmp_path):
    """``Run.will_need``: one ``MADV_WILLNEED`` per run of adjacent blocks, before the rows'
    checksums and copies fault them in (a run's pages are dropped at every trim and refresh
    behind a DRAM cache); the pages come into the page cache without a read of them here."""
    import time

    from memory_pool.residency import PAGE, page_cache_bytes
    from memory_pool.runfile import BLOCK, write_run
    rb, n = 1024, 400                                  # 4 rows a block, 100 blocks
    ids = torch.arange(n) * 3
    rows = (torch.arange(n * rb) % 251).to(torch.uint8).view(n, rb)
    path = tmp_path / "run.bin"
    write_run(path, 1, {"t": (rb, ids, rows, torch.empty(0, dtype=torch.int64))})   # (left out of the page cache)
    run = Run.open(path)
    try:
        assert BLOCK == PAGE
        before = page_cache_bytes([path])
        assert run.will_need(torch.tensor([40, 41, 45, 45, 70])) == 3          # 40-41, 45, 70
        assert run.will_need(torch.tensor([60, 59, 61])) == 1
        assert run.will_need(torch.empty(0, dtype=torch.int64)) == 0
        if file_system(tmp_path) != "tmpfs":   # (in memory there: nothing to tell apart)
            deadline = time.monotonic() + 5
            while page_cache_bytes([path]) - before < 7 * PAGE and time.monotonic() < deadline:
                time.sleep(0.01)
            assert page_cache_bytes([path]) - before >= 7 * PAGE
        assert torch.equal(run.rows("t", ids[[160, 300]]), rows[[160, 300]])   # (blocks 40 and 75)
    finally:
        run.close()


def test_a_runs_blocks_are_asked_for_once_until_its_pages_are_dropped(tmp_path):
    """``Run.will_need`` asks only for blocks not asked for since the run's last ``drop_cache``:
    a request for cached pages is a system call and a page-cache walk for nothing (a resumed
    `kaggle` run made 649k of them in 300 steps). After the drop every block is asked for again,
    and a block asked for, dropped and read comes back with its own value."""
    from memory_pool.runfile import write_run
    rb, n = 1024, 400                                  # 4 rows a block, 100 blocks
    ids = torch.arange(n) * 3
    rows = (torch.arange(n * rb) % 251).to(torch.uint8).view(n, rb)
    path = tmp_path / "run.bin"
    write_run(path, 1, {"t": (rb, ids, rows, torch.empty(0, dtype=torch.int64))})
    run = Run.open(path)
    try:
        assert run.will_need(torch.tensor([40, 41, 45, 70])) == 3
        assert run.will_need(torch.tensor([40, 41, 45, 70])) == 0                # asked for already
        assert run.will_need(torch.tensor([41, 42, 43, 70, 71])) == 2            # only 42-43 and 71 are new
        run.drop_cache()
        assert run.will_need(torch.tensor([40, 41, 45, 70])) == 3                # dropped: asked for again
        assert torch.equal(run.rows("t", ids[[160, 181, 300]]), rows[[160, 181, 300]])
        assert run.will_need(torch.tensor([40, 45, 75])) == 0                    # (rows() asked for 75)
        assert run.will_need(torch.tensor([75, 76])) == 1
    finally:
        run.close()
