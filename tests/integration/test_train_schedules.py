"""Interleaved 1F1B, zero bubble (ZB-V) and DualPipeV on 2 real CPU ranks (gloo), against DDP's losses.

Each schedule runs the tiny model at 4 layers as 2 stages x 2 chunks, 4 micro-batches of 4
windows; DDP runs the same 16 windows a step as 2 ranks x 2 micro-batches, with the same seed,
so the global batch, the AdamW step, the LR curve and the clipping are the same and the losses
differ only by float summation order (tolerance 1e-3 per step, measured ~1e-6). Each run logs
its bubble beside the formula, and its export holds exactly the weights its ranks trained. The schedules run with
precision = "auto": on a host whose bf16 is native (this CPU's AVX512-BF16 and AMX, every GPU) it resolves to fp32 for
them, the only precision they train in, and says so (issue 43); DDP's fp32 losses check they did.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from tests.integration.train_support import run_training, tiny_training

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = {"precision": "fp32", "max_steps": 6, "save_every": 3, "warmup_steps": 2, "model": {"num_layers": 4}}
LOSS_TOLERANCE = 1e-3


def pipe(schedule: str) -> dict:
    return {"strategy": "ddp", "pipeline": {"stages": 2, "micro_batches": 4, "schedule": schedule, "virtual_stages": 2}}


@pytest.fixture(scope="module")
def ddp(ws):
    events, _ = run_training(ws, "ddp", tiny_training(**STEPS, grad_accum_steps=2, parallel={"strategy": "ddp"}))
    return [e["loss"] for e in events]


def _chunk_weights(run_dir, step: str) -> dict[str, torch.Tensor]:
    """Every trained tensor in the final checkpoint's chunk files, under the blocks' Hugging Face names."""
    from transformers import AutoModelForCausalLM

    from lmforge.components.training.pipeline_model import pipeline_layers, stage_hf_state
    from lmforge.components.training.schedules import RankChunks, saved_partition

    folder = run_dir / "checkpoints" / step
    bounds = saved_partition(folder)["bounds"]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "export")  # only for its block structure
    blocks = pipeline_layers(model)
    chunks = []
    for f in sorted(folder.glob("pp*_dp*.pt")):
        for s, state in torch.load(f, weights_only=False)["chunks"].items():
            chunk = torch.nn.Sequential(*blocks[bounds[s]:bounds[s + 1]])
            chunk.load_state_dict(state)
            chunks.append(chunk)
    return stage_hf_state(RankChunks(chunks))


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zero-bubble", "dualpipev"])
def test_schedule_matches_ddp_logs_its_bubble_and_exports(ws, ddp, schedule):
    from transformers import AutoModelForCausalLM

    from lmforge.components.runtime.accelerator import choose_precision
    from lmforge.components.training.protocol import read_request

    auto = {**STEPS, "precision": "auto"}
    events, run_dir = run_training(ws, schedule, tiny_training(**auto, parallel=pipe(schedule)), timeout_s=300)
    hardware = read_request(run_dir / "request-0.json").hardware
    assert hardware.precision == "fp32"
    if choose_precision("auto", "cpu").name == "bf16":   # a bf16-capable host: the layout decided, and says why
        assert hardware.precision_reason.startswith(f"auto, and the {schedule} schedule trains in fp32"), hardware
    losses = [e["loss"] for e in events]
    assert len(losses) == STEPS["max_steps"] and all(math.isfinite(x) for x in losses), losses
    diffs = [abs(a - b) for a, b in zip(losses, ddp, strict=True)]
    assert max(diffs) < LOSS_TOLERANCE, f"{schedule} vs ddp: {losses} / {ddp}"
    assert losses[-1] < losses[0] - 0.1, losses

    for e in events:
        b = e["bubble"]
        assert b["schedule"] == schedule and (b["p"], b["v"], b["m"]) == (2, 2, 4)
        assert b["bubble"] >= 0 and 0 <= b["bubble_of_step"] < 1 and len(b["bubble_per_rank"]) == 2
        assert b["t_f"] > 0 and b["t_b"] > 0 and math.isfinite(b["bubble_formula"]) and b["bubble_simulated"] >= 0
    if schedule == "interleaved-1f1b":
        assert events[-1]["bubble"]["bubble_formula"] == pytest.approx(1 / 8)
    else:
        assert events[-1]["bubble"]["t_w"] > 0 and events[-1]["bubble"]["t_i"] > 0
    assert (run_dir / "checkpoints" / "step-0000006" / "COMPLETE.json").is_file()

    exported = AutoModelForCausalLM.from_pretrained(run_dir / "export").state_dict()
    trained = _chunk_weights(run_dir, "step-0000006")
    assert set(trained) == {k for k in exported if not k.endswith("inv_freq")}
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor), name


def test_zero_bubble_resumes_where_it_left_off(ws):
    """The last checkpoint removed, a resume from step 3 reproduces steps 4-6 bit for bit (partition read back)."""
    cfg = tiny_training(**STEPS, parallel=pipe("zero-bubble"))
    first, run_dir = run_training(ws, "zb-resume", cfg, timeout_s=300)
    shutil.rmtree(run_dir / "checkpoints" / "step-0000006")
    resumed, _ = run_training(ws, "zb-resume", cfg, resume=True, timeout_s=300)
    assert [e["step"] for e in resumed] == [4, 5, 6]
    assert [e["loss"] for e in resumed] == [e["loss"] for e in first[3:]]
