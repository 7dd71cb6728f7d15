"""A model without Linear layers is refused by every technique before any work."""

import importlib

import pytest
from torch import nn

from lmforge.components.compression.modules import require_linear
from lmforge.components.errors import UserError
from lmforge.components.sections.compression import (
    ChannelPruneConfig,
    DistillConfig,
    LoraConfig,
    LowRankConfig,
    PruneConfig,
    QuantizeConfig,
)


class NoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.conv = nn.Conv1d(8, 8, 3)


TECHNIQUES = [
    ("quantize", "quantize_int8_variant", QuantizeConfig(), {}),
    ("quantize", "cast_variant", "bf16", {}),
    ("prune", "prune_variant", PruneConfig(), {}),
    ("prune", "prune_channels_variant", ChannelPruneConfig(), {}),
    ("lowrank", "lowrank_variant", LowRankConfig(), {}),
    ("distill", "distill_variant", DistillConfig(), {"tuner": None}),
    ("lora", "lora_variant", LoraConfig(), {"tuner": None}),
]


def test_require_linear_names_the_model():
    with pytest.raises(UserError, match="compression model: /m has no Linear layers"):
        require_linear(NoLinear(), "/m")


@pytest.mark.parametrize("module, fn, cfg, kwargs", TECHNIQUES, ids=[t[1] for t in TECHNIQUES])
def test_every_technique_refuses_a_model_without_linear_layers(monkeypatch, tmp_path, module, fn, cfg, kwargs):
    mod = importlib.import_module(f"lmforge.components.compression.{module}")
    # The real loader is exercised by every other test here; this one needs a model HF cannot build.
    monkeypatch.setattr(mod, "load_parent", lambda d: (NoLinear(), d))
    with pytest.raises(UserError, match="has no Linear layers"):
        getattr(mod, fn)(tmp_path / "parent", tmp_path / "out", cfg, **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_folder_without_config_is_refused(tmp_path):
    from lmforge.components.compression.quantize import quantize_int8_variant

    with pytest.raises(UserError, match="has no config.json"):
        quantize_int8_variant(tmp_path, tmp_path / "out", QuantizeConfig())
