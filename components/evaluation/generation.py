"""Batched generation with a KV cache: greedy by default, seeded sampling otherwise.

    gens, wall_s = generate(model, tokenizer, prompts, max_new_tokens=48, batch_size=8,
                            start_id=tokenizer.eos_token_id, max_prompt_tokens=200)
    gens[0].text, gens[0].tokens, gens[0].timing.ttft_s

Prompts are left padded so that every row's next token sits in the last column, with
position ids counted from each row's first real token; batched and one-by-one
generation therefore give the same tokens. Each prompt is preceded by `start_id` (the
eos token: training documents follow an eos) and truncated from the left to
`max_prompt_tokens`. A row stops at eos or once its text contains a stop string (the
docstring close by default); the batch stops when every row has stopped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmforge.components.data.records import DOC_CLOSE
from lmforge.components.evaluation.latency import RowTiming


@dataclass(frozen=True)
class Generation:
    prompt: str
    text: str          # the continuation, decoded, cut at the first stop string
    token_ids: tuple[int, ...]
    timing: RowTiming

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


def generate(model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int, batch_size: int,
             start_id: int, max_prompt_tokens: int, temperature: float = 0.0, seed: int = 0,
             stop_strings: Sequence[str] = (DOC_CLOSE,)) -> tuple[list[Generation], float]:
    """Generate for every prompt; return the generations (in prompt order) and the total wall time."""
    import torch

    assert max_prompt_tokens >= 1 and max_new_tokens >= 1
    gen = torch.Generator().manual_seed(seed)
    encoded = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    encoded = [([start_id, *ids])[-max_prompt_tokens:] for ids in encoded]
    out: list[Generation] = []
    wall = 0.0
    for i in range(0, len(prompts), batch_size):
        rows, seconds = _generate_batch(model, tokenizer, encoded[i : i + batch_size], max_new_tokens=max_new_tokens,
                                        temperature=temperature, generator=gen, stop_strings=stop_strings)
        wall += seconds
        out += [Generation(prompt=p, text=text, token_ids=ids, timing=t)
                for p, (text, ids, t) in zip(prompts[i : i + batch_size], rows)]
    return out, wall


def _generate_batch(model: Any, tokenizer: Any, encoded: list[list[int]], *, max_new_tokens: int, temperature: float,
                    generator: Any, stop_strings: Sequence[str]) -> tuple[list[tuple[str, tuple[int, ...], RowTiming]], float]:
    import torch

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    b, width = len(encoded), max(len(e) for e in encoded)
    input_ids = torch.full((b, width), pad, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    generated: list[list[int]] = [[] for _ in range(b)]
    texts = [""] * b
    done = [False] * b
    finish = [0.0] * b
    start = time.perf_counter()
    ttft = 0.0
    with torch.inference_mode():
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
        for step in range(max_new_tokens):
            nxt = _pick(out.logits[:, -1, :], temperature, generator)
            now = time.perf_counter()
            if step == 0:
                ttft = now - start
            for row in range(b):
                if done[row]:
                    continue
                tok = int(nxt[row])
                if tok == eos:
                    done[row], finish[row] = True, now
                    continue
                generated[row].append(tok)
                texts[row], stopped = _cut(tokenizer.decode(generated[row], skip_special_tokens=True), stop_strings)
                if stopped or len(generated[row]) >= max_new_tokens:
                    done[row], finish[row] = True, now
            if all(done):
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions,
                        past_key_values=out.past_key_values, use_cache=True)
    end = time.perf_counter()
    rows = [(texts[r], tuple(generated[r]), RowTiming(ttft_s=ttft, total_s=(finish[r] or end) - start, tokens=len(generated[r])))
            for r in range(b)]
    return rows, end - start


def _pick(logits: Any, temperature: float, generator: Any) -> Any:
    import torch

    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _cut(text: str, stop_strings: Sequence[str]) -> tuple[str, bool]:
    cuts = [text.find(s) for s in stop_strings if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)
