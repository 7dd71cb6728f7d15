import copy

import pytest
import torch

from lmforge.components.compression.lora import check_lora, lora_variant
from lmforge.components.compression.variant import load_variant, read_meta
from lmforge.components.errors import UserError
from lmforge.components.model.adapters import add_adapters
from lmforge.components.sections.compression import LoraConfig

from ._util import logits


def test_merged_lora_equals_the_adapter_model(tiny_model_dir, tmp_path, tuner, ids):
    cfg = LoraConfig(r=4, steps=4, data_fraction=0.5)
    parent = load_variant(tiny_model_dir)
    model = copy.deepcopy(parent)
    peft_model = add_adapters(model, check_lora(model, cfg, tiny_model_dir), r=cfg.r, alpha=cfg.alpha, dropout=cfg.dropout)
    tuner.run(peft_model, steps=cfg.steps, data_fraction=cfg.data_fraction)
    with_adapters = logits(peft_model, ids)
    assert not torch.allclose(with_adapters, logits(parent, ids), atol=1e-4)  # the adapters learned something

    out = lora_variant(tiny_model_dir, tmp_path / "lora", cfg, tuner=tuner)
    merged = load_variant(out)
    # Same seed, same data order: lora_variant trained the same adapters, then merged them into W.
    assert torch.allclose(logits(merged, ids), with_adapters, atol=1e-4)
    assert sum(p.numel() for p in merged.parameters()) == sum(p.numel() for p in parent.parameters())
    assert not any("lora" in k for k in merged.state_dict())
    assert read_meta(out)["recipe"]["adapter_params"] == 2 * 2 * 4 * (64 + 64)


def test_lora_rank_larger_than_a_layer_is_refused(tiny_model_dir, tmp_path, tuner):
    with pytest.raises(UserError, match="compression.lora.r: 65 is larger than layer"):
        lora_variant(tiny_model_dir, tmp_path / "lora", LoraConfig(r=65), tuner=tuner)
