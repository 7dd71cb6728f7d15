"""The planner reproduces the ZeRO paper's formulas and the 7B rule of thumb."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lmforge.components.training.planner import PlanInput, make_plan, model_state_bytes, parse_size


def test_7b_on_8x80gb_matches_the_rule_of_thumb():
    plan = make_plan(PlanInput(params=7e9, devices=8, memory_gb=80))
    rows = {r.strategy: r for r in plan.rows}
    assert rows["ddp"].model_states_gb == pytest.approx(112.0)
    assert rows["zero1"].model_states_gb == pytest.approx(4 * 7 + 12 * 7 / 8)
    assert rows["zero2"].model_states_gb == pytest.approx(2 * 7 + 14 * 7 / 8)
    assert rows["zero3"].model_states_gb == pytest.approx(16 * 7 / 8)
    assert plan.inference_gb == pytest.approx(14.0)
    assert not rows["ddp"].fits and plan.recommended == "zero1"
    off = rows["zero3+offload_optimizer+offload_param"]
    assert off.optimizer_gb == 0 and off.params_gb == 0 and off.host_gb == pytest.approx((12 + 2) * 7 / 8)


def test_fp32_and_offload_formulas():
    s = model_state_bytes(1000, strategy="zero2", dp=4, precision="fp32")
    assert s == {"params": 4000, "grads": 1000, "optimizer": 3000, "host": 0.0}  # ZeRO keeps an fp32 master copy
    assert sum(model_state_bytes(1000, strategy="ddp", dp=4, precision="fp32").values()) == 16000
    o = model_state_bytes(1000, strategy="zero2+offload_optimizer", dp=4, precision="bf16")
    assert o["optimizer"] == 0 and o["host"] == 3000


def test_nothing_fits_and_activation_checkpointing_helps():
    big = PlanInput(params=70e9, devices=8, memory_gb=80, hidden_size=8192, num_layers=80, num_heads=64, seq_len=4096)
    assert make_plan(big).recommended == "zero3+offload_optimizer+offload_param" or make_plan(big).recommended is None
    plain, ckpt = make_plan(big), make_plan(PlanInput(**{**big.__dict__, "activation_checkpointing": True}))
    assert ckpt.rows[0].activations_gb < plain.rows[0].activations_gb / 5


def test_parse_size():
    assert parse_size("7b") == 7e9 and parse_size("125M") == 125e6 and parse_size("1.3e9") == 1.3e9


def test_plan_command_prints_the_table_and_json():
    import typer

    from lmforge.cli.commands.plan import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps `plan` a named subcommand
    out = CliRunner().invoke(app, ["plan", "--model", "7b", "--devices", "8", "--memory-gb", "80", "--json"])
    assert out.exit_code == 0, out.output
    plan = json.loads(out.output)
    assert plan["rows"][0]["model_states_gb"] == pytest.approx(112.0) and plan["inference_gb"] == pytest.approx(14.0)
    text = CliRunner().invoke(app, ["plan", "--model", "demo", "--devices", "2", "--memory-gb", "1", "--seq-len", "128"])
    assert text.exit_code == 0 and "recommended: ddp" in text.output


def test_lora_keeps_the_frozen_base_weights_and_adapter_states_only():
    full = {r.strategy: r for r in make_plan(PlanInput(params=7e9, devices=2, memory_gb=80)).rows}
    lora = {r.strategy: r for r in make_plan(PlanInput(params=7e9, devices=2, memory_gb=80, trainable=8e6)).rows}
    assert lora["ddp"].params_gb == pytest.approx(full["ddp"].params_gb)              # the base's bf16 weights, whole
    assert lora["ddp"].grads_gb == pytest.approx(2 * 8e6 / 1e9)                       # bf16 gradients of the adapters
    assert lora["zero2"].optimizer_gb == pytest.approx(12 * 8e6 / 2 / 1e9)            # their fp32 Adam states, halved
    assert lora["zero3"].params_gb == pytest.approx(full["zero3"].params_gb)           # ZeRO-3 still partitions the base
    assert lora["ddp"].model_states_gb < full["zero3"].model_states_gb


def test_plan_reads_a_base_folder_and_counts_its_adapters_exactly(checkpoint):

    from lmforge.cli.commands.plan import base_size

    folder = checkpoint("qwen2")
    params, shape, trainable = base_size(folder, 8)
    assert shape["hidden_size"] == 64 and shape["num_layers"] == 2
    # q_proj (64 -> 64) and v_proj (64 -> 32: 2 of 4 heads) on both blocks, A and B each
    assert trainable == 2 * (8 * (64 + 64) + 8 * (64 + 32))
    assert base_size(folder, 0)[2] is None and params > 0


def test_pipeline_and_tensor_parallel_keep_the_embedding_and_the_head_whole():
    """The tiny preset at 4 layers, vocabulary 512, by hand: embedding and head 512 x 64 = 32768 each, final norm 64,
    a block 4 x 64 x 64 (q, k, v, o) + 3 x 64 x 128 (gate, up, down) = 40960 projections + 128 of norms."""
    n = 2 * 32768 + 64 + 4 * (40960 + 128)
    shape = {"hidden_size": 64, "num_layers": 4, "num_heads": 4, "vocab_size": 512, "precision": "fp32", "memory_gb": 1}
    three_d = make_plan(PlanInput(params=n, devices=8, pp=2, tp=2, **shape))
    last_stage = 2 * (40960 // 2 + 128) + 32768 + 64  # two blocks' shards, the head and the final norm, whole
    assert three_d.dp == 2 and three_d.params_per_device == last_stage == 74048
    assert three_d.rows[0].params_gb == pytest.approx(4 * last_stage / 1e9)       # fp32 weights under ddp
    assert three_d.params_per_device > n / 4 * 1.25                                 # the even split was 57488
    autotp = make_plan(PlanInput(params=n, devices=2, tp=2, **shape))
    assert autotp.params_per_device == 4 * (40960 // 2 + 128) + 32768 + 32768 // 2 + 64  # AutoTP shards the head
    made_up = make_plan(PlanInput(params=1e6, devices=4, pp=2, tp=2, precision="fp32", memory_gb=1))  # 7B-like shape
    assert made_up.params_per_device == pytest.approx(1e6 / 4)                     # tables bigger than the model


def test_tensor_parallel_activations_keep_the_replicated_part_whole_and_only_runnable_strategies_are_planned():
    from lmforge.components.training.planner import activation_bytes

    s, b, h, a, v = 128, 2, 64, 4, 512
    shape = {"params": 1e6, "devices": 8, "memory_gb": 1, "seq_len": s, "micro_batch": b, "hidden_size": h,
             "num_heads": a, "num_layers": 4, "vocab_size": v}
    logits = s * b * v * 10
    assert activation_bytes(PlanInput(**shape)) == pytest.approx(4 * s * b * h * (34 + 5 * a * s / h) + logits)
    # Korthikanti et al., Table 2: 10 s b h per layer stays on every tensor rank, 24 s b h + 5 a s^2 b divide by tp.
    assert activation_bytes(PlanInput(**shape, tp=2)) == pytest.approx(4 * s * b * h * (10 + 12 + 5 * a * s / (2 * h)) + logits)
    three_d = make_plan(PlanInput(**shape, pp=2, tp=2))
    assert [r.strategy for r in three_d.rows] == ["ddp", "zero1"]  # a pipeline runs ddp or zero1 (sections/training.py)
    assert "zero3" not in [r.strategy for r in make_plan(PlanInput(**shape, tp=2)).rows]  # AutoTP: ddp to zero2


def test_plan_command_for_a_three_d_layout():
    import typer

    from lmforge.cli.commands.plan import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    out = CliRunner().invoke(app, ["plan", "--model", "tiny", "--devices", "8", "--pp", "2", "--tp", "2", "--vocab", "512",
                                   "--memory-gb", "1", "--precision", "fp32", "--json"])
    assert out.exit_code == 0, out.output
    plan = json.loads(out.output)
    # tiny preset (2 layers): the last stage holds one block's shards (8192 x 5 / 2 + 128), the head and the norm
    assert plan["dp"] == 2 and plan["params_per_device"] == 5 * 8192 // 2 + 128 + 512 * 64 + 64
    assert plan["rows"][0]["params_gb"] == pytest.approx(4 * plan["params_per_device"] / 1e9)
