"""On one CUDA device: the one generation path under a task, greedy and seeded sampling, with per-request settings.

    pytest -m gpu tests/gpu/test_generation_cuda.py      # skipped (not failed) where CUDA is missing

What Triton's model runs on a GPU instance (components/serving/triton_model.py: generation.generate_rows): greedy
rows batched with left padding give transformers' own greedy tokens for each prompt alone; a seeded sampled row gives the same
tokens alone and beside other requests; a chat task renders through the tokenizer's template on the GPU as well.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CHAT = ("{% for m in messages %}<bos>{{ m.role }}\n{{ m.content }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant\n{% endif %}")


def test_greedy_and_seeded_rows_on_cuda(tiny_model_dir):
    from lmforge.components.registry.loading import load_causal_lm
    from lmforge.components.serving import generation
    from lmforge.components.serving.task import Task

    model, tok = load_causal_lm(tiny_model_dir)
    model = model.to("cuda")
    task = Task("completion")
    ids = [task.encode(tok, p) for p in ("Return the", "A list of all the values in", "Open")]
    greedy = generation.generate_rows(model, tok, [generation.Row(i, 10) for i in ids])
    for i, out in zip(ids, greedy):
        ref = model.generate(torch.tensor([i], device="cuda"), attention_mask=torch.ones(1, len(i), device="cuda",
                             dtype=torch.long), max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
        assert list(out.token_ids) == ref[0, len(i):].tolist()[: out.tokens]

    hot = generation.Sampling(temperature=1.2, top_p=0.95, top_k=40, seed=5)
    alone = generation.generate_rows(model, tok, [generation.Row(ids[1], 12, hot)])[0]
    mixed = generation.generate_rows(model, tok, [generation.Row(ids[0], 12), generation.Row(ids[1], 12, hot),
                                                  generation.Row(ids[2], 12, stop_strings=("e",))])
    assert mixed[1].token_ids == alone.token_ids and alone.tokens >= 1

    tok.chat_template = CHAT
    chat = Task("chat").encode(tok, [{"role": "user", "content": "Hi"}])
    (answer,) = generation.generate(model, tok, [chat], max_new_tokens=4)
    assert tok.decode(chat).endswith("<bos>assistant\n") and answer.tokens <= 4
