"""On eight CUDA devices: dp2 x pp2 x tp2 trains over NCCL as one GPU does, and exports the whole model.

    pytest -m gpu tests/gpu/test_3d_cuda.py     # skipped (not failed) without 8 CUDA devices

The comparison of tests/integration/test_train_3d.py through lmforge's real launcher, one GPU per rank
(NCCL has one device per rank): the tiny model at 4 layers, the same global batch of 16 windows, fp32
(TF32 matmuls on both sides, so the tolerance is looser than the CPU's 1e-5).
"""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.components.workspace import Workspace
from tests.integration.train_support import make_dataset, run_training, tiny_training

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 8,
                                 reason="dp2 x pp2 x tp2 needs 8 CUDA devices, one per rank")]

COMMON = {"precision": "fp32", "max_steps": 4, "warmup_steps": 2, "save_every": 4, "model": {"preset": "tiny", "num_layers": 4}}


def test_dp2_pp2_tp2_on_eight_gpus_matches_one_gpu(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    ws = Workspace(tmp_path / "ws").ensure()
    make_dataset(ws)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    single, _ = run_training(ws, "single", tiny_training(**COMMON, num_ranks=1, grad_accum_steps=4,
                                                         parallel={"strategy": "ddp"}), timeout_s=900)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(8)))
    three_d, run_dir = run_training(ws, "3d", tiny_training(**COMMON, num_ranks=8, parallel={
        "strategy": "ddp", "pipeline": {"stages": 2, "micro_batches": 2}, "tensor": {"autotp_size": 2}}), timeout_s=900)
    for a, b in zip(single, three_d, strict=True):
        assert math.isfinite(b["loss"]) and abs(a["loss"] - b["loss"]) < 2e-2, (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2), (a, b)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "export")
    assert model.model.layers[3].self_attn.q_proj.weight.shape == (64, 64)
