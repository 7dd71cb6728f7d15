"""On CUDA: the MoE preset trains on the GPU (NCCL, precision auto = bf16), logs its routing and exports Qwen3-MoE.

    pytest -m gpu tests/gpu/test_moe_cuda.py      # skipped (not failed) where CUDA is missing

One GPU runs expert_parallel = 1 (the expert-parallel degree must divide the data-parallel
ranks); with two or more GPUs a second case spreads the experts over 2 of them, where the
all-to-all runs on NCCL. The routing counts, the auxiliary loss and the export's gather all
move through collectives on the device, which the CPU tests (gloo) cannot check.
"""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.components.workspace import Workspace
from tests.integration.train_support import make_ws, run_training, tiny_training

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EXPERTS, LAYERS, STEPS = 4, 4, 6


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return make_ws(tmp_path_factory, "moe_gpu")


@pytest.mark.parametrize("ep", [1, pytest.param(2, marks=pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="expert_parallel = 2 needs 2 GPUs"))])
def test_moe_trains_on_cuda_and_exports(ws, ep):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = tiny_training(max_steps=STEPS, warmup_steps=2, save_every=3, num_ranks=ep,
                        model={"num_layers": LAYERS, "moe": {"num_experts": EXPERTS, "top_k": 2}},
                        parallel={"strategy": "zero2", "expert_parallel": ep})
    events, run_dir = run_training(ws, f"moe-cuda-ep{ep}", cfg, timeout_s=900)
    losses = [e["loss"] for e in events]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    routed = cfg.micro_batch_size * cfg.seq_len * ep * LAYERS * 2  # tokens x ranks x sparse layers x top-2
    assert all(sum(e["expert_tokens"]) == routed and 0 <= e["moe_dropped_fraction"] < 0.5 for e in events)
    assert all(e["memory"][0]["device_peak"] > 0 for e in events)  # the step ran on the GPU
    model = AutoModelForCausalLM.from_pretrained(run_dir / "export", dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    probe = load_file(str(run_dir / "probe.safetensors"))
    with torch.no_grad():
        ours = model(input_ids=probe["input_ids"]).logits.float()
    # bf16 weights either way; the engine computed in bf16 on the GPU, the check runs fp32 on the CPU.
    assert torch.allclose(ours, probe["logits"], atol=5e-2, rtol=5e-2), (ours - probe["logits"]).abs().max()
