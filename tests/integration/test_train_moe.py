"""Mixture of Experts on 2 real DeepSpeed ranks (gloo on CPU): the tiny preset at 4 layers with 4 experts, top-1.

At expert_parallel = 2 each rank holds 2 experts and tokens cross ranks by all-to-all; at 1 each
rank holds all 4. Both start from the same seeded Qwen3-MoE weights and gate the same tokens, so
their losses agree (fp32). The export is a Qwen3-MoE folder that reproduces the engine's eval
logits, and a resume from the step-3 checkpoint (expert files saved apart) repeats steps 4-6.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from tests.integration.train_support import run_training, tiny_training

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

EXPERTS, LAYERS, STEPS = 4, 4, 6
# Measured at 4 steps: the two degrees' losses differ by < 3e-7 (fp32 sums in another order after the all-to-all).
LOSS_TOLERANCE = 1e-4


def moe_training(ep: int, **overrides):
    return tiny_training(precision="fp32", max_steps=STEPS, warmup_steps=2, save_every=3,
                         model={"num_layers": LAYERS, "moe": {"num_experts": EXPERTS, "top_k": 1}},
                         parallel={"strategy": "zero2", "expert_parallel": ep}, **overrides)


@pytest.fixture(scope="module")
def runs(ws):
    return {ep: run_training(ws, f"moe-ep{ep}", moe_training(ep)) for ep in (1, 2)}


def test_moe_at_expert_parallel_2_trains_and_logs_its_routing(runs):
    events, _ = runs[2]
    losses = [e["loss"] for e in events]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses
    cfg = moe_training(2)
    routed = cfg.micro_batch_size * cfg.seq_len * 2 * LAYERS  # tokens per step on both ranks, each sparse layer, top-1
    for e in events:
        assert len(e["expert_tokens"]) == EXPERTS and sum(e["expert_tokens"]) == routed, e["expert_tokens"]
        assert 0 <= e["moe_dropped_fraction"] < 0.5
        # top-1's l_aux is E x sum(mean prob x token share): 1 when balanced, E when one expert takes all; summed over layers
        assert LAYERS * 0.9 < e["moe_aux_loss"] < LAYERS * EXPERTS
    assert any(e["moe_dropped_fraction"] > 0 for e in events)  # capacity 1.25: an uneven router drops some routes


def test_loss_at_expert_parallel_2_equals_expert_parallel_1(runs):
    one, two = ([e["loss"] for e in runs[ep][0]] for ep in (1, 2))
    diffs = [abs(a - b) for a, b in zip(one, two, strict=True)]
    assert max(diffs) < LOSS_TOLERANCE, diffs
    assert [e["expert_tokens"] for e in runs[1][0]] == [e["expert_tokens"] for e in runs[2][0]]


@pytest.mark.parametrize("ep", [1, 2])
def test_export_is_qwen3_moe_and_reproduces_the_engines_logits(runs, ep):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir = runs[ep][1]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "export").eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == EXPERTS
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (EXPERTS, 2 * 128, 64)
    probe = load_file(str(run_dir / "probe.safetensors"))
    with torch.no_grad():
        ours = model(input_ids=probe["input_ids"]).logits.float()
    assert torch.allclose(ours, probe["logits"], atol=1e-5), (ours - probe["logits"]).abs().max()


def test_resume_from_a_moe_checkpoint_repeats_the_last_steps(ws, runs):
    events, run_dir = runs[2]
    step3 = run_dir / "checkpoints" / "step-0000003"
    assert sorted(p.name for p in step3.glob("layer_*_expert_*_model_states.pt"))[:1] == \
        ["layer_0_expert_0_mp_rank_00_model_states.pt"]  # DeepSpeed keeps each expert in a file of its own
    copy = ws.run_dir("moe-resumed")
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step-0000006")  # the newest complete checkpoint is now step 3
    resumed, _ = run_training(ws, "moe-resumed", moe_training(2), resume=True)
    assert [e["step"] for e in resumed] == [4, 5, 6]
    reference = {e["step"]: e["loss"] for e in events}
    assert [e["loss"] for e in resumed] == [reference[e["step"]] for e in resumed]  # bit for bit


def test_planner_moe_model_states_match_what_each_rank_holds(runs):
    """Measured at ep 1 and 2 (fp32, ZeRO-2, 2 ranks): 1.003 and 1.000 of the planner's figure on each rank."""
    from lmforge.components.sections.training import ModelConfig
    from lmforge.components.training.model import expert_param_count, param_count
    from lmforge.components.training.planner import PlanInput, moe_state_bytes

    model = moe_training(1).model
    assert isinstance(model, ModelConfig)
    import json

    vocab = json.loads((runs[1][1] / "export" / "config.json").read_text())["vocab_size"]
    params, experts = param_count(model, vocab_size=vocab), expert_param_count(model)
    held = {}
    for ep in (1, 2):
        theory = moe_state_bytes(PlanInput(params=params, devices=2, memory_gb=1, precision="fp32", expert_params=experts,
                                           ep=ep), strategy="zero2", dp=2)
        expected = theory["params"] + theory["grads"] + theory["optimizer"]
        held[ep] = [mem["total"] for mem in runs[ep][0][1]["memory"]]  # step 2: Adam states exist, gradients alive
        assert all(abs(h / expected - 1) < 0.02 for h in held[ep]), (ep, held[ep], expected)
    assert max(held[2]) < min(held[1])  # each rank holds half the experts and their states


def test_a_moe_export_fine_tunes_as_a_base(ws, runs):
    """What the refusal of init + moe.num_experts promises: a MoE base trains as any base does (transformers' own
    experts on every rank, data-parallel, no routing metrics), its FLOPs per token counting the active experts."""
    from transformers import AutoModelForCausalLM

    from lmforge.components.training.model import train_flops_per_token

    base = ws.root / "moe-base"
    shutil.copytree(runs[2][1] / "export", base)
    for f in (ws.dataset_dir("testdata0001") / "tokenizer").iterdir():  # the dataset's tokenizer files, byte for byte
        shutil.copy(f, base / f.name)
    cfg = tiny_training(precision="fp32", max_steps=3, warmup_steps=1, save_every=3, model={"init": str(base)})
    events, run_dir = run_training(ws, "moe-base-ft", cfg)
    assert len(events) == 3 and all(math.isfinite(e["loss"]) for e in events)
    assert not any("expert_tokens" in e for e in events)
    preset = moe_training(1).model
    assert events[0]["flops_per_token"] == pytest.approx(train_flops_per_token(preset, vocab_size=512, seq_len=64),
                                                         rel=0.01)
    assert type(AutoModelForCausalLM.from_pretrained(run_dir / "export")).__name__ == "Qwen3MoeForCausalLM"
