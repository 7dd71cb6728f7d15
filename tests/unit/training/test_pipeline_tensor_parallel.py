"""The tensor-parallel split inside pipeline stages, in one process: the shards a rank keeps compute what the
whole block does, and the export's gather puts the Hugging Face state dict back together exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lmforge.components.training.pipeline_model import (
    COLUMN_PARALLEL,
    ROW_PARALLEL,
    merge_hf_shards,
    split_dim,
    split_hf_state,
    tp_unshardable,
)


def gqa_llama(tp: int) -> LlamaForCausalLM:
    """Grouped-query attention (8 heads over 4 key/value heads), so a shard must keep each query head with its kv head."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, attention_bias=True, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    assert config.num_key_value_heads % tp == 0
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tp", [2, 4])
def test_split_then_merge_gives_back_the_hf_state_dict(tp):
    state = gqa_llama(tp).state_dict()
    shards = [split_hf_state(state, tp=tp, rank=r) for r in range(tp)]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert shards[1][q].shape == (64 // tp, 64) and shards[1]["model.layers.1.mlp.down_proj.weight"].shape == (64, 96 // tp)
    assert shards[1]["lm_head.weight"].shape == (97, 64)  # the head, embedding and norms stay whole
    merged = merge_hf_shards(shards)
    assert merged.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(merged[k], v), k


def test_split_dims_follow_megatrons_layout():
    assert [split_dim(f"model.layers.3.self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj", "o_proj")] == [0, 0, 0, 1]
    assert [split_dim(f"model.layers.3.mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")] == [0, 0, 1]
    assert split_dim("model.layers.0.self_attn.q_proj.bias") == 0      # a column shard's bias is sharded with it
    assert split_dim("model.layers.0.self_attn.o_proj.bias") is None   # a row shard's bias is added after the all-reduce
    assert split_dim("model.layers.0.input_layernorm.weight") is None and split_dim("lm_head.weight") is None


def _sharded_copy(module: torch.nn.Module, prefix: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of `module` holding one rank's shards as plain nn.Linear layers (no all-reduce: the caller sums)."""
    import copy

    local = copy.deepcopy(module)
    for name, _ in list(local.named_children()):
        if name in COLUMN_PARALLEL + ROW_PARALLEL:
            w = state[f"{prefix}.{name}.weight"]
            b = state.get(f"{prefix}.{name}.bias")
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
            lin.weight.data.copy_(w)
            if b is not None:
                # The row-parallel bias is added once, after the sum: only rank 0's copy keeps it here.
                lin.bias.data.copy_(b if name in COLUMN_PARALLEL or prefix.endswith("#0") else torch.zeros_like(b))
            setattr(local, name, lin)
    return local


@pytest.mark.parametrize("tp", [2, 4])
def test_the_sum_of_the_ranks_row_parallel_outputs_is_the_whole_blocks_output(tp):
    """What the all-reduce in o_proj and down_proj adds up: attention with heads/tp query and kv_heads/tp key/value
    heads per rank (HF reshapes with -1 heads), and the MLP on intermediate/tp columns."""
    model = gqa_llama(tp)
    layer = model.model.layers[1]
    state = model.state_dict()
    x = torch.randn(2, 7, 64)
    positions = torch.arange(7).unsqueeze(0).expand(2, -1)
    cos_sin = model.model.rotary_emb(x, positions)
    with torch.no_grad():
        whole_attn = layer.self_attn(x, position_embeddings=cos_sin, attention_mask=None)[0]
        whole_mlp = layer.mlp(x)
        attn, mlp = torch.zeros_like(whole_attn), torch.zeros_like(whole_mlp)
        for r in range(tp):
            shard = {k.replace("model.layers.1.", f"#{r}."): v for k, v in split_hf_state(state, tp=tp, rank=r).items()}
            attn += _sharded_copy(layer.self_attn, f"#{r}.self_attn", shard)(x, position_embeddings=cos_sin,
                                                                               attention_mask=None)[0]
            mlp += _sharded_copy(layer.mlp, f"#{r}.mlp", shard)(x)
    torch.testing.assert_close(attn, whole_attn, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mlp, whole_mlp, atol=1e-5, rtol=1e-5)


def test_a_decoder_layer_with_fused_projections_is_not_shardable(checkpoint):
    from transformers import AutoModelForCausalLM

    assert tp_unshardable(gqa_llama(2).model.layers[0]) is None
    phi3 = AutoModelForCausalLM.from_pretrained(checkpoint("phi3"))
    why = tp_unshardable(phi3.model.layers[0])
    assert why is not None and "mlp.gate_up_proj" in why and "self_attn.qkv_proj" in why
