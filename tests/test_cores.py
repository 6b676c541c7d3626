"""A core for the background compaction (dlrm_cxl/cores.py): the steps run on one intra-op
thread fewer while a compaction runs, only where the result is the same bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import file_system

from dlrm_cxl.cores import CoreYield, thread_count_invariant
from dlrm_cxl.model import PRESETS
from dlrm_cxl.options import TrainOptions
from dlrm_cxl.trainer import Trainer

TINY = PRESETS["tiny"]


def _run(pool, monkeypatch, yield_core: str):
    """`tiny` on emulated pmem, 2 threads, a compaction every 64 KiB of journal (so that steps
    meet running ones): its digest and the steps run on one thread fewer."""
    monkeypatch.setenv("DLRM_CXL_COMPACT_MB", str(64 / 1024))
    monkeypatch.setenv("DLRM_CXL_SEGMENT_MB", str(32 / 1024))
    monkeypatch.setenv("DLRM_CXL_YIELD_CORE", yield_core)
    before = torch.get_num_threads()
    t = Trainer(TrainOptions(pool=str(pool), steps=40, threads=2, progress=False, tier="pmem", window=2),
                TINY, log=lambda s: None)
    try:
        t.run()
        return t.digest(), t.cores.steps_yielded, t.pool.stats.compactions
    finally:
        t.close()
        torch.set_num_threads(before)


def test_steps_during_a_compaction_run_on_one_thread_fewer_and_train_bit_identically(tmp_path, monkeypatch):
    digest, yielded, compactions = _run(tmp_path / "yield", monkeypatch, "1")
    ref, none, _ = _run(tmp_path / "keep", monkeypatch, "0")
    assert compactions > 3 and yielded > 0 and none == 0
    assert digest == ref


class _CountsThreads(nn.Module):
    """A layer whose result depends on the thread count (as a reduction split by thread may)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x) + 1e-3 * torch.get_num_threads()


def test_a_compaction_reading_its_journal_in_leaves_the_steps_every_thread_and_reads_it_all_in(tmp_path, monkeypatch):
    # Its first phase (JournalReader.preread) only waits for the device: the pool says it is
    # compacting, not computing, so CoreYield keeps both threads; the records' pages are in the
    # page cache once it returns (the journal is written with direct writes: they were not).
    from memory_pool.journal_reader import JournalReader
    from memory_pool.residency import page_cache_bytes
    seen, real, t = [], JournalReader.preread, None

    def preread(self, refs):
        segs = sorted({r.segment for r in refs})
        before = page_cache_bytes(segs)
        flags = (t.pool.compacting, t.pool.compactor_computing)
        n = real(self, refs)
        seen.append((flags, before, page_cache_bytes(segs), n))
        return n

    monkeypatch.setattr(JournalReader, "preread", preread)
    monkeypatch.setenv("DLRM_CXL_COMPACT_MB", str(64 / 1024))
    monkeypatch.setenv("DLRM_CXL_SEGMENT_MB", str(32 / 1024))
    before = torch.get_num_threads()
    t = Trainer(TrainOptions(pool=str(tmp_path / "p"), steps=30, threads=2, progress=False, tier="pmem", window=2),
                TINY, log=lambda s: None)
    try:
        t.run()
        assert seen and t.pool.stats.bytes_preread == sum(n for *_, n in seen) > 0
    finally:
        t.close()
        torch.set_num_threads(before)
    for flags, cached_before, cached_after, n in seen:
        assert flags == (True, False)
        assert cached_after >= n
        if file_system(tmp_path) != "tmpfs":   # (in memory anyway there: no direct writes)
            assert n > cached_before


def test_a_compaction_behind_a_cache_takes_its_records_ids_as_reading_from_memory_and_leaves_no_journal_page_cached(
        tmp_path, monkeypatch):
    # Behind a DRAM cache a compaction reads its records direct (memory_pool/newest.py): its first
    # pass, the ids, is not computing, so the pool says compacting, not computing (CoreYield keeps
    # both threads); the journal kept those ids as it wrote the records, from the pool's first
    # compaction on (memory_pool/record_heads.py); and none of the journal's pages is left in the
    # page cache, which the DRAM budget counts (a pre-read left a GiB there on `kaggle`).
    from memory_pool import newest
    from memory_pool.residency import page_cache_bytes
    from test_dram_cache import BUDGET
    seen, real, t = [], newest._first_pass, None

    def first_pass(journal, refs, *args):
        flags = (t.pool.compacting, t.pool.compactor_computing)
        kept = journal.heads is not None and all(journal.heads.get(r) is not None for r in refs)
        real(journal, refs, *args)
        seen.append((flags, page_cache_bytes(sorted({r.segment for r in refs})), kept))

    monkeypatch.setattr(newest, "_first_pass", first_pass)
    monkeypatch.setenv("DLRM_CXL_COMPACT_MB", str(64 / 1024))
    monkeypatch.setenv("DLRM_CXL_SEGMENT_MB", str(32 / 1024))
    before = torch.get_num_threads()
    t = Trainer(TrainOptions(pool=str(tmp_path / "p"), steps=30, threads=2, progress=False, tier="pmem", window=2,
                             dram_cache_bytes=BUDGET), TINY, log=lambda s: None)
    try:
        t.run()
    finally:
        t.close()
        torch.set_num_threads(before)
    assert seen, "no compaction read its records through memory_pool/newest.py"
    for flags, cached, kept in seen:
        assert flags == (True, False)
        assert kept, "the journal did not keep the heads of the records it wrote (memory_pool/record_heads.py)"
        if file_system(tmp_path) != "tmpfs":   # (in memory anyway there)
            assert cached == 0


def test_a_model_whose_result_depends_on_the_thread_count_keeps_every_thread(monkeypatch):
    class Model:
        dense_arch = _CountsThreads()

    class Pool:
        compacting = compactor_computing = True

    assert thread_count_invariant(Model(), 8, 4, 2) is False
    Model.dense_arch = nn.Linear(4, 3)
    assert thread_count_invariant(Model(), 8, 4, 2) is True
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        Model.dense_arch = _CountsThreads()
        cores = CoreYield(Pool(), Model(), 8, 4)
        cores.before_step()
        assert not cores.enabled and cores.steps_yielded == 0 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


_MODE_AND_INVARIANCE = """
    import sys
    {first}
    import torch
    from torchrec.models.dlrm import DenseArch, OverArch
    from dlrm_cxl.arithmetic import mkl_mode
    from dlrm_cxl.cores import thread_count_invariant

    class Mlps(torch.nn.Module):   # (`kaggle`'s: 13 dense features, 26 tables of 64 columns)
        def __init__(self):
            super().__init__()
            self.dense_arch = DenseArch(13, [512, 256, 64])
            self.over_arch = OverArch(64 + 27 * 26 // 2, [512, 256, 1])

    print(mkl_mode(), thread_count_invariant(Mlps(), 2048, 13, 2))
"""


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch has no MKL")
def test_importing_dlrm_cxl_pins_mkl_to_a_mode_whose_gemms_give_one_result_on_one_thread_or_two(run_py):
    # (on the Intel host of 2026-12-06 MKL's default mode gave the `kaggle` MLPs other bits on
    # one thread than on two: no step yielded a core, and a replay on another core count failed)
    # (the suite runs without MKL_CBWR in its environment, as a user's shell has it)
    pinned = run_py(_MODE_AND_INVARIANCE.format(first="import dlrm_cxl")).stdout.split()
    assert pinned == ["AUTO,STRICT", "True"]
    # MKL takes its mode at its first GEMM, which `import torchrec` runs: too late then, and said
    late = run_py(_MODE_AND_INVARIANCE.format(first="import torchrec, dlrm_cxl")).stdout.split()
    assert late[0] == "None"
    # A mode in the environment is the user's: MKL has read it, and it is left alone
    chosen = run_py(_MODE_AND_INVARIANCE.format(first="import dlrm_cxl"), env={"MKL_CBWR": "COMPATIBLE"})
    assert chosen.stdout.split()[0] == "COMPATIBLE"
