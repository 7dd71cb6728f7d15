"""The one generation path: a task's prompt rendering and stop rule, then decoding.

    task = Task.load(model_dir)                                   # components/task.py: saved with the model
    ids = task.encode(tokenizer, "Once upon a time")              # the task's rendering of one prompt
    outs = generate(model, tokenizer, [ids], max_new_tokens=32, stop_strings=task.stop_strings)   # greedy
    outs[0].text, outs[0].token_ids, outs[0].mean_logprob, outs[0].first_token_s
    outs = generate(model, tokenizer, [ids], max_new_tokens=32, sampling=Sampling(temperature=0.8, seed=7))
    outs = generate_rows(model, tokenizer, [Row(ids, 32, Sampling(), ("\n",)), ...])   # per-request settings
    outs = decode(torch_forward(model), tokenizer, [ids], max_new_tokens=32)   # the same rows through a forward
                                                                 # function and a KV cache (an ONNX graph: onnxrun.py)

Evaluation (components/evaluation/generation.py), the MLflow pyfunc (components/registry/hf_pyfunc.py)
and the Triton model (deploy/model.py) all call this with prompts the model's task encoded (supervised
fine-tuning, components/training/sft.py, trains on the same prompt ids), so what is scored is what is
served.

- Decoding: `model.generate` on left-padded rows, up to the largest `max_new_tokens` of the batch;
  greedy, or sampled with a `Sampling` (temperature, top_p, top_k) after `torch.manual_seed(seed)`.
- Stopping: a row ends at eos (not part of its tokens), at the token whose decoded text first contains
  a stop string (that token is kept, the text is cut before the string), or at its own
  `max_new_tokens`. The rule is applied to the generated tokens afterwards, so rows of different
  lengths in one batch never affect each other's tokens.
- Requests with their own settings (`generate_rows`): greedy rows with the same stop strings share a
  batch; a sampled row runs alone, so the same seed gives the same text whatever else was in the batch.

Imports only torch, transformers and the standard library: the Triton repository and the MLflow model
carry a copy in `lmforge_runtime/`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """How a row picks its tokens: greedy at temperature 0, else sampled (top_k 0 and top_p 1 keep every token)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0, self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


@dataclass(frozen=True)
class Output:
    token_ids: tuple[int, ...]   # the continuation's tokens under the stopping rule (no eos, no padding)
    text: str                    # decoded, cut before the first stop string
    mean_logprob: float          # mean log-probability of token_ids under the model (0.0 for none)
    first_token_s: float         # from the start of the batch to its first generated token
    total_s: float               # from the start of the batch to this row's last token

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Row:
    """One request's row for `generate_rows`: encoded prompt, token limit, sampling and stop strings."""

    ids: Sequence[int]
    max_new_tokens: int
    sampling: Sampling = GREEDY
    stop_strings: tuple[str, ...] = ()


def _limits(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> list[int]:
    limits = [int(max_new_tokens)] * len(prompts) if isinstance(max_new_tokens, int) else [int(v) for v in max_new_tokens]
    assert len(limits) == len(prompts) and all(v >= 1 for v in limits) and all(len(p) >= 1 for p in prompts)
    return limits


def _eos_pad(tokenizer: Any) -> tuple[int, int]:
    eos = tokenizer.eos_token_id
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos


def _left_padded(prompts: Sequence[Sequence[int]], pad: int) -> tuple[Any, Any]:
    """The prompts as one left-padded LongTensor [B, width] and its attention mask (1 on real tokens)."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
        mask[row, width - len(ids):] = 1
    return input_ids, mask


def _outputs(tokenizer: Any, generated: list[list[int]], logps: list[list[float]], limits: list[int],
             stops: list[str], steps: list[float], start: float, end: float) -> list[Output]:
    """One Output per row: its tokens cut by the stopping rule, their mean log-probability, and its timings
    (first token, and the step that produced its last kept token)."""
    results = []
    for row, limit in enumerate(limits):
        n, text = stopping_rule(tokenizer, generated[row][:limit], stops)
        lp = logps[row][:n]
        last = steps[n - 1] if 0 < n <= len(steps) else end
        results.append(Output(token_ids=tuple(generated[row][:n]), text=text,
                              mean_logprob=sum(lp) / len(lp) if lp else 0.0,
                              first_token_s=(steps[0] if steps else end) - start, total_s=last - start))
    return results


def generate(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
             sampling: Sampling = GREEDY, stop_strings: Sequence[str] = (), scores: bool = False) -> list[Output]:
    """Continue each encoded prompt (Task.encode) in one batch; one Output per prompt, in order.

    `max_new_tokens` is one limit for all rows or one per row; `scores=True` fills mean_logprob.
    """
    import torch
    from transformers import LogitsProcessorList, StoppingCriteriaList
    from transformers.generation.stopping_criteria import StopStringCriteria

    limits = _limits(prompts, max_new_tokens)
    if not prompts:
        return []
    eos, pad = _eos_pad(tokenizer)
    device = next(model.parameters()).device
    input_ids, mask = _left_padded(prompts, pad)
    width = input_ids.shape[1]
    clock = _StepClock()
    stops = [s for s in stop_strings if s]
    sample = not sampling.greedy
    if sample:
        torch.manual_seed(sampling.seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(limits),
            do_sample=sample, temperature=sampling.temperature if sample else None,
            top_k=sampling.top_k if sample else None, top_p=sampling.top_p if sample else None, num_beams=1,
            pad_token_id=pad, eos_token_id=eos,
            logits_processor=LogitsProcessorList([clock]),
            stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, stops)]) if stops else None,
            return_dict_in_generate=True, output_scores=scores)
        logprobs = (model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True).float().cpu()
                    if scores else None)
    end = time.perf_counter()
    generated = out.sequences[:, width:].cpu().tolist()
    logps = logprobs.tolist() if logprobs is not None else [[] for _ in prompts]
    return _outputs(tokenizer, generated, logps, limits, stops, clock.steps, start, end)


def batches(rows: Sequence[Row]) -> list[list[int]]:
    """The indices of `rows` that may share one batch: greedy rows that stop alike together, each sampled row alone
    (its seed alone decides its tokens)."""
    groups: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
        key = ("greedy", row.stop_strings) if row.sampling.greedy else ("sampled", i)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def generate_rows(model: Any, tokenizer: Any, rows: Sequence[Row], *, scores: bool = False) -> list[Output]:
    """One Output per row, in order, each under its own limit, sampling and stop strings (`batches`)."""
    out: list[Any] = [None] * len(rows)
    for members in batches(rows):
        first = rows[members[0]]
        done = generate(model, tokenizer, [rows[i].ids for i in members],
                        max_new_tokens=[rows[i].max_new_tokens for i in members], sampling=first.sampling,
                        stop_strings=first.stop_strings, scores=scores)
        for i, o in zip(members, done):
            out[i] = o
    return out


def stopping_rule(tokenizer: Any, tokens: Sequence[int], stop_strings: Sequence[str]) -> tuple[int, str]:
    """(how many of `tokens` the row keeps, its text): through the token completing a stop string, before eos."""
    n, text, _ = stop_state(tokenizer, tokens, stop_strings)
    return n, text


def stop_state(tokenizer: Any, tokens: Sequence[int], stop_strings: Sequence[str], *,
               checked: int = 0) -> tuple[int, str, bool]:
    """`stopping_rule` and whether it ended the row (eos, or a stop string in its text) rather than its end.

    `checked`: how many leading tokens an earlier call saw without the row ending, so a row that grows by a token
    a step (deploy/engine.py) costs one decode a step, not one per token so far.
    """
    eos = tokenizer.eos_token_id
    text = None
    for k in range(checked, len(tokens)):
        if tokens[k] == eos:
            return k, tokenizer.decode(tokens[:k], skip_special_tokens=True), True
        if stop_strings:
            text = tokenizer.decode(tokens[:k + 1], skip_special_tokens=True)
            cuts = [text.find(s) for s in stop_strings if s in text]
            if cuts:
                return k + 1, text[: min(cuts)], True
    if text is None:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
    return len(tokens), text, False


def stable_prefix(text: str, stop_strings: Sequence[str]) -> str:
    """The part of a row's text so far that more tokens cannot change: without a trailing half UTF-8 character
    (decoded as U+FFFD) and without a tail that could be the start of a stop string (a streamed row sends this)."""
    text = text.rstrip("\ufffd")
    hold = max((k for s in stop_strings for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold]


class _StepClock:
    """A logits processor that only notes when each decoding step picks its token."""

    def __init__(self) -> None:
        self.steps: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.steps.append(time.perf_counter())
        return scores


# --- the KV-cache decoding loop, for a model given as a forward function ----------------------

def decode(forward: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
           stop_strings: Sequence[str] = (), scores: bool = False) -> list[Output]:
    """Greedy decoding of left-padded rows through `forward` with a KV cache: `generate`'s rows, prompt, stopping
    rule and Output, for a model that is not a transformers module (an ONNX graph, deploy/model.py).

        outs = decode(torch_forward(model), tok, [ids], max_new_tokens=32)           # the torch module
        outs = decode(onnxrun.OnnxForward("model.onnx"), tok, [ids], max_new_tokens=32)  # its ONNX export

    `forward(input_ids, attention_mask, position_ids, past)` takes LongTensors [B, S], [B, past + S], [B, S]
    and the cache it returned last (None at the first call) and returns (float logits [B, S, V], cache).
    Positions follow transformers' rule for left padding (cumsum of the mask - 1). A row is done at eos,
    at its own limit or once a stop string is in its text; the loop ends when every row is.
    """
    import torch

    limits = _limits(prompts, max_new_tokens)
    if not prompts:
        return []
    eos, pad = _eos_pad(tokenizer)
    input_ids, mask = _left_padded(prompts, pad)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    stops = [s for s in stop_strings if s]
    generated: list[list[int]] = [[] for _ in prompts]
    logps: list[list[float]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    steps: list[float] = []
    past = None
    start = time.perf_counter()
    with torch.inference_mode():
        while not all(done):
            logits, past = forward(input_ids, mask, positions, past)
            last = logits[:, -1, :].float()
            nxt = last.argmax(-1)
            if scores:
                chosen = torch.log_softmax(last, -1).gather(-1, nxt[:, None])[:, 0].tolist()
            steps.append(time.perf_counter())
            for row, tok in enumerate(nxt.tolist()):
                if done[row]:
                    continue
                generated[row].append(tok)
                if scores:
                    logps[row].append(chosen[row])
                text = tokenizer.decode(generated[row], skip_special_tokens=True) if stops else ""
                done[row] = (tok == eos or len(generated[row]) >= limits[row] or any(s in text for s in stops))
            input_ids = nxt[:, None]
            mask = torch.cat([mask, torch.ones_like(input_ids)], dim=1)
            positions = positions[:, -1:] + 1
    end = time.perf_counter()
    return _outputs(tokenizer, generated, logps, limits, stops, steps, start, end)


def torch_forward(model: Any) -> Any:
    """`decode`'s forward function for a transformers causal LM: the module with its own KV cache."""
    device = next(model.parameters()).device

    def forward(input_ids: Any, attention_mask: Any, position_ids: Any, past: Any) -> tuple[Any, Any]:
        out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                    position_ids=position_ids.to(device), past_key_values=past, use_cache=True)
        return out.logits.float().cpu(), out.past_key_values
    return forward
