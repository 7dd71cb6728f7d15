"""Generation for evaluation: components/serving/generation.py (what Triton and the pyfunc run), in batches, timed.

    gens, wall_s = generate(model, tokenizer, prompts, task, max_new_tokens=48, batch_size=8, max_prompt_tokens=200)
    gens[0].text, gens[0].tokens, gens[0].timing.ttft_s

Each prompt (a string, or a chat's messages) is encoded by the task (components/serving/task.py) and cut
from the left to `max_prompt_tokens`; decoding and the task's stop rule are those of the served
model, so what is scored here is what is served. Greedy by default; seeded sampling with
`temperature > 0`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmforge.components.evaluation.latency import RowTiming
from lmforge.components.serving import generation as shared
from lmforge.components.serving.task import Prompt, Task


@dataclass(frozen=True)
class Generation:
    prompt: Prompt
    text: str          # the continuation, decoded, cut at the first stop string
    token_ids: tuple[int, ...]
    timing: RowTiming

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


def generate(model: Any, tokenizer: Any, prompts: Sequence[Prompt], task: Task, *, max_new_tokens: int,
             batch_size: int, max_prompt_tokens: int, temperature: float = 0.0,
             seed: int = 0) -> tuple[list[Generation], float]:
    """Generate for every prompt; return the generations (in prompt order) and the total wall time."""
    assert max_prompt_tokens >= 1 and max_new_tokens >= 1 and batch_size >= 1
    encoded = [task.encode(tokenizer, p, max_tokens=max_prompt_tokens) for p in prompts]
    stops, ends = task.stops(tokenizer)
    out: list[Generation] = []
    wall = 0.0
    for i in range(0, len(prompts), batch_size):
        start = time.perf_counter()
        rows = shared.generate(model, tokenizer, encoded[i : i + batch_size], max_new_tokens=max_new_tokens,
                               sampling=shared.Sampling(temperature=temperature, seed=seed + i),
                               stop_strings=stops, ends=ends)
        wall += time.perf_counter() - start
        out += [Generation(prompt=p, text=r.text, token_ids=r.token_ids,
                           timing=RowTiming(ttft_s=r.first_token_s, total_s=r.total_s, tokens=r.tokens))
                for p, r in zip(prompts[i : i + batch_size], rows)]
    return out, wall
