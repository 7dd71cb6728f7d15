import pytest
import torch
from transformers import AutoModelForCausalLM

from lmforge.components.compression.modules import linear_layers, select
from lmforge.components.compression.prune import prune_channels_variant, prune_variant, sparsity
from lmforge.components.compression.variant import load_variant, read_meta
from lmforge.components.config import validate_config
from lmforge.components.errors import UserError
from lmforge.components.sections.compression import ChannelPruneConfig, PruneConfig

from ._util import logits


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_unstructured_pruning_reaches_the_sparsity_and_keeps_it_through_recovery(tiny_model_dir, tmp_path, tuner, scope):
    cfg = PruneConfig(sparsity=0.6, scope=scope, recovery_steps=2)
    out = prune_variant(tiny_model_dir, tmp_path / "p", cfg, tuner=tuner)
    model = AutoModelForCausalLM.from_pretrained(out)  # permanent: a plain load sees the zeros
    targets = select(linear_layers(model), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert sparsity(targets.values()) == pytest.approx(0.6, abs=0.01)
    if scope == "layer":
        assert all(sparsity([m]) == pytest.approx(0.6, abs=0.01) for m in targets.values())
    assert sparsity([model.lm_head]) < 0.01  # not a target
    meta = read_meta(out)
    assert len(meta["recipe"]["recovery_losses"]) == 2
    assert not any("weight_orig" in k for k in model.state_dict())


def test_channel_pruning_shrinks_the_matrices_and_the_config(tiny_model_dir, tmp_path, ids):
    out = prune_channels_variant(tiny_model_dir, tmp_path / "c", ChannelPruneConfig(keep=0.25))
    model = load_variant(out)
    parent = load_variant(tiny_model_dir)
    before = parent.config.intermediate_size
    assert model.config.intermediate_size == before // 4
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.weight.shape == (before // 4, 64) and mlp.down_proj.weight.shape == (64, before // 4)
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in parent.parameters())
    assert logits(model, ids).shape == logits(parent, ids).shape


def test_channel_pruning_keeping_everything_is_the_identity(tiny_model_dir, tmp_path, ids):
    out = prune_channels_variant(tiny_model_dir, tmp_path / "c", ChannelPruneConfig(keep=1.0))
    assert torch.allclose(logits(load_variant(out), ids), logits(load_variant(tiny_model_dir), ids), atol=1e-5)


@pytest.mark.parametrize("sparsity_value", [1.0, -0.1, 1.5])
def test_sparsity_outside_0_1_is_a_config_error(sparsity_value):
    with pytest.raises(UserError, match="compression.prune.sparsity"):
        validate_config({"compression": {"prune": {"sparsity": sparsity_value}}})


def test_sparsity_outside_0_1_is_refused_by_the_technique_too(tiny_model_dir, tmp_path):
    bad = PruneConfig.model_construct(**{**PruneConfig().model_dump(), "sparsity": 1.0})
    with pytest.raises(UserError, match=r"outside \[0, 1\)"):
        prune_variant(tiny_model_dir, tmp_path / "p", bad)
    assert not (tmp_path / "p").exists()


def test_recovery_without_data_is_refused_before_any_work(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="recovery_steps"):
        prune_variant(tiny_model_dir, tmp_path / "p", PruneConfig(recovery_steps=3), tuner=None)
