"""Tiny pretrained-style checkpoints of six causal-LM architectures, made on the spot (nothing downloaded).

    path = make_checkpoint("gpt2", tmp_path / "gpt2")     # a Hugging Face folder: tokenizer + safetensors
    tok = train_tokenizer()                                # the byte-level BPE they all share

Each is a randomly initialised model at hidden 64 with 2 layers, shaped like the real family:
grouped-query attention (2 key/value heads for 4 query heads) where the architecture has it
(llama, qwen2, mistral, phi3), tied input/output embeddings where real checkpoints of the
family tie them (gpt2 by its config's default; qwen2 as Qwen2-0.5B/1.5B do, since
transformers 5's Qwen2Config defaults to untied). GPT-2's projections are transformers'
Conv1D (weights in x out), GPT-NeoX's are named query_key_value/dense_*, Phi-3 fuses
qkv_proj and gate_up_proj: the variety the compression stage must handle by capability.
All share one tokenizer (`train_tokenizer`, the one tests/conftest.py `build_tiny_model`
uses), so token ids and training shards made for one fit all.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import socket
from pathlib import Path
from typing import Any

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
KINDS = ("llama", "qwen2", "mistral", "gpt2", "gpt_neox", "phi3")
HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 2, 4, 2


def train_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE trained on a few hundred standard-library docstrings, as a PreTrainedTokenizerFast."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    texts = []
    for mod in (json, os, socket, ast, inspect):
        texts += [ast.get_docstring(n) or "" for n in ast.walk(ast.parse(inspect.getsource(mod)))
                  if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([t for t in texts if t], vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def _config(kind: str, tok: Any) -> Any:
    import transformers as tf

    ids = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
           "eos_token_id": tok.eos_token_id}
    gqa = {"hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 256}
    if kind == "llama":
        return tf.LlamaConfig(**gqa, **ids, tie_word_embeddings=False)
    if kind == "qwen2":
        return tf.Qwen2Config(**gqa, **ids, tie_word_embeddings=True)
    if kind == "mistral":
        return tf.MistralConfig(**gqa, **ids, sliding_window=None)
    if kind == "phi3":
        return tf.Phi3Config(**gqa, **ids)
    if kind == "gpt2":
        return tf.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=256, **ids)
    if kind == "gpt_neox":
        return tf.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                                num_attention_heads=HEADS, max_position_embeddings=256, **ids)
    raise ValueError(f"unknown checkpoint kind {kind!r}; one of {', '.join(KINDS)}")


def make_checkpoint(kind: str, out_dir: Path, *, seed: int = 0) -> Path:
    """A tokenizer and a random `kind` model saved with save_pretrained (safetensors) in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = train_tokenizer()
    config = _config(kind, tok)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir
