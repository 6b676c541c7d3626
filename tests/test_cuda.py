"""The --device cuda path: the dense part on the GPU, the tables in the pool.

Skipped where no CUDA device exists (CI has none); run on a GPU machine with
`python -m pytest tests/test_cuda.py`.
"""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _train(pool, *extra):
    out = subprocess.run([sys.executable, "-m", "dlrm_cxl", "train", "--pool", str(pool), "--preset", "tiny",
                          "--no-progress", "--json", *extra], capture_output=True, text=True, timeout=600)
    return out


def test_cuda_training_matches_cpu_forward_and_learns(tmp_path):
    from dlrm_cxl.data import SyntheticData
    from dlrm_cxl.model import PRESETS, PoolDLRM
    from dlrm_cxl.options import data_spec
    from memory_pool import MemoryPool

    cfg = PRESETS["tiny"]
    with MemoryPool.create(tmp_path / "p", tier="pmem") as pool:
        for f, (name, n) in enumerate(zip(cfg.feature_names, cfg.num_embeddings)):
            pool.create_table(name, n, cfg.embedding_dim, init="uniform", seed=f)
        torch.manual_seed(0)
        cpu = PoolDLRM(cfg, pool)
        gpu = PoolDLRM(cfg, pool, dense_device="cuda")
        gpu.load_state_dict(cpu.state_dict())
        batch = SyntheticData(data_spec(cfg), seed=1).batch(0)
        plan = cpu.plan(batch.sparse)
        lc, _ = cpu(batch.dense, plan)
        lg, pooled = gpu(batch.dense, plan)
        assert lg.device.type == "cuda" and pooled.device.type == "cuda"
        torch.testing.assert_close(lg.cpu(), lc, rtol=1e-4, atol=1e-5)

    out = _train(tmp_path / "run", "--device", "cuda", "--steps", "40")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["end_step"] == 40 and summary["final_loss"] < 0.69


def test_cuda_crash_and_resume_is_bit_exact(tmp_path):
    ref = _train(tmp_path / "ref", "--device", "cuda", "--steps", "12")
    assert ref.returncode == 0, ref.stderr
    crashed = _train(tmp_path / "c", "--device", "cuda", "--steps", "12", "--crash-at", "7:mid-update")
    assert crashed.returncode == -9
    resumed = _train(tmp_path / "c", "--device", "cuda", "--steps", "12")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["state_digest"] == json.loads(ref.stdout)["state_digest"]
