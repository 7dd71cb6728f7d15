"""The serving benchmark's models: random-weight Llamas built here, nothing downloaded.

    folder = build("demo", tmp / "demo")    # the demo's shape, as bench_serve always built it: hidden 256, 4 layers (~3M)
    folder = build("100m", tmp / "100m")    # hidden 768, 12 layers, 12 heads, MLP 2048 (~88M)
    kv_cache_bytes(folder, 16384)           # what lmforge's KV budget of 16,384 tokens takes at fp32 (for vLLM)

Each is a Hugging Face folder (safetensors, config, the byte-level BPE tokenizer trained on standard-library
docstrings by tests/checkpoints.py, and lmforge.json), the layout every serving path here loads: Triton's model,
the in-process engine and vLLM's server.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# The tokenizer's corpus gives at most ~2,300 tokens, so "100m" asks for more and gets what the corpus holds (88M
# parameters in all, 85M of them in the 12 layers).
SHAPES: dict[str, dict[str, int]] = {
    "100m": {"vocab": 8192, "hidden": 768, "layers": 12, "heads": 12, "mlp": 2048, "context": 1024},
}
MODELS = ("demo", *SHAPES)


def build(name: str, out: Path, *, seed: int = 0) -> Path:
    """A random LlamaForCausalLM of shape SHAPES[name] (demo: tests/conftest.py's tiny model, vocab 2048, hidden 256,
    4 layers) with its tokenizer, saved to `out` by tests/conftest.py's build_tiny_model."""
    from tests.conftest import build_tiny_model

    if name == "demo":
        return build_tiny_model(out, vocab_size=2048, hidden=256, layers=4, seed=seed)
    s = SHAPES[name]
    return build_tiny_model(out, vocab_size=s["vocab"], hidden=s["hidden"], layers=s["layers"], heads=s["heads"],
                            mlp=s["mlp"], context=s["context"], seed=seed, source=f"benchmarks/serve_models.py:{name}")


def describe(folder: Path) -> dict[str, Any]:
    """The shape a folder holds, for the results: layers, hidden, vocab, parameters (counted in its safetensors)."""
    from safetensors import safe_open

    cfg = json.loads((folder / "config.json").read_text())
    params = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return {"layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"], "vocab": cfg["vocab_size"],
            "mlp": cfg["intermediate_size"], "parameters": params}


def kv_cache_bytes(folder: Path, tokens: int, dtype_bytes: int = 4) -> int:
    """Bytes of `tokens` of KV cache at the folder's shape (K and V, every layer), whole MiB: vLLM's
    kv_cache_memory_bytes for the same budget as lmforge's kv_cache_tokens."""
    cfg = json.loads((folder / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads, head_dim = cfg.get("num_key_value_heads") or heads, cfg["hidden_size"] // heads
    return math.ceil(tokens * cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes / 2**20) * 2**20
