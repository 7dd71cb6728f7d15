"""Which bases a pipeline or AutoTP layout can split, decided before launch by what the model is made of."""

from __future__ import annotations

import pytest

from lmforge.components.errors import UserError
from lmforge.components.training.layout import check_layout
from tests.integration.train_support import tiny_training

TP2 = {"strategy": "zero1", "tensor": {"autotp_size": 2}}
PP2 = {"strategy": "ddp", "pipeline": {"stages": 2}}


def _check(base, parallel):
    return check_layout(tiny_training(model={"init": str(base)}, parallel=parallel), vocab_size=512, world_size=2)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt_neox"])
def test_autotp_accepts_a_base_of_linear_projections_with_a_plan_deepspeed_supports(kind, checkpoint):
    assert _check(checkpoint(kind), TP2).tp == 2


@pytest.mark.parametrize("kind", ["llama", "mistral", "phi3"])
def test_the_pipeline_accepts_an_untied_llama_style_decoder(kind, checkpoint):
    assert _check(checkpoint(kind), PP2).pp == 2


@pytest.mark.parametrize("kind, parallel, why", [
    ("gpt2", TP2, "c_attn, c_fc, c_proj are GPT-2-style Conv1D"),
    ("phi3", TP2, "unsupported partition style"),
    ("qwen2", TP2, "tied to its input embedding"),
    ("gpt2", PP2, "not a Llama-style decoder"),
    ("gpt_neox", PP2, "not a Llama-style decoder"),
    ("qwen2", PP2, "tied to the input embedding"),
])
def test_a_layout_an_architecture_cannot_take_is_refused_with_the_reason_and_the_fix(kind, parallel, why, checkpoint):
    with pytest.raises(UserError, match=why) as e:
        _check(checkpoint(kind), parallel)
    assert "Set " in str(e.value)


def test_more_stages_than_the_bases_layers_is_refused(checkpoint):
    with pytest.raises(UserError, match=r"more pipeline stages than the base's LlamaForCausalLM's decoder layers \(2\)"):
        check_layout(tiny_training(model={"init": str(checkpoint("llama"))}, parallel={"strategy": "ddp",
                     "pipeline": {"stages": 4}}), vocab_size=512, world_size=4)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_pipeline_stages_with_tensor_parallelism_accept_a_llama_style_base(kind, checkpoint):
    layout = check_layout(tiny_training(model={"init": str(checkpoint(kind))}, parallel={**PP2, "tensor": {"autotp_size": 2}}),
                          vocab_size=512, world_size=8)
    assert (layout.dp, layout.pp, layout.tp) == (2, 2, 2)


@pytest.mark.parametrize("kind, why", [("phi3", "unsupported partition style"), ("qwen2", "tied to its input embedding"),
                                       ("gpt_neox", "not a Llama-style decoder")])
def test_pipeline_stages_with_tensor_parallelism_refuse_what_either_refuses(kind, why, checkpoint):
    with pytest.raises(UserError, match=why):
        check_layout(tiny_training(model={"init": str(checkpoint(kind))}, parallel={**PP2, "tensor": {"autotp_size": 2}}),
                     vocab_size=512, world_size=8)
