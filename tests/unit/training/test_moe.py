"""Mixture of Experts without ranks: config checks, the HF <-> DeepSpeed weight round trip, gating equality, counts.

The DeepSpeed MoE layer runs in one process here (ep_size 1 needs no process group); the
2-rank runs are in tests/integration/test_train_moe.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from pydantic import ValidationError

from lmforge.components.errors import UserError
from lmforge.components.sections.training import ModelConfig, TrainingConfig
from lmforge.components.training import moe as M
from lmforge.components.training.layout import check_layout
from lmforge.components.training.model import (
    build_model,
    count_params,
    expert_param_count,
    param_count,
    train_flops_per_token,
)
from lmforge.components.training.planner import PlanInput, make_plan

VOCAB, SEQ = 512, 64


class Tok:
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __len__(self) -> int:
        return VOCAB


def moe_model(**moe) -> tuple[ModelConfig, torch.nn.Module]:
    cfg = ModelConfig(preset="tiny", num_layers=4, moe={"num_experts": 4, **moe})
    return cfg, build_model(cfg, Tok(), seq_len=SEQ, seed=0)


@pytest.mark.parametrize("training, message", [
    ({"model": {"init": "/models/base", "moe": {"num_experts": 4}}}, "a MoE base (Qwen3-MoE, Mixtral) fine-tunes like any base"),
    ({"model": {"moe": {"num_experts": 4}}, "parallel": {"strategy": "zero3"}}, "not supported with ZeRO Stage 3"),
    ({"model": {"moe": {"num_experts": 4}}, "parallel": {"strategy": "ddp", "pipeline": {"stages": 2}}},
     "set pipeline.stages = 1"),
    ({"model": {"moe": {"num_experts": 4}}, "parallel": {"tensor": {"autotp_size": 2}}}, "tensor.autotp_size = 1"),
    ({"model": {"moe": {"num_experts": 4}}, "objective": "sft"}, "MoE trains a preset from scratch with the causal"),
    ({"parallel": {"expert_parallel": 2}}, "the model has none (model.moe.num_experts = 0)"),
    ({"model": {"moe": {"num_experts": 6}}, "parallel": {"expert_parallel": 4}}, "must divide model.moe.num_experts = 6"),
    ({"model": {"moe": {"num_experts": 2, "top_k": 3}}}, "top_k = 3 routes each token to more experts"),
    ({"model": {"moe": {"num_experts": 1}}}, "num_experts = 1 is a dense MLP"),
])
def test_moe_combinations_are_refused_at_config_load(training, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainingConfig.model_validate(training)


def test_expert_parallel_must_divide_the_data_parallel_ranks():
    cfg = TrainingConfig.model_validate({"model": {"moe": {"num_experts": 4}}, "parallel": {"expert_parallel": 4}})
    with pytest.raises(UserError) as e:
        check_layout(cfg, vocab_size=VOCAB, world_size=2)
    assert e.value.what == "training.parallel.expert_parallel" and "must divide the data-parallel ranks (2)" in e.value.problem
    assert check_layout(cfg, vocab_size=VOCAB, world_size=4).dp == 4


def test_the_preset_with_experts_is_a_seeded_qwen3_moe():
    cfg, model = moe_model(top_k=2, every=2)
    again = build_model(cfg, Tok(), seq_len=SEQ, seed=0)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.norm_topk_prob and model.config.num_experts_per_tok == 2 and model.config.mlp_only_layers == []
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"] * 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    assert model.model.layers[1].mlp.gate.weight.abs().sum() > 0  # the router is initialised, not left at zero


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_deepspeed_moe_reproduces_the_hf_model_in_eval(top_k):
    """Same router and experts: DeepSpeed's top1 (no renormalisation), top2 and topk (renormalised) gates give the
    logits of transformers' Qwen3-MoE with norm_topk_prob = top_k > 1, no token dropped at eval capacity."""
    _, hf = moe_model(top_k=top_k)
    ds = copy.deepcopy(hf)
    blocks = M.swap_in_deepspeed_moe(ds, ModelConfig(preset="tiny", moe={"num_experts": 4, "top_k": top_k}).moe,
                                     ep_size=1, ep_rank=0)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ours = hf.eval()(input_ids=ids).logits, ds.eval()(input_ids=ids).logits
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    assert len(blocks) == 4 and all(int(b.dropped) == 0 for b in blocks)
    assert sum(int(b.exp_counts.sum()) for b in blocks) == 4 * ids.numel() * top_k


@pytest.mark.parametrize("ep", [1, 2])
def test_weights_round_trip_hf_to_deepspeed_to_hf(ep):
    """Each expert-parallel rank takes its slice of the fused expert tensors; the ranks' experts rebuild them exactly."""
    cfg, hf = moe_model()
    experts, dense = {}, None
    for ep_rank in range(ep):
        ds = copy.deepcopy(hf)
        M.swap_in_deepspeed_moe(ds, cfg.moe, ep_size=ep, ep_rank=ep_rank)
        mine = M.local_experts(ds, ep_rank=ep_rank)
        assert sorted({gid for _, gid in mine}) == list(range(ep_rank * 4 // ep, (ep_rank + 1) * 4 // ep))
        experts.update(mine)
        dense = ds.state_dict()
    assert dense is not None and any(M.DS_GATE in k for k in dense)
    state, ref = M.hf_moe_state(dense, experts, 4), hf.state_dict()
    assert set(state) == set(ref) and all(torch.equal(state[k], ref[k]) for k in ref)
    with pytest.raises(AssertionError, match=r"experts \[3\] were gathered from no rank"):
        M.hf_moe_state(dense, {k: v for k, v in experts.items() if k[1] != 3}, 4)


def test_training_capacity_drops_the_routes_past_it_and_counts_them():
    cfg, hf = moe_model(capacity_factor=0.5)
    ds = copy.deepcopy(hf)
    blocks = M.swap_in_deepspeed_moe(ds, cfg.moe, ep_size=1, ep_rank=0)
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    ds.train()(input_ids=ids)
    capacity = max(M.MIN_CAPACITY, math.ceil(ids.numel() / 4 * 0.5))  # DeepSpeed's _capacity for top-1
    for b in blocks:
        expected = sum(max(0, int(c) - capacity) for c in b.exp_counts)
        assert int(b.dropped) == expected and b.routes == ids.numel()
    stats = M.MoeStats.zeros(4, "cpu")
    stats.add(blocks)
    fields = M.summarize([stats.as_floats(), stats.as_floats()])  # two ranks alike
    assert fields["expert_tokens"] == [2 * sum(int(b.exp_counts[e]) for b in blocks) for e in range(4)]
    assert fields["moe_dropped_fraction"] == pytest.approx(sum(int(b.dropped) for b in blocks) / (4 * ids.numel()))
    assert fields["moe_dropped_fraction"] > 0
    assert fields["moe_aux_loss"] == pytest.approx(float(M.aux_loss(blocks).detach()))


def test_optimizer_groups_put_the_experts_apart():
    cfg, model = moe_model()
    M.swap_in_deepspeed_moe(model, cfg.moe, ep_size=1, ep_rank=0)
    groups = M.optimizer_groups(list(model.parameters()))
    moe_groups = [g for g in groups if g.get("moe")]
    assert [g["name"] for g in moe_groups] == ["ep_size_1"]
    n_expert = sum(p.numel() for g in moe_groups for p in g["params"])
    assert n_expert == expert_param_count(cfg) and sum(p.numel() for g in groups for p in g["params"]) == count_params(model)


def test_parameter_and_flop_counts_use_the_active_experts():
    cfg, model = moe_model()
    # tiny at 4 layers, hidden 64, MLP 128, vocabulary 512, untied: attention 4 x 64 x 64 = 16384, q/k norms 2 x 16,
    # layer norms 2 x 64, router 4 x 64, one expert 3 x 64 x 128 = 24576; embedding and head 512 x 64 each, final norm 64.
    per_layer_shared = 16384 + 32 + 128 + 256
    outside = 2 * 512 * 64 + 64
    assert param_count(cfg, vocab_size=VOCAB) == count_params(model) == outside + 4 * (per_layer_shared + 4 * 24576)
    active = outside + 4 * (per_layer_shared + 24576)
    assert param_count(cfg, vocab_size=VOCAB, active=True) == active == 231104
    assert expert_param_count(cfg) == 4 * 4 * 24576
    expected = 6.0 * (active - 512 * 64) + 12.0 * 4 * 64 * SEQ  # the embedding lookup is no matmul
    assert train_flops_per_token(cfg, vocab_size=VOCAB, seq_len=SEQ) == expected


def test_planner_divides_the_experts_over_the_expert_parallel_ranks():
    # 10B parameters of which 8B are experts, 4 devices (dp 4), ep 2, bf16 (2 + 2 + 12 bytes a parameter):
    # dense 2B over dp 4, experts 8B / 2 = 4B a device over dp / ep = 2.
    plan = make_plan(PlanInput(params=10e9, devices=4, memory_gb=80, expert_params=8e9, ep=2, active_params=4e9))
    rows = {r.strategy: r for r in plan.rows}
    assert not any(s.startswith("zero3") for s in rows)  # DeepSpeed's MoE layer refuses ZeRO-3
    assert rows["ddp"].model_states_gb == pytest.approx(16 * 2 + 16 * 4)
    assert rows["zero1"].model_states_gb == pytest.approx((4 * 2 + 12 * 2 / 4) + (4 * 4 + 12 * 4 / 2))
    assert rows["zero2"].model_states_gb == pytest.approx((2 * 2 + 14 * 2 / 4) + (2 * 4 + 14 * 4 / 2))
    assert plan.params_per_device == pytest.approx(6e9) and plan.active_params == pytest.approx(4e9)
    with pytest.raises(UserError, match="must divide the data-parallel devices"):
        make_plan(PlanInput(params=10e9, devices=4, memory_gb=80, expert_params=8e9, ep=3))
    with pytest.raises(UserError, match="the model has none"):
        make_plan(PlanInput(params=10e9, devices=4, memory_gb=80, ep=2))


def test_lmforge_plan_with_experts():
    import json

    import typer
    from typer.testing import CliRunner

    from lmforge.cli.commands.plan import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps `plan` a named subcommand
    out = CliRunner().invoke(app, ["plan", "--model", "tiny", "--devices", "2", "--memory-gb", "1", "--vocab", "512",
                                   "--experts", "4", "--ep", "2", "--json"])
    assert out.exit_code == 0, out.output
    plan = json.loads(out.stdout)
    cfg = ModelConfig(preset="tiny", moe={"num_experts": 4})
    total, experts = param_count(cfg, vocab_size=512), expert_param_count(cfg)
    assert plan["input"]["params"] == total and plan["input"]["expert_params"] == experts
    assert plan["params_per_device"] == total - experts / 2
    assert plan["active_params"] == param_count(cfg, vocab_size=512, active=True)
    bad = CliRunner().invoke(app, ["plan", "--model", "7b", "--experts", "4"])
    assert isinstance(bad.exception, UserError) and "needs a preset" in bad.exception.problem


def test_a_moe_bases_flops_count_its_active_experts():
    """A base's generic count (a meta-device model) misses fused 3D experts in a projections walk; they are added,
    top_k of E, with the router: within 1% of the preset's closed form (which also counts norms), and by hand for
    Mixtral (2 layers x (top-2 experts of 3 x 64 x 128, router 4 x 64))."""
    from transformers import MixtralConfig

    from lmforge.components.training.model import active_expert_weights, hf_train_flops_per_token, meta_model, moe_config

    for moe in ({"top_k": 2}, {"num_experts": 8, "every": 2, "expert_size": 32}):
        cfg = ModelConfig(preset="tiny", num_layers=4, moe={"num_experts": 4, **moe})
        generic = hf_train_flops_per_token(moe_config(cfg, Tok(), seq_len=SEQ), seq_len=SEQ)
        assert generic == pytest.approx(train_flops_per_token(cfg, vocab_size=VOCAB, seq_len=SEQ), rel=0.01)
    mixtral = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB)
    assert active_expert_weights(meta_model(mixtral), mixtral) == 2 * (2 * 3 * 64 * 128 + 4 * 64)
