"""What the compression stage does with a technique an architecture has no parts for, decided by structure."""

import pytest

from lmforge.components.compression.build import inapplicable
from lmforge.components.compression.lora import check_lora
from lmforge.components.compression.variant import load_parent
from lmforge.components.errors import UserError
from lmforge.components.model.adapters import target_suffixes
from lmforge.components.model.projections import projections
from lmforge.components.sections.compression import LoraConfig


@pytest.mark.parametrize("kind, gated", [("llama", True), ("gpt2", False), ("phi3", False)])
def test_channel_pruning_is_left_out_with_its_reason_where_there_is_no_gated_mlp(checkpoint, kind, gated):
    model, _ = load_parent(checkpoint(kind))
    skipped = inapplicable(model, ["int8", "channels", "lora"])
    assert set(skipped) == (set() if gated else {"channels"})
    if not gated:
        assert "gated MLPs" in skipped["channels"] and kind in skipped["channels"]


def test_lora_default_names_mean_every_block_projection_only_on_a_model_without_them(checkpoint):
    gpt2, _ = load_parent(checkpoint("gpt2"))
    llama, _ = load_parent(checkpoint("llama"))
    assert target_suffixes(llama, LoraConfig().targets) == ["q_proj", "v_proj"]          # unchanged where they exist
    assert target_suffixes(gpt2, LoraConfig().targets) == []
    chosen = check_lora(gpt2, LoraConfig(), "gpt2")
    assert set(chosen.targets) == {n for n, p in projections(gpt2).items() if p.block is not None and not p.tied}
    with pytest.raises(UserError, match="match no Linear layer"):                   # names a user gave stay an error
        check_lora(gpt2, LoraConfig(targets=["q_proj"]), "gpt2")
