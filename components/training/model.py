"""The model a run trains: a Hugging Face LlamaForCausalLM from the [training.model] preset, or a base folder.

With `[training.model.moe] num_experts` > 0 the preset is a Qwen3MoeForCausalLM instead (its
sparse layers' experts stored as fused 3D tensors); the ranks swap those blocks for DeepSpeed's
MoE layer (components/training/moe.py) and the export is Qwen3-MoE again.

    tok = load_tokenizer(ws.dataset_dir(version) / "tokenizer")
    model = build_model(cfg.training.model, tok, seq_len=cfg.training.seq_len, seed=cfg.training.seed)
    model = build_model(..., zero3_config=ds_config)   # ZeRO-3: built partitioned, under deepspeed.zero.Init
    config = model_config(cfg.training.model, tok, seq_len=128)   # what the export is saved as
    n = count_params(model)
    flops = flops_per_token(cfg.training.model, config, seq_len=128)

From a preset, attention is PyTorch SDPA (causal through `is_causal`, no mask tensor) and the
weights are seeded, so every strategy starts from the same model for the same seed. With
`init` set, the base's weights are loaded (safetensors only) into the class transformers
implements for its config.json, whatever the architecture.
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


def _decoder_fields(cfg: ModelConfig, tokenizer: Any, *, seq_len: int, dtype: torch.dtype) -> dict[str, Any]:
    """The preset's decoder shape and token ids: the fields a LlamaConfig and a Qwen3MoeConfig share."""
    s = cfg.sizes()
    return dict(
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


def llama_config(cfg: ModelConfig, tokenizer: Any, *, seq_len: int, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_decoder_fields(cfg, tokenizer, seq_len=seq_len, dtype=dtype))


def moe_config(cfg: ModelConfig, tokenizer: Any, *, seq_len: int, dtype: torch.dtype = torch.float32) -> Any:
    """The preset's shape as a Qwen3MoeConfig: every `moe.every`-th layer sparse, no layer forced dense.

    norm_topk_prob is on for top_k > 1 only, as DeepSpeed's gates do it: top-1 weights a token by
    its expert's softmax probability, top-2 and top-k renormalise the chosen probabilities to 1.
    """
    from transformers import Qwen3MoeConfig

    fields, moe = _decoder_fields(cfg, tokenizer, seq_len=seq_len, dtype=dtype), cfg.moe
    return Qwen3MoeConfig(
        **fields,
        head_dim=fields["hidden_size"] // fields["num_attention_heads"],
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.expert_size or fields["intermediate_size"],
        decoder_sparse_step=moe.every,
        mlp_only_layers=[],
        norm_topk_prob=moe.top_k > 1,
        router_aux_loss_coef=moe.aux_loss_coef,
    )


def preset_config(cfg: ModelConfig, tokenizer: Any, *, seq_len: int, dtype: torch.dtype = torch.float32) -> Any:
    """The preset's transformers config: a LlamaConfig, or a Qwen3MoeConfig when it has experts."""
    make = moe_config if cfg.moe.num_experts else llama_config
    return make(cfg, tokenizer, seq_len=seq_len, dtype=dtype)


def model_config(cfg: ModelConfig, tokenizer: Any, *, seq_len: int, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers config of the trained model: the base's config.json (with init), else the preset's config."""
    if cfg.init is None:
        return preset_config(cfg, tokenizer, seq_len=seq_len, dtype=dtype)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.init, trust_remote_code=False)
    config.use_cache = False
    config.dtype = dtype
    return config


def load_base(folder: str, *, seed: int, zero3_config: dict[str, Any] | None = None) -> Any:
    """The base's weights in fp32, from safetensors only; under ZeRO-3 loaded partitioned (HfDeepSpeedConfig).

    The folder was checked before launch (components/model/basemodel.py check_base). The seed still
    matters: it drives dropout, which some bases (GPT-2) train with.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_ds = None
    if zero3_config is not None:
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds = HfDeepSpeedConfig(zero3_config)  # transformers loads under deepspeed.zero.Init while this lives
    model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True, trust_remote_code=False, dtype=torch.float32)
    del hf_ds
    model.config.use_cache = False
    return model


def build_model(cfg: ModelConfig, tokenizer: Any, *, seq_len: int, seed: int, zero3_config: dict[str, Any] | None = None) -> Any:
    """A freshly initialised model in fp32 (DeepSpeed casts it for bf16 training), or the base with `init` set.

    With `zero3_config` (the run's DeepSpeed config; the process group must be up) the model is
    built under `deepspeed.zero.Init`: each parameter is partitioned over the ranks as it is
    created, so no rank ever holds the whole model. transformers then initialises the weights
    module by module on rank 0 (gathered, in the same order and from the same seed), so the
    weights equal those of the plain path.
    """
    if cfg.init is not None:
        return load_base(cfg.init, seed=seed, zero3_config=zero3_config)
    from lmforge.components.model.basemodel import causal_lm_class

    config = preset_config(cfg, tokenizer, seq_len=seq_len)
    model_class = causal_lm_class(config)  # LlamaForCausalLM, or Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    if zero3_config is None:
        # Built without weight init, then initialised from the seed: the same draws, in the same
        # order, as the ZeRO-3 path below (where construction draws nothing).
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = model_class(config)
        torch.manual_seed(seed)
        model.initialize_weights()
        model.tie_weights()
        return model.float()
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    # transformers reads ZeRO-3 from this object while it lives; dropped after, so that the export's
    # save_pretrained and from_pretrained later in this process run as usual.
    hf_ds = HfDeepSpeedConfig(zero3_config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # under deepspeed.zero.Init, as hf_ds says
    del hf_ds
    return model


def count_params(model: torch.nn.Module) -> int:
    """Parameters of the whole model, also when ZeRO-3 holds only a partition of each (`ds_numel`)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def param_count(cfg: ModelConfig, *, vocab_size: int, active: bool = False) -> int:
    """Parameters of the configured model, from its sizes (no model built).

    With experts, a sparse layer holds a router (experts x hidden) and num_experts SwiGLU MLPs of
    expert_size, and its attention normalises q and k per head (Qwen3-MoE's q_norm, k_norm).
    `active`: the parameters one token uses, which counts top_k experts per sparse layer, not all.
    """
    s, moe = cfg.sizes(), cfg.moe
    h, layers, inter = s["hidden_size"], s["num_layers"], s["intermediate_size"]
    kv = h // s["num_heads"] * s["num_kv_heads"]
    attn = 2 * h * h + 2 * h * kv
    mlp = 3 * h * inter
    per_layer = attn + mlp + 2 * h
    head = 0 if cfg.tie_embeddings else vocab_size * h
    dense = vocab_size * h + layers * per_layer + h + head
    if not moe.num_experts:
        return dense
    experts = moe.top_k if active else moe.num_experts
    norms = 2 * (h // s["num_heads"]) * layers
    sparse = layers // moe.every  # layer i is sparse when (i + 1) % every == 0
    per_expert = expert_param_count(cfg) // (sparse * moe.num_experts)
    return dense + norms + sparse * (moe.num_experts * h + experts * per_expert - mlp)


def expert_param_count(cfg: ModelConfig) -> int:
    """Parameters of every expert of every sparse layer (the part expert parallelism divides); 0 for a dense model."""
    s, moe = cfg.sizes(), cfg.moe
    if not moe.num_experts:
        return 0
    sparse = s["num_layers"] // moe.every
    return sparse * moe.num_experts * 3 * s["hidden_size"] * (moe.expert_size or s["intermediate_size"])


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
    # The embedding lookup is no matmul; a MoE layer multiplies each token by its top_k experts only.
    n = param_count(cfg, vocab_size=vocab_size, active=True) - vocab_size * h
    if cfg.tie_embeddings:
        n += vocab_size * h  # param_count counts a shared weight once; the head's matmul runs anyway
    return 6.0 * n + 12.0 * s["num_layers"] * h * seq_len


def meta_model(config: Any) -> Any:
    """The causal LM transformers builds for `config`, on the meta device: its modules and shapes, no memory, no weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def hf_train_flops_per_token(config: Any, *, seq_len: int) -> float:
    """Forward + backward FLOPs per token of any transformers causal LM, from its config: 6N plus attention.

    N is the weights of every matmul, found by capability on a model built on the meta device
    (no memory, no weights): each nn.Linear and GPT-2-style Conv1D, the output head included
    (counted also when tied to the embedding, as in train_flops_per_token). Embedding lookups,
    norms and biases are not matmuls. A mixture-of-experts layer adds the experts a token runs
    through (active_expert_weights). The attention term is 12·layers·(heads·head_dim)·seq_len:
    QKᵀ and AV over the full seq_len × seq_len matrix, as SDPA computes them. Not discounted: a
    sliding window shorter than seq_len, so for such a model the MFU reads high.
    """
    from lmforge.components.serving.modelload import projection_dims  # the one test of "a linear-like layer"

    model = meta_model(config)
    n = sum(m.weight.numel() for m in model.modules() if projection_dims(m) is not None)
    n += active_expert_weights(model, config)
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 6.0 * n + 12.0 * text.num_hidden_layers * heads * head_dim * seq_len


def active_expert_weights(model: torch.nn.Module, config: Any) -> int:
    """Matmul weights of transformers' fused MoE layers that one token uses: top_k of the E experts held as 3D
    parameters [E, out, in] of an `experts` module (Qwen3-MoE, Mixtral in transformers 5; no nn.Linear, so the
    projections walk misses them), plus each router's [E, hidden] weight. 0 for a dense model."""
    from lmforge.components.serving.modelload import projection_dims

    top_k = getattr(config.get_text_config(), "num_experts_per_tok", None)
    if not top_k:
        return 0
    n = 0
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        own = list(module.parameters(recurse=False))
        if leaf == "experts":
            n += sum(p.numel() // p.shape[0] * top_k for p in own if p.ndim == 3)
        elif leaf == "gate" and projection_dims(module) is None:
            n += sum(p.numel() for p in own if p.ndim == 2)
    return n


def flops_per_token(cfg: ModelConfig, config: Any, *, seq_len: int) -> float:
    """The run's FLOPs per token: the preset's closed form, or the generic count for a base's config."""
    if cfg.init is None:
        return train_flops_per_token(cfg, vocab_size=config.vocab_size, seq_len=seq_len)
    return hf_train_flops_per_token(config, seq_len=seq_len)
