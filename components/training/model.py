"""A Hugging Face LlamaForCausalLM built from the [training.model] table and the dataset's tokenizer.

    tok = load_tokenizer(ws.dataset_dir(version) / "tokenizer")
    model = build_model(cfg.training.model, tok, seq_len=cfg.training.seq_len, seed=cfg.training.seed)
    model = build_model(..., zero3_config=ds_config)   # ZeRO-3: built partitioned, under deepspeed.zero.Init
    n = count_params(model)
    flops = train_flops_per_token(cfg.training.model, vocab_size=len(tok), seq_len=128)

Attention is PyTorch SDPA (causal through `is_causal`, no mask tensor). The weights are
seeded, so every strategy starts from the same model for the same seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lmforge.components.errors import UserError
from lmforge.components.sections.training import ModelConfig


def load_tokenizer(path: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    if not (Path(path) / "tokenizer.json").is_file():
        raise UserError("tokenizer", path, "has no tokenizer.json", "Run the data stage first: lmforge run data")
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def llama_config(cfg: ModelConfig, tokenizer: Any, *, seq_len: int, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import LlamaConfig

    s = cfg.sizes()
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"],
        max_position_embeddings=max(seq_len, 256),
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="sdpa",
        use_cache=False,
        dtype=str(dtype).removeprefix("torch."),
    )


def build_model(cfg: ModelConfig, tokenizer: Any, *, seq_len: int, seed: int, zero3_config: dict[str, Any] | None = None) -> Any:
    """A freshly initialised model in fp32 (DeepSpeed casts it for bf16 training).

    With `zero3_config` (the run's DeepSpeed config; the process group must be up) the model is
    built under `deepspeed.zero.Init`: each parameter is partitioned over the ranks as it is
    created, so no rank ever holds the whole model. transformers then initialises the weights
    module by module on rank 0 (gathered, in the same order and from the same seed), so the
    weights equal those of the plain path.
    """
    from transformers import LlamaForCausalLM

    config = llama_config(cfg, tokenizer, seq_len=seq_len)
    torch.manual_seed(seed)
    if zero3_config is None:
        # Built without weight init, then initialised from the seed: the same draws, in the same
        # order, as the ZeRO-3 path below (where construction draws nothing).
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = LlamaForCausalLM(config)
        torch.manual_seed(seed)
        model.initialize_weights()
        model.tie_weights()
        return model.float()
    from transformers.integrations import HfDeepSpeedConfig

    # transformers reads ZeRO-3 from this object while it lives; dropped after, so that the export's
    # save_pretrained and from_pretrained later in this process run as usual.
    hf_ds = HfDeepSpeedConfig(zero3_config)
    model = LlamaForCausalLM._from_config(config, dtype=torch.float32)
    del hf_ds
    return model


def count_params(model: torch.nn.Module) -> int:
    """Parameters of the whole model, also when ZeRO-3 holds only a partition of each (`ds_numel`)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def param_count(cfg: ModelConfig, *, vocab_size: int) -> int:
    """Parameters of the configured model, from its sizes (no model built)."""
    s = cfg.sizes()
    h, layers, inter = s["hidden_size"], s["num_layers"], s["intermediate_size"]
    kv = h // s["num_heads"] * s["num_kv_heads"]
    attn = 2 * h * h + 2 * h * kv
    mlp = 3 * h * inter
    per_layer = attn + mlp + 2 * h
    head = 0 if cfg.tie_embeddings else vocab_size * h
    return vocab_size * h + layers * per_layer + h + head


def train_flops_per_token(cfg: ModelConfig, *, vocab_size: int, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6N for the weights plus the attention scores (PaLM appendix B).

    N counts every weight that takes part in a matmul: the decoder layers and the output head,
    not the embedding (a lookup). The head is counted also when it shares its weight with the
    embedding: sharing saves memory, not the 2·hidden·vocab multiply-adds per token of the
    logits, forward and twice in backward (6·hidden·vocab in all). The attention term is
    12·layers·hidden·seq_len: QKᵀ and AV over the full seq_len × seq_len matrix, forward plus
    twice that in backward, with no saving for the causal half.
    """
    s = cfg.sizes()
    h = s["hidden_size"]
    n = param_count(cfg, vocab_size=vocab_size) - vocab_size * h  # the embedding lookup is no matmul
    if cfg.tie_embeddings:
        n += vocab_size * h  # param_count counts a shared weight once; the head's matmul runs anyway
    return 6.0 * n + 12.0 * s["num_layers"] * h * seq_len
