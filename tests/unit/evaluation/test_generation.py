"""Batched generation: same tokens as one-by-one and as transformers' greedy generate; stops; latency."""

from __future__ import annotations

import pytest
import torch

from lmforge.components.evaluation.latency import RowTiming, summarize
from lmforge.components.evaluation.timed_generation import generate
from lmforge.components.registry.loading import load_causal_lm
from lmforge.components.serving.records import generation_prompt
from lmforge.components.serving.task import Task

AS_GIVEN = Task("completion")  # the prompts below are already templated: encoded as given, no stop string

PROMPTS = [generation_prompt(s) for s in ("def dumps(obj, *, indent=None)", "def f(x)",
                                           "def join(a, *paths)", "class JSONDecoder(object)", "def g()")]


@pytest.fixture(scope="module")
def model_and_tok(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


def _gen(model, tok, prompts, task=AS_GIVEN, **kw):
    args = dict(max_new_tokens=12, batch_size=8, max_prompt_tokens=200)
    return generate(model, tok, prompts, task, **{**args, **kw})[0]


def test_batched_left_padded_equals_one_by_one_equals_hf_greedy(model_and_tok):
    model, tok = model_and_tok
    batched = _gen(model, tok, PROMPTS, batch_size=5)
    single = _gen(model, tok, PROMPTS, batch_size=1)
    assert [g.token_ids for g in batched] == [g.token_ids for g in single]
    for p, g in zip(PROMPTS, single):
        ids = torch.tensor([[tok.eos_token_id, *tok(p, add_special_tokens=False)["input_ids"]]])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        assert list(g.token_ids) == ref[0, ids.shape[1]:].tolist()[: g.tokens]
        assert g.tokens == 12 or ref[0, ids.shape[1] + g.tokens] == tok.eos_token_id


def test_stops_at_a_stop_string_and_cuts_it_off(model_and_tok):
    model, tok = model_and_tok
    full = _gen(model, tok, PROMPTS[:1])[0]
    assert len(full.text) > 6
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cut = _gen(model, tok, PROMPTS[:1], Task("completion", stop=(stop,)))[0]
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.tokens < full.tokens


def test_stops_at_eos(model_and_tok):
    model, tok = model_and_tok
    eos_model = type(model)(model.config).eval()
    eos_model.load_state_dict(model.state_dict())
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 1.0  # eos is always the most likely token
    eos_model.lm_head = head
    gens = _gen(eos_model, tok, PROMPTS, batch_size=3)
    assert [g.tokens for g in gens] == [0] * len(PROMPTS)
    assert all(g.text == "" for g in gens)


def test_sampling_is_reproducible_with_a_seed(model_and_tok):
    model, tok = model_and_tok
    a = _gen(model, tok, PROMPTS, temperature=1.0, seed=7)
    b = _gen(model, tok, PROMPTS, temperature=1.0, seed=7)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


def test_latency_summary_from_hand_timings():
    rows = [RowTiming(ttft_s=0.1, total_s=0.5, tokens=5), RowTiming(ttft_s=0.1, total_s=0.1, tokens=1)]
    s = summarize(rows, wall_s=0.6)
    assert s["ttft_ms"] == pytest.approx(100.0)
    assert s["tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4; the one-token row has no TPOT
    assert s["tokens_per_s"] == pytest.approx(10.0)


def test_rows_with_their_own_limits_in_one_batch_match_each_alone(model_and_tok):
    from lmforge.components.serving import generation as shared

    model, tok = model_and_tok
    encoded = [AS_GIVEN.encode(tok, p) for p in PROMPTS[:3]]
    assert encoded[0][0] == tok.eos_token_id and len({len(e) for e in encoded}) > 1  # eos first; padding needed
    together = shared.generate(model, tok, encoded, max_new_tokens=[3, 9, 5], stop_strings=(), scores=True)
    alone = [shared.generate(model, tok, [e], max_new_tokens=n, stop_strings=(), scores=True)[0]
             for e, n in zip(encoded, [3, 9, 5])]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.tokens for o in together] == [3, 9, 5]
    assert all(o.mean_logprob < 0 for o in together)
    assert together[0].mean_logprob == pytest.approx(alone[0].mean_logprob, abs=1e-4)


def test_rows_with_their_own_settings_batch_as_they_may(model_and_tok):
    """Greedy rows that stop alike share a batch; a sampled row runs alone, so its seed alone decides its tokens."""
    from lmforge.components.serving import generation as shared

    model, tok = model_and_tok
    ids = [AS_GIVEN.encode(tok, p) for p in PROMPTS[:3]]
    hot = shared.Sampling(temperature=1.5, seed=11)
    rows = [shared.Row(ids[0], 8), shared.Row(ids[1], 8, hot), shared.Row(ids[2], 8, stop_strings=("e",)),
            shared.Row(ids[0], 8, hot)]
    assert shared.batches(rows) == [[0], [1], [2], [3]]
    assert shared.batches([rows[0], shared.Row(ids[2], 4)]) == [[0, 1]]
    mixed = shared.generate_rows(model, tok, rows)
    alone = shared.generate_rows(model, tok, [rows[1]])[0]
    assert mixed[1].token_ids == alone.token_ids            # the same seed, the same text, whatever shares the batch
    assert mixed[0].token_ids == shared.generate(model, tok, [ids[0]], max_new_tokens=8)[0].token_ids
    assert "e" not in mixed[2].text
    other_seed = shared.generate_rows(model, tok, [shared.Row(ids[1], 8, shared.Sampling(temperature=1.5, seed=12))])
    greedy = shared.generate(model, tok, [ids[1]], max_new_tokens=8)[0]
    assert alone.token_ids != greedy.token_ids or other_seed[0].token_ids != greedy.token_ids  # it does sample


class _CharTokenizer:
    """One character per token id; id 0 is eos."""
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


def test_stopping_rule_keeps_the_stop_token_cuts_the_text_and_ends_at_eos():
    from lmforge.components.serving.generation import stopping_rule

    tok = _CharTokenizer()
    ids = [ord(c) for c in 'Ab."""x']
    assert stopping_rule(tok, ids, ('"""',)) == (6, "Ab.")
    assert stopping_rule(tok, [ord("A"), 0, ord("B")], ('"""',)) == (1, "A")
    assert stopping_rule(tok, ids, ()) == (7, 'Ab."""x')


def test_score_tokens_reports_each_tokens_log_probability_its_alternatives_and_the_end_id(model_and_tok):
    from lmforge.components.serving import generation as shared

    model, tok = model_and_tok
    ids = Task("completion").encode(tok, "def join(a, *p):")
    out = shared.generate(model, tok, [ids], max_new_tokens=6)[0]
    seq = [*ids, *out.token_ids]
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
    entries = shared.score_tokens(model, tok, seq, top=3, then=tok.eos_token_id)
    assert entries[0] is None and len(entries) == len(seq) + 1
    for t in range(1, len(seq)):
        assert entries[t]["id"] == seq[t]
        assert entries[t]["logprob"] == pytest.approx(logp[t - 1, seq[t]].item(), abs=1e-5)
        assert [v for _, v in entries[t]["top"]] == pytest.approx(logp[t - 1].topk(3).values.tolist(), abs=1e-5)
    assert entries[-1]["id"] == tok.eos_token_id   # `then`: scored after the whole sequence
    assert entries[-1]["logprob"] == pytest.approx(logp[-1, tok.eos_token_id].item(), abs=1e-5)


def test_a_row_ended_by_an_end_id_says_which(model_and_tok):
    from lmforge.components.serving import generation as shared

    model, tok = model_and_tok
    ids = Task("completion").encode(tok, "def join(a, *p):")
    free = shared.generate(model, tok, [ids], max_new_tokens=8)[0]
    text = shared.RowText(tok, (), (tok.eos_token_id, free.token_ids[3]))
    assert text.extend(free.token_ids) and text.end == free.token_ids[3] and text.ids == list(free.token_ids[:3])
    assert free.end_id in (None, tok.eos_token_id)
