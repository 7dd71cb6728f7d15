"""3D parallelism: 8 CPU ranks as dp2 x pp2 x tp2 train the tiny model (4 layers) as one rank does.

The same seed, data and global batch (16 windows: micro 4 x 2 micro-batches x dp 2, against micro 4 x 4
accumulation on one rank), in fp32, so the two runs compute the same sums in other orders. Measured on
the 2-core machine: losses within 5e-7 of the single rank's and the global gradient norm equal to 8
digits, so the tolerances below (1e-5) leave room for reduction order and still fail on a gradient norm
that counts a replicated weight on every tensor rank, or misses the later stage's (DeepSpeed's default
with the grid as its mpu gave 0.840 for the single rank's 0.921 at step 1). The 8-rank run takes ~1 min of
the ~2.5 of this module: 8 processes share 2 cores, one thread each.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from lmforge.components.training.planner import PlanInput, make_plan
from tests.integration.train_support import run_training, tiny_training

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 3
COMMON = {"precision": "fp32", "max_steps": STEPS, "warmup_steps": 2, "save_every": 2, "keep_checkpoints": 2,
          "model": {"preset": "tiny", "num_layers": 4}}
THREE_D = {"strategy": "ddp", "pipeline": {"stages": 2, "micro_batches": 2}, "tensor": {"autotp_size": 2}}
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def single(ws):
    return run_training(ws, "single", tiny_training(**COMMON, num_ranks=1, grad_accum_steps=4, parallel={"strategy": "ddp"}))


@pytest.fixture(scope="module")
def three_d(ws):
    return run_training(ws, "3d", tiny_training(**COMMON, num_ranks=8, parallel=THREE_D), timeout_s=600)


def test_dp2_pp2_tp2_matches_the_single_rank_loss_and_gradient_norm(single, three_d):
    (ref, _), (ours, run_dir) = single, three_d
    assert [e["step"] for e in ours] == list(range(1, STEPS + 1))
    layout = json.loads((run_dir / "export" / "lmforge.json").read_text())["layout"]
    assert (layout["world_size"], layout["dp"], layout["pp"], layout["tp"], layout["global_batch"]) == (8, 2, 2, 2, 16)
    for a, b in zip(ref, ours, strict=True):
        assert math.isfinite(b["loss"]) and abs(a["loss"] - b["loss"]) < TOLERANCE, (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=TOLERANCE), (a["step"], a["grad_norm"], b["grad_norm"])


def test_the_export_is_the_whole_model_and_reproduces_the_engines_loss(three_d):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lmforge.components.training.pipeline_model import lm_loss

    run_dir = three_d[1]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "export").eval()
    layer = model.model.layers[3]
    assert model.config.num_hidden_layers == 4 and layer.self_attn.q_proj.weight.shape == (64, 64)
    assert layer.mlp.down_proj.weight.shape == (64, 128)
    probe = load_file(str(run_dir / "probe.safetensors"))  # the engine's loss on the 16 windows of step 4
    with torch.no_grad():
        losses = [lm_loss(model(input_ids=x).logits, y) for x, y in zip(probe["input_ids"].split(4), probe["labels"].split(4),
                                                                           strict=True)]
    assert len(losses) == 4 and abs(float(sum(losses) / 4) - float(probe["loss"])) < TOLERANCE


def test_the_planner_predicts_each_ranks_model_states(three_d):
    """fp32 DDP inside each pipeline: 4 + 4 + 8 bytes a parameter, over the heaviest rank's parameters (the
    last stage: two blocks' shards, the head and the norm whole). Measured as the optimizer step begins, at
    step 2 (Adam's states exist). Stage 0's ranks hold 64 fewer parameters (the embedding, no final norm)."""
    events, run_dir = three_d
    params = json.loads((run_dir / "export" / "lmforge.json").read_text())["params"]
    plan = make_plan(PlanInput(params=params, devices=8, memory_gb=1, precision="fp32", pp=2, tp=2, hidden_size=64,
                               num_layers=4, num_heads=4, vocab_size=512))
    ddp = plan.rows[0]
    assert ddp.strategy == "ddp"
    measured = events[1]["memory"]
    assert len(measured) == 8
    for rank, mem in enumerate(measured):
        for key, predicted_gb in (("params", ddp.params_gb), ("grads", ddp.grads_gb), ("optimizer", ddp.optimizer_gb)):
            assert abs(mem[key] / (predicted_gb * 1e9) - 1) < 0.01, (rank, key, mem, predicted_gb)
    even_split = 16 * params / 4  # what Psi / (pp x tp) predicted: the replicated tables are missing
    assert all(mem["total"] > 1.25 * even_split for mem in measured)


def test_resume_on_the_same_layout_repeats_the_steps_bit_for_bit(ws, three_d):
    events, run_dir = three_d
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "step-0000002" / "COMPLETE.json").is_file()
    assert len(list((checkpoints / "step-0000002").glob("layer_*-model_01-model_states.pt"))) == 6  # each tp rank's
    shutil.rmtree(checkpoints / f"step-{STEPS:07d}")  # as if the run had stopped after step 2
    resumed, _ = run_training(ws, "3d", tiny_training(**COMMON, num_ranks=8, parallel=THREE_D), resume=True, timeout_s=600)
    assert [e["step"] for e in resumed] == [3]
    assert resumed[0]["loss"] == events[2]["loss"] and resumed[0]["grad_norm"] == events[2]["grad_norm"]
