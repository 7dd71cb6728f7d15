import pytest
import torch
from transformers import AutoModelForCausalLM

from lmforge.components.compression.modules import is_int8_linear, linear_weight_bytes, quantize_int8
from lmforge.components.compression.quantize import cast_variant, quantize_int8_variant
from lmforge.components.compression.variant import load_variant, read_meta, variant_stats
from lmforge.components.sections.compression import QuantizeConfig

from ._util import logits


def test_int8_reload_equals_the_requantized_parent(tiny_model_dir, tmp_path, ids):
    out = quantize_int8_variant(tiny_model_dir, tmp_path / "int8", QuantizeConfig())
    reloaded = load_variant(out)
    fresh = quantize_int8(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval())
    assert sum(map(is_int8_linear, reloaded.modules())) == 2 * 7 + 1  # every Linear, lm_head included
    assert torch.equal(logits(reloaded, ids), logits(fresh, ids))
    parent = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    # Quantization changes the outputs a little, not a lot.
    diff = (logits(reloaded, ids) - logits(parent, ids)).abs().max()
    assert 0 < diff < 0.1 * logits(parent, ids).abs().max()
    assert linear_weight_bytes(parent) >= 3.5 * linear_weight_bytes(reloaded)
    meta = read_meta(out)
    assert meta["load"]["kind"] == "int8" and meta["parent"]["path"] == str(tiny_model_dir)
    assert not list(out.glob("*.bin")) and not list(out.glob("*.pt"))


def test_int8_is_stored_as_int8_and_a_plain_from_pretrained_refuses_it(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    out = quantize_int8_variant(tiny_model_dir, tmp_path / "int8", QuantizeConfig())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "I8" and dtypes["lm_head.weight"] == "I8"
    assert dtypes["model.layers.0.self_attn.q_proj.weight_scale"] == "F32"
    assert dtypes["model.embed_tokens.weight"] == "F32"  # embeddings are not Linear: kept in float
    parent_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert (out / "model.safetensors").stat().st_size < 0.5 * parent_bytes
    with pytest.raises(Exception, match="lmforge_int8"):
        AutoModelForCausalLM.from_pretrained(out)


def test_int8_skip_keeps_named_layers_in_float(tiny_model_dir, tmp_path):
    out = quantize_int8_variant(tiny_model_dir, tmp_path / "int8", QuantizeConfig(skip=["lm_head"]))
    model = load_variant(out)
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert is_int8_linear(model.model.layers[0].mlp.up_proj)


def test_bf16_cast_is_stored_and_loaded_in_bf16(tiny_model_dir, tmp_path, ids):
    out = cast_variant(tiny_model_dir, tmp_path / "bf16", "bf16")
    model = load_variant(out)
    assert next(model.parameters()).dtype == torch.bfloat16
    parent = load_variant(tiny_model_dir)
    assert torch.allclose(logits(model, ids), logits(parent, ids), atol=0.1)
    assert variant_stats(out, model)["disk_bytes"] < 0.6 * variant_stats(tiny_model_dir, parent)["disk_bytes"]


def test_int8_of_a_bf16_parent_keeps_its_float_tensors_in_bf16_exactly(tiny_model_dir, tmp_path, ids):
    from safetensors import safe_open

    bf16 = cast_variant(tiny_model_dir, tmp_path / "bf16", "bf16")
    out = quantize_int8_variant(bf16, tmp_path / "int8", QuantizeConfig())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
        assert f.get_slice("lm_head.weight").get_dtype() == "I8"
    reloaded = load_variant(out)
    assert reloaded.model.embed_tokens.weight.dtype == torch.float32
    fresh = quantize_int8(load_variant(bf16, dtype=torch.float32))
    assert torch.equal(logits(reloaded, ids), logits(fresh, ids))
