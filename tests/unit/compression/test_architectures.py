"""Every technique on six architectures (tests/checkpoints.py), each variant loaded back with lmforge's own loader.

Llama, Qwen2 (tied head), Mistral, GPT-2 (Conv1D projections, tied head), GPT-NeoX and Phi-3
(fused qkv_proj / gate_up_proj). `targets = []` picks every projection inside the decoder blocks.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmforge.components.compression.distill import distill_variant
from lmforge.components.compression.lora import lora_variant
from lmforge.components.compression.lowrank import lowrank_variant
from lmforge.components.compression.modules import LowRankLinear, count_params, is_int8_linear
from lmforge.components.compression.prune import prune_channels_variant, prune_variant, sparsity
from lmforge.components.compression.quantize import quantize_int8_variant
from lmforge.components.compression.variant import load_variant, read_meta
from lmforge.components.errors import UserError
from lmforge.components.model.projections import TIED, decoder_blocks, linearize, projections
from lmforge.components.sections.compression import (
    ChannelPruneConfig,
    DistillConfig,
    LoraConfig,
    LowRankConfig,
    PruneConfig,
    QuantizeConfig,
)
from tests.checkpoints import KINDS

from ._util import logits

TIED_KINDS = {"qwen2", "gpt2"}
GQA_KINDS = {"llama", "qwen2", "mistral", "phi3"}
VOCAB = 512


def _head(model):
    return model.get_output_embeddings().weight


def _is_tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def _check_forward(model, ids):
    out = logits(model, ids)
    assert out.shape == (*ids.shape, VOCAB)
    assert torch.isfinite(out).all()
    return out


def _check_head(variant, parent, kind, recipe=None):
    """The head is the parent's, and still the embedding where the parent tied them (never compressed alone)."""
    assert torch.equal(_head(variant).float(), _head(parent).float())
    assert _is_tied(variant) == (kind in TIED_KINDS)
    if recipe is not None and kind in TIED_KINDS:
        assert TIED in recipe["skipped"].values()


def _block_names(model) -> set[str]:
    return {n for n, p in projections(model).items() if p.block is not None}


@pytest.mark.parametrize("kind", KINDS)
def test_each_checkpoint_loads_back_with_auto_classes(checkpoint, kind):
    folder = checkpoint(kind)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok("Return the value of a key.")["input_ids"]])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok)) and len(tok) == VOCAB
    assert model.config.model_type == kind and model.config.hidden_size == 64
    assert len(decoder_blocks(model)[1]) == 2
    assert _is_tied(model) == (kind in TIED_KINDS)
    if kind in GQA_KINDS:
        assert model.config.num_key_value_heads < model.config.num_attention_heads
    view = projections(model)
    assert any(p.transposed for p in view.values()) == (kind == "gpt2")  # only GPT-2 holds Conv1D
    assert [n for n, p in view.items() if p.tied] == (["lm_head"] if kind in TIED_KINDS else [])


@pytest.mark.parametrize("kind", KINDS)
def test_int8(checkpoint, kind, tmp_path, ids):
    parent_dir = checkpoint(kind)
    out = quantize_int8_variant(parent_dir, tmp_path / "int8", QuantizeConfig())
    model, parent = load_variant(out), load_variant(parent_dir)
    got, want = _check_forward(model, ids), logits(parent, ids)
    assert (got - want).abs().max() < 0.1 * want.abs().max()  # quantization moves the logits a little
    quantizable = [n for n, p in projections(parent).items() if not p.tied]
    assert sorted(n for n, m in model.named_modules() if is_int8_linear(m)) == sorted(quantizable)
    recipe = read_meta(out)["recipe"]
    assert recipe["quantized_layers"] == len(quantizable)
    if kind in TIED_KINDS:
        _check_head(model, parent, kind, recipe)  # in float, still the embedding
    else:
        assert is_int8_linear(model.get_output_embeddings())  # an untied head is a projection like the others
    if kind == "gpt2":
        assert recipe["conv1d_to_linear"]["layers"] == 8 and recipe["conv1d_to_linear"]["max_abs_logit_diff"] <= 1e-5


def test_gpt2_conv1d_becomes_a_linear_with_equal_logits(checkpoint, ids):
    parent = load_variant(checkpoint("gpt2"))
    linear = copy.deepcopy(parent)
    converted = linearize(linear, skip={"lm_head"})
    assert len(converted) == 8 and not any(p.transposed for p in projections(linear).values())
    torch.testing.assert_close(logits(linear, ids), logits(parent, ids), atol=1e-5, rtol=0)
    assert _is_tied(linear)


@pytest.mark.parametrize("kind", KINDS)
def test_prune(checkpoint, kind, tmp_path, ids):
    parent_dir = checkpoint(kind)
    out = prune_variant(parent_dir, tmp_path / "prune", PruneConfig(sparsity=0.5, targets=[]))
    model, parent = load_variant(out), load_variant(parent_dir)
    _check_forward(model, ids)
    view = projections(model)
    blocks = [view[n].module for n in _block_names(model)]
    assert sparsity(blocks) == pytest.approx(0.5, abs=0.01)

    def nonzero(m):
        return sum(int((p != 0).sum()) for p in m.parameters())
    assert nonzero(model) < nonzero(parent)
    recipe = read_meta(out)["recipe"]
    assert recipe["pruned_layers"] == len(blocks) == 2 * (4 if kind in ("gpt2", "gpt_neox", "phi3") else 7)
    _check_head(model, parent, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_lowrank(checkpoint, kind, tmp_path, ids):
    parent_dir = checkpoint(kind)
    out = lowrank_variant(parent_dir, tmp_path / "lowrank", LowRankConfig(mode="rank", rank=8, targets=[]))
    model, parent = load_variant(out), load_variant(parent_dir)
    _check_forward(model, ids)
    factorised = {n for n, m in model.named_modules() if isinstance(m, LowRankLinear)}
    assert factorised == _block_names(parent)
    assert count_params(model) < count_params(parent)
    _check_head(model, parent, kind)


def test_lowrank_of_a_conv1d_at_full_rank_is_the_layer(checkpoint, tmp_path, ids):
    parent_dir = checkpoint("gpt2")
    # rank 64 saves nothing on 64 x 64 (c_attn.c_proj) but does on 64 x 192 / 64 x 256: those become exact factors.
    out = lowrank_variant(parent_dir, tmp_path / "lowrank", LowRankConfig(mode="rank", rank=64, targets=["c_attn"]))
    torch.testing.assert_close(logits(load_variant(out), ids), logits(load_variant(parent_dir), ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_lora(checkpoint, kind, tmp_path, tuner, ids):
    parent_dir = checkpoint(kind)
    out = lora_variant(parent_dir, tmp_path / "lora", LoraConfig(r=4, steps=2, targets=[]), tuner=tuner)
    model, parent = load_variant(out), load_variant(parent_dir)
    _check_forward(model, ids)
    assert count_params(model) == count_params(parent)  # merged: the parent's architecture exactly
    assert type(projections(model)[next(iter(_block_names(model)))].module) is type(
        projections(parent)[next(iter(_block_names(parent)))].module)  # a Conv1D stays a Conv1D
    moved = [n for n in _block_names(parent)
             if not torch.equal(projections(model)[n].weight, projections(parent)[n].weight)]
    assert len(moved) == len(_block_names(parent))  # every block projection got an adapter, and it trained
    view = projections(parent)
    recipe = read_meta(out)["recipe"]
    assert recipe["adapter_params"] == sum(4 * (view[n].in_features + view[n].out_features) for n in _block_names(parent))
    _check_head(model, parent, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_distill(checkpoint, kind, tmp_path, tuner, ids):
    parent_dir = checkpoint(kind)
    out = distill_variant(parent_dir, tmp_path / "distill", DistillConfig(num_layers=1, steps=2), tuner=tuner)
    model, parent = load_variant(out), load_variant(parent_dir)
    _check_forward(model, ids)
    assert len(decoder_blocks(model)[1]) == 1 and count_params(model) < count_params(parent)
    assert read_meta(out)["recipe"]["init"] == "teacher layers [1]"
    assert _is_tied(model) == (kind in TIED_KINDS)  # the student keeps the teacher's tie


@pytest.mark.parametrize("kind", KINDS)
def test_channel_pruning_needs_a_gated_mlp(checkpoint, kind, tmp_path, ids):
    parent_dir = checkpoint(kind)
    if kind in ("gpt2", "gpt_neox", "phi3"):  # plain or fused MLPs: refused up front, naming the fix
        with pytest.raises(UserError, match="has no gated MLP"):
            prune_channels_variant(parent_dir, tmp_path / "c", ChannelPruneConfig(keep=0.5))
        return
    out = prune_channels_variant(parent_dir, tmp_path / "c", ChannelPruneConfig(keep=0.5))
    model, parent = load_variant(out), load_variant(parent_dir)
    _check_forward(model, ids)
    assert count_params(model) < count_params(parent)
    _check_head(model, parent, kind)


LLAMA_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_llama_names_on_gpt2_are_refused_naming_the_models_own_projections(checkpoint, tmp_path):
    with pytest.raises(UserError, match=r"match no Linear layer.*c_attn.*or set it to \[\]"):
        prune_variant(checkpoint("gpt2"), tmp_path / "p", PruneConfig(targets=LLAMA_NAMES))


def test_the_default_targets_every_projection_of_any_architecture(checkpoint, tmp_path):
    for kind in ("gpt2", "phi3"):   # Conv1D; fused qkv_proj / gate_up_proj: the Llama names would miss them
        out = prune_variant(checkpoint(kind), tmp_path / kind, PruneConfig())
        assert read_meta(out)["recipe"]["skipped"] == {}, kind


def test_a_partial_name_match_records_what_it_left_out(checkpoint, tmp_path):
    out = prune_variant(checkpoint("phi3"), tmp_path / "p", PruneConfig(targets=LLAMA_NAMES))  # o_proj, down_proj match
    skipped = read_meta(out)["recipe"]["skipped"]
    assert sorted({n.rsplit(".", 1)[-1] for n in skipped}) == ["gate_up_proj", "qkv_proj"]
    assert set(skipped.values()) == {"not named in compression.prune.targets"}


def test_a_named_tied_head_is_skipped_with_the_reason(checkpoint, tmp_path, ids):
    out = prune_variant(checkpoint("qwen2"), tmp_path / "p", PruneConfig(targets=["lm_head", "q_proj"]))
    assert read_meta(out)["recipe"]["skipped"]["lm_head"] == TIED
    _check_head(load_variant(out), load_variant(checkpoint("qwen2")), "qwen2")
