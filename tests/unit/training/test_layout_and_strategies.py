"""Layout rules are checked before launch, and the DeepSpeed config is built by ordered, gated functions."""

from __future__ import annotations

import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.training import TrainingConfig
from lmforge.components.training.layout import check_layout
from lmforge.components.training.strategies import applied, deepspeed_config, for_deepspeed


def cfg(**kw) -> TrainingConfig:
    base = {"model": {"preset": "tiny"}, "micro_batch_size": 4, "max_steps": 10, "warmup_steps": 2}
    base.update(kw)
    return TrainingConfig.model_validate(base)


@pytest.mark.parametrize("training, world, rule", [
    ({"parallel": {"strategy": "ddp", "pipeline": {"stages": 2}}}, 3,
     "world size must be divisible by pipeline stages x autotp_size = 2 x 1"),
    ({"parallel": {"strategy": "zero1", "tensor": {"autotp_size": 3}}}, 3,
     "attention heads (4) and key/value heads (4) must be divisible by the TP degree"),
    ({"parallel": {"strategy": "ddp", "pipeline": {"stages": 4}}}, 4, "more pipeline stages than decoder layers (2)"),
    ({"global_batch_size": 16}, 2, "global batch = micro_batch_size x accumulation x data-parallel ranks = 4 x 1 x 2 = 8"),
    ({"model": {"preset": "tiny", "num_heads": 3}}, 2, "hidden_size 64 must be divisible by the heads"),
    ({"warmup_steps": 50}, 2, "warmup must not exceed max_steps (10)"),
    ({"model": {"preset": "tiny", "tie_embeddings": True}, "parallel": {"strategy": "zero1", "tensor": {"autotp_size": 2}}},
     2, "output head is tied to its input embedding, and AutoTP shards the head without the embedding"),
    ({"parallel": {"strategy": "ddp", "pipeline": {"stages": 2}, "tensor": {"autotp_size": 2}}}, 6,
     "world size must be divisible by pipeline stages x autotp_size = 2 x 2"),
    ({"model": {"preset": "tiny", "num_kv_heads": 1}, "parallel": {"strategy": "ddp", "pipeline": {"stages": 2},
                                                                   "tensor": {"autotp_size": 2}}}, 8,
     "attention heads (4) and key/value heads (1) must be divisible by the TP degree"),
    ({"model": {"preset": "tiny", "intermediate_size": 130}, "parallel": {"strategy": "zero1", "pipeline": {"stages": 2},
                                                                          "tensor": {"autotp_size": 4}}}, 8,
     "intermediate_size 130 must be divisible by the TP degree"),
])
def test_invalid_layouts_name_the_rule(training, world, rule):
    with pytest.raises(UserError) as e:
        check_layout(cfg(**training), vocab_size=512, world_size=world)
    assert rule in str(e.value)
    assert "breaks the layout rule" in str(e.value) and str(e.value).count("\n") == 0


@pytest.mark.parametrize("parallel, message", [
    ({"strategy": "zero1", "offload_optimizer": True}, "offload_optimizer needs zero2 or zero3"),
    ({"strategy": "zero2", "offload_param": True}, "offload_param needs zero3"),
    ({"strategy": "zero2", "pipeline": {"stages": 2}}, "pipeline parallelism runs with ddp or zero1"),
    ({"strategy": "zero3", "tensor": {"autotp_size": 2}}, "autotp runs with ddp, zero1 or zero2"),
    ({"strategy": "ddp", "pipeline": {"stages": 2, "schedule": "zero-bubble", "virtual_stages": 2},
      "tensor": {"autotp_size": 2}}, "run on deepspeed's 1f1b engine, whose blocks shard themselves"),
])
def test_unsupported_combinations_fail_at_config_load(parallel, message):
    from lmforge.components.config import validate_config

    with pytest.raises(UserError) as e:
        validate_config({"training": {"parallel": parallel}})
    assert message in str(e.value).lower()


def test_layout_arithmetic_and_lr_scaling():
    layout = check_layout(cfg(grad_accum_steps=2, lr=1e-3, lr_scaling=True, reference_batch_size=8,
                              parallel={"strategy": "zero1", "tensor": {"autotp_size": 2}}), vocab_size=512, world_size=4)
    assert (layout.dp, layout.tp, layout.pp, layout.accum, layout.global_batch) == (2, 2, 1, 2, 16)
    assert layout.lr == pytest.approx(2e-3)
    pipe = check_layout(cfg(parallel={"strategy": "ddp", "pipeline": {"stages": 2, "micro_batches": 4}}),
                        vocab_size=512, world_size=2)
    assert (pipe.dp, pipe.accum, pipe.global_batch) == (1, 4, 16)


def test_precision_auto_follows_the_hardware():
    assert check_layout(cfg(), vocab_size=512, world_size=2, bf16_supported=True).bf16
    assert not check_layout(cfg(), vocab_size=512, world_size=2, bf16_supported=False).bf16
    assert not check_layout(cfg(precision="fp32"), vocab_size=512, world_size=2).bf16


def test_gates_fire_in_order_and_only_when_on():
    plain = cfg(parallel={"strategy": "ddp"})
    ddp = deepspeed_config(plain, check_layout(plain, vocab_size=512, world_size=2))
    assert applied(ddp) == ["base"] and ddp["zero_optimization"] == {"stage": 0}
    c = cfg(activation_checkpointing=True, parallel={"strategy": "zero3", "offload_optimizer": True, "offload_param": True})
    ds = deepspeed_config(c, check_layout(c, vocab_size=512, world_size=2))
    assert applied(ds) == ["base", "zero3", "offload", "activation_checkpointing"]
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert "torch_adam" not in ds["optimizer"]["params"]  # offload steps on the host with DeepSpeedCPUAdam
    p = cfg(parallel={"strategy": "zero1", "pipeline": {"stages": 2, "partition": "uniform"}})
    pds = deepspeed_config(p, check_layout(p, vocab_size=512, world_size=2))
    assert applied(pds) == ["base", "zero1", "pipeline"] and pds["pipeline"]["partition"] == "uniform"
    t = cfg(parallel={"strategy": "zero2", "tensor": {"autotp_size": 2}})
    tds = deepspeed_config(t, check_layout(t, vocab_size=512, world_size=2))
    assert applied(tds) == ["base", "zero2", "tensor_parallel"] and tds["tensor_parallel"] == {"autotp_size": 2}
    assert tds["train_batch_size"] == 4 * 1 * 1 * 2  # DeepSpeed checks it against the whole world
    assert "lmforge_applied" not in for_deepspeed(tds)


def test_deepspeed_accepts_the_generated_config():
    from deepspeed.runtime.config import DeepSpeedConfig

    c = cfg(grad_accum_steps=2, parallel={"strategy": "zero2"})
    layout = check_layout(c, vocab_size=512, world_size=1)
    parsed = DeepSpeedConfig(for_deepspeed(deepspeed_config(c, layout)))  # no process group: world size 1
    assert parsed.train_batch_size == 8 and parsed.gradient_accumulation_steps == 2 and parsed.zero_optimization_stage == 2


def test_three_d_layout_keeps_the_batch_at_micro_x_accum_x_dp_and_shards_inside_the_pipeline():
    """dp x pp x tp = 2 x 2 x 2: the pipeline shards its own blocks, so no AutoTP section; DeepSpeed's pipeline
    engine checks train_batch_size against the grid's data-parallel size, not the whole world (AutoTP alone is
    checked against the world). DeepSpeed accepting it on 8 ranks: tests/integration/test_train_3d.py."""
    c = cfg(parallel={"strategy": "zero1", "pipeline": {"stages": 2, "micro_batches": 2}, "tensor": {"autotp_size": 2}})
    layout = check_layout(c, vocab_size=512, world_size=8)
    assert (layout.dp, layout.pp, layout.tp, layout.accum, layout.global_batch) == (2, 2, 2, 2, 4 * 2 * 2)
    ds = deepspeed_config(c, layout)
    assert applied(ds) == ["base", "zero1", "pipeline", "pipeline_tensor_parallel"]
    assert "tensor_parallel" not in ds and ds["pipeline"]["tensor_parallel"] == 2 and ds["pipeline"]["stages"] == 2
    assert ds["train_batch_size"] == layout.micro * layout.accum * layout.dp == 16
    assert ds["gradient_accumulation_steps"] == 2 and ds["train_micro_batch_size_per_gpu"] == 4


def test_autocast_swaps_deepspeeds_bf16_section_for_its_torch_autocast_one():
    from lmforge.components.sections.training import TrainingConfig
    from lmforge.components.training.layout import check_layout
    from lmforge.components.training.strategies import applied, deepspeed_config

    cfg = TrainingConfig.model_validate({"precision": "bf16", "mixed_precision": "autocast"})
    ds = deepspeed_config(cfg, check_layout(cfg, vocab_size=64, world_size=2))
    assert ds["bf16"] == {"enabled": False} and ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert "autocast" in applied(ds)
    plain = TrainingConfig.model_validate({"precision": "bf16"})
    assert "torch_autocast" not in deepspeed_config(plain, check_layout(plain, vocab_size=64, world_size=2))
    fp32 = TrainingConfig.model_validate({"precision": "fp32", "mixed_precision": "autocast"})
    assert "torch_autocast" not in deepspeed_config(fp32, check_layout(fp32, vocab_size=64, world_size=2))


def test_autocast_under_a_pipeline_is_refused_naming_both_ways_out():
    from lmforge.components.sections.training import TrainingConfig

    with pytest.raises(ValueError, match="pipeline.stages = 1, or mixed_precision"):
        TrainingConfig.model_validate({"mixed_precision": "autocast",
                                     "parallel": {"strategy": "ddp", "pipeline": {"stages": 2}}})
