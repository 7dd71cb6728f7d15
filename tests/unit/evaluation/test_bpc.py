"""BPC against hand-computed values: a uniform model, and the model's own cross-entropy."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.components.evaluation.baseline import UnigramModel
from lmforge.components.evaluation.bpc import bits_per_character, windows
from lmforge.components.registry.loading import load_causal_lm

TEXTS = [
    'def dumps(obj, *, indent=None):\n    """Serialize obj to a JSON formatted str."""\n',
    'def f(x):\n    """Return x."""\n',
    "Split the pathname path into a pair, (head, tail) where tail is the last component. " * 6,
]


@pytest.fixture(scope="module")
def model_and_tok(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


@pytest.mark.parametrize("n, ctx", [(1, 4), (2, 4), (5, 4), (17, 4), (17, 5), (30, 8), (3, 64)])
def test_windows_score_every_token_once_with_bounded_context(n, ctx):
    ids = list(range(n))
    ws = windows(ids, ctx)
    assert sum(k for _, k in ws) == max(0, n - 1)
    scored = [t for w, k in ws for t in w[len(w) - k:]]
    assert scored == ids[1:]
    assert all(len(w) <= ctx for w, _ in ws)


@pytest.mark.parametrize("context_length", [16, 512])
def test_uniform_model_bpc_is_log2_vocab_times_tokens_over_chars(model_and_tok, context_length):
    model, tok = model_and_tok
    uniform = type(model)(model.config).eval()
    uniform.load_state_dict(model.state_dict())
    with torch.no_grad():
        uniform.lm_head.weight.zero_()  # every logit 0: p = 1/V for every token
    r = bits_per_character(uniform, tok, TEXTS, start_id=tok.eos_token_id, context_length=context_length, batch_size=2)
    tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in TEXTS)
    chars = sum(len(t) for t in TEXTS)
    vocab = uniform.config.vocab_size
    assert (r.tokens, r.chars, r.docs) == (tokens, chars, 3)
    assert r.bpc == pytest.approx(math.log2(vocab) * tokens / chars, rel=1e-5)
    assert r.perplexity == pytest.approx(vocab, rel=1e-4)


def test_bpc_equals_the_models_cross_entropy_over_characters(model_and_tok):
    model, tok = model_and_tok
    nats = 0.0
    for t in TEXTS:
        ids = torch.tensor([[tok.eos_token_id, *tok(t, add_special_tokens=False)["input_ids"]]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        nats += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
    r = bits_per_character(model, tok, TEXTS, start_id=tok.eos_token_id, context_length=256, batch_size=3)
    assert r.bpc == pytest.approx(nats / math.log(2) / sum(len(t) for t in TEXTS), rel=1e-4)
    assert r.perplexity == pytest.approx(math.exp(nats / r.tokens), rel=1e-4)


def test_unigram_baseline_matches_add_one_counts(model_and_tok):
    _, tok = model_and_tok
    train = ["Return the value.", "Return a list of the values."]
    u = UnigramModel.fit(tok, train)
    counts: dict[int, int] = {}
    for t in train:
        for i in tok(t, add_special_tokens=False)["input_ids"]:
            counts[i] = counts.get(i, 0) + 1
    n, v = sum(counts.values()), len(tok)
    held = ["Return the list."]
    bits = -sum(math.log2((counts.get(i, 0) + 1) / (n + v)) for i in tok(held[0], add_special_tokens=False)["input_ids"])
    assert u.bits_per_character(tok, held) == pytest.approx(bits / len(held[0]), rel=1e-9)
