"""The one generation path: a task's prompt rendering and stop rule, then decoding.

    task = Task.load(model_dir)                                   # components/serving/task.py: saved with the model
    ids = task.encode(tokenizer, "Once upon a time")              # the task's rendering of one prompt
    outs = generate(model, tokenizer, [ids], max_new_tokens=32, stop_strings=task.stop_strings)   # greedy
    outs[0].text, outs[0].token_ids, outs[0].mean_logprob, outs[0].first_token_s
    outs = generate(model, tokenizer, [ids], max_new_tokens=32, sampling=Sampling(temperature=0.8, seed=7))
    outs = generate_rows(model, tokenizer, [Row(ids, 32, Sampling(), ("\n",)), ...])   # per-request settings
    outs = decode(torch_forward(model), tokenizer, [ids], max_new_tokens=32)   # the same rows through a forward
                                                                 # function and a KV cache (an ONNX graph: onnxrun.py)

Evaluation (components/evaluation/timed_generation.py), the MLflow pyfunc (components/registry/hf_pyfunc.py)
and the Triton model (components/serving/triton_model.py) all call this with prompts the model's task encoded (supervised
fine-tuning, components/training/sft.py, trains on the same prompt ids), so what is scored is what is
served.

- Decoding: `model.generate` on left-padded rows, up to the largest `max_new_tokens` of the batch;
  greedy, or sampled with a `Sampling` (temperature, top_p, top_k): after `torch.manual_seed(seed)`
  when it names a seed (repeatable), from torch's running random stream when it does not.
- Stopping: a row ends at an end id (`end_ids`: the tokenizer's eos and every eos id of the model's
  generation_config, e.g. Llama 3's <|eot_id|>; not part of its tokens), at the token whose decoded
  text first contains a stop string (that token is kept, the text is cut before the string), or at
  its own `max_new_tokens`. `RowText` applies the rule as tokens arrive, decoding each token once
  (an incremental detokenizer, as vLLM's and TGI's) and searching only the new text's tail for a stop
  string; it is applied to the generated tokens afterwards, so rows of different lengths in one batch
  never affect each other's tokens, and the serving engine (components/serving/engine.py) applies the same object.
- Requests with their own settings (`generate_rows`): greedy rows with the same stop strings share a
  batch; a sampled row runs alone, so the same seed gives the same text whatever else was in the batch.

Imports only torch, transformers and the standard library.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """How a row picks its tokens: greedy at temperature 0, else sampled (top_k 0 and top_p 1 keep every token)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None   # None: torch's running random stream (a different text each time)

    def __post_init__(self) -> None:
        assert self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0, self
        assert self.seed is None or self.seed >= 0, self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seeded(self) -> bool:
        """Sampled under its own seed: its text must not depend on what else is in the batch."""
        return not self.greedy and self.seed is not None


GREEDY = Sampling()


@dataclass(frozen=True)
class Output:
    token_ids: tuple[int, ...]   # the continuation's tokens under the stopping rule (no eos, no padding)
    text: str                    # decoded, cut before the first stop string
    mean_logprob: float          # mean log-probability of token_ids under the model (0.0 for none)
    first_token_s: float         # from the start of the batch to its first generated token
    total_s: float               # from the start of the batch to this row's last token
    end_id: int | None = None    # the end id that ended the row (not in token_ids); None when something else did
    # score_tokens entries reported by the engine itself (vLLM), one per generated / prompt token; None: not reported
    logprobs: tuple[dict[str, Any] | None, ...] | None = None
    prompt_logprobs: tuple[dict[str, Any] | None, ...] | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Row:
    """One request's row: encoded prompt, token limit, sampling and stop strings; for a serving engine also whether
    end ids are ignored (fixed-length output), the log-probability alternatives asked for (vLLM's logprobs and
    prompt_logprobs) and a structured-output constraint (vLLM's StructuredOutputsParams fields: json, regex, ...)."""

    ids: Sequence[int]
    max_new_tokens: int
    sampling: Sampling = GREEDY
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: dict[str, Any] | None = field(default=None, hash=False, compare=False)


def _limits(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> list[int]:
    limits = [int(max_new_tokens)] * len(prompts) if isinstance(max_new_tokens, int) else [int(v) for v in max_new_tokens]
    assert len(limits) == len(prompts) and all(v >= 1 for v in limits) and all(len(p) >= 1 for p in prompts)
    return limits


def _eos_pad(tokenizer: Any) -> tuple[int, int]:
    eos = tokenizer.eos_token_id
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos


def end_ids(tokenizer: Any, generation_config: Any = None) -> tuple[int, ...]:
    """Every id that ends a row: the tokenizer's eos, then each eos id of the model's generation_config (an int or a
    list: Llama 3 lists <|end_of_text|> and <|eot_id|>, Gemma <eos> and <end_of_turn>)."""
    extra = getattr(generation_config, "eos_token_id", None)
    ids = [tokenizer.eos_token_id, *(extra if isinstance(extra, (list, tuple)) else [extra])]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


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


def _outputs(rows: list["RowText"], generated: list[list[int]], logps: list[list[float]], steps: list[float],
             start: float, end: float, *, pushed: bool = False) -> list[Output]:
    """One Output per row: its tokens cut by the stopping rule (each row's RowText, given its tokens here unless
    `pushed` already), their mean log-probability, and its timings (first token, and the step that produced its last
    kept token)."""
    results = []
    for row, text in enumerate(rows):
        if not pushed:
            text.extend(generated[row])
        n = len(text.ids)
        lp = logps[row][:n]
        last = steps[n - 1] if 0 < n <= len(steps) else end
        results.append(Output(token_ids=tuple(text.ids), text=text.finish(),
                              mean_logprob=sum(lp) / len(lp) if lp else 0.0,
                              first_token_s=(steps[0] if steps else end) - start, total_s=last - start,
                              end_id=text.end))
    return results


def generate(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
             sampling: Sampling = GREEDY, stop_strings: Sequence[str] = (), scores: bool = False,
             ends: Sequence[int] = ()) -> list[Output]:
    """Continue each encoded prompt (Task.encode) in one batch; one Output per prompt, in order.

    `max_new_tokens` is one limit for all rows or one per row; `scores=True` fills mean_logprob; `ends`: end ids
    beyond the tokenizer's and the generation_config's (Task.stops: a chat template's end-of-turn token).
    """
    import torch
    from transformers import LogitsProcessorList, StoppingCriteriaList
    from transformers.generation.stopping_criteria import StopStringCriteria

    limits = _limits(prompts, max_new_tokens)
    if not prompts:
        return []
    _, pad = _eos_pad(tokenizer)
    ends = tuple(dict.fromkeys((*end_ids(tokenizer, getattr(model, "generation_config", None)), *ends)))
    device = next(model.parameters()).device
    input_ids, mask = _left_padded(prompts, pad)
    width = input_ids.shape[1]
    clock = _StepClock()
    stops = [s for s in stop_strings if s]
    sample = not sampling.greedy
    if sample and sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(limits),
            do_sample=sample, temperature=sampling.temperature if sample else None,
            top_k=sampling.top_k if sample else None, top_p=sampling.top_p if sample else None, num_beams=1,
            pad_token_id=pad, eos_token_id=list(ends),
            logits_processor=LogitsProcessorList([clock]),
            stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, stops)]) if stops else None,
            return_dict_in_generate=True, output_scores=scores)
        logprobs = (model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True).float().cpu()
                    if scores else None)
    end = time.perf_counter()
    generated = [row[:limit] for row, limit in zip(out.sequences[:, width:].cpu().tolist(), limits)]
    logps = logprobs.tolist() if logprobs is not None else [[] for _ in prompts]
    rows = [RowText(tokenizer, stops, ends) for _ in prompts]
    return _outputs(rows, generated, logps, clock.steps, start, end)


def batches(rows: Sequence[Row]) -> list[list[int]]:
    """The indices of `rows` that may share one batch: greedy rows that stop alike together, each sampled row alone
    (its seed alone decides its tokens)."""
    groups: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
        key = ("greedy", row.stop_strings) if row.sampling.greedy else ("sampled", i)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def generate_rows(model: Any, tokenizer: Any, rows: Sequence[Row], *, scores: bool = False,
                  ends: Sequence[int] = ()) -> list[Output]:
    """One Output per row, in order, each under its own limit, sampling and stop strings (`batches`); `ends` as in
    `generate`."""
    out: list[Any] = [None] * len(rows)
    for members in batches(rows):
        first = rows[members[0]]
        done = generate(model, tokenizer, [rows[i].ids for i in members],
                        max_new_tokens=[rows[i].max_new_tokens for i in members], sampling=first.sampling,
                        stop_strings=first.stop_strings, scores=scores, ends=ends)
        for i, o in zip(members, done):
            out[i] = o
    return out


class RowText:
    """One row's text as its tokens arrive, and its stopping rule.

        text = RowText(tokenizer, ("\\n\\n",), end_ids(tokenizer, model.generation_config))
        for token in new_tokens:
            if text.push(token):          # an end id (not kept) or a stop string (the text is cut before it)
                break
        text.ids, text.finish()           # the tokens kept, the whole text

    Each token is decoded once, with a few tokens of context: the prefix and read offsets of vLLM's and TGI's
    incremental detokenizers, so the text grows by whole characters (a token ending in half a UTF-8 character waits
    for the next) and a row of n tokens costs O(n) decoding, not O(n^2). A stop string is searched for only in the
    tail that could hold one ending in the new text.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = (), ends: Sequence[int] = (), *,
                 ignore_eos: bool = False) -> None:
        self.tok = tokenizer
        self.stops = tuple(s for s in stop_strings if s)
        self.ends = frozenset() if ignore_eos else frozenset(ends or end_ids(tokenizer))
        self.longest = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []
        self.text = ""            # whole characters decoded so far (cut before a stop string once one is found)
        self.stopped = False      # an end id or a stop string ended the row
        self.end: int | None = None   # the end id that ended it
        self.prefix = self.read = 0

    def push(self, token: int) -> bool:
        """Add one generated token; True when the row has ended (push nothing more)."""
        if self.stopped:
            return True
        if token in self.ends:
            self.stopped, self.end = True, token
            return True
        self.ids.append(token)
        before = len(self.text)
        self.text += self._new_text()
        if self.stops and len(self.text) > before:
            start = max(0, before - self.longest + 1)
            cuts = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if cuts:
                self.text, self.stopped = self.text[:min(cuts)], True
        return self.stopped

    def extend(self, tokens: Sequence[int]) -> bool:
        """push each of `tokens` until the row ends; whether it has."""
        return any(self.push(t) for t in tokens)

    def _new_text(self) -> str:
        prev = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        cur = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(cur) <= len(prev) or cur.endswith("\ufffd"):
            return ""   # half a character so far: wait for the token that completes it
        self.prefix, self.read = self.read, len(self.ids)
        return cur[len(prev):]

    def finish(self) -> str:
        """The whole text: a row that ended in half a character keeps it (as U+FFFD), as a full decode would."""
        if not self.stopped and self.read < len(self.ids):
            prev = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
            self.text += self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)[len(prev):]
            self.prefix = self.read = len(self.ids)
        return self.text


def stopping_rule(tokenizer: Any, tokens: Sequence[int], stop_strings: Sequence[str],
                  ends: Sequence[int] = ()) -> tuple[int, str]:
    """(how many of `tokens` the row keeps, its text): through the token completing a stop string, before an end id."""
    text = RowText(tokenizer, stop_strings, ends)
    text.extend(tokens)
    return len(text.ids), text.finish()


def score_tokens(model: Any, tokenizer: Any, ids: Sequence[int], *, top: int,
                 then: int | None = None) -> list[dict[str, Any] | None]:
    """Each token's log-probability given the tokens before it, and its `top` likeliest alternatives (best first),
    from one forward pass over `ids` (a prompt and what was generated after it): one entry per token, None for the
    first, which nothing precedes, and one more for `then` after them (the end id that ended a row: vLLM and OpenAI
    report it). An entry: {"id", "token" (its text), "logprob", "top": [[text, logprob], ...]}. The distribution is
    the model's own (before any temperature, top_k or top_p), as vLLM reports it by default."""
    import torch

    device = next(model.parameters()).device
    targets = [*ids[1:], *([then] if then is not None else [])]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(ids)], dtype=torch.long, device=device)).logits[0].float()
        logp = torch.log_softmax(logits[:len(targets)], -1)   # row t: the distribution of token t + 1
        chosen = logp.gather(-1, torch.tensor(targets, device=device)[:, None])[:, 0].tolist()
        best = logp.topk(top, -1) if top else None
    alternatives = (list(zip(best.indices.tolist(), best.values.tolist())) if best is not None
                    else [([], [])] * len(chosen))

    def piece(token: int) -> str:
        return tokenizer.decode([token])
    return [None] + [{"id": int(t), "token": piece(t), "logprob": lp,
                      "top": [[piece(a), v] for a, v in zip(*alternatives[i])]}
                     for i, (t, lp) in enumerate(zip(targets, chosen))]


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
           stop_strings: Sequence[str] = (), scores: bool = False, ends: Sequence[int] = ()) -> list[Output]:
    """Greedy decoding of left-padded rows through `forward` with a KV cache: `generate`'s rows, prompt, stopping
    rule and Output, for a model that is not a transformers module (an ONNX graph, components/serving/triton_model.py).

        outs = decode(torch_forward(model), tok, [ids], max_new_tokens=32)           # the torch module
        outs = decode(onnxrun.OnnxForward("model.onnx"), tok, [ids], max_new_tokens=32)  # its ONNX export

    `forward(input_ids, attention_mask, position_ids, past)` takes LongTensors [B, S], [B, past + S], [B, S]
    and the cache it returned last (None at the first call) and returns (float logits [B, S, V], cache).
    Positions follow transformers' rule for left padding (cumsum of the mask - 1). A row is done at an end id
    (the tokenizer's eos and `ends`), at its own limit or once a stop string is in its text; the loop ends when
    every row is.
    """
    import torch

    limits = _limits(prompts, max_new_tokens)
    if not prompts:
        return []
    _, pad = _eos_pad(tokenizer)
    input_ids, mask = _left_padded(prompts, pad)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    stops = [s for s in stop_strings if s]
    ends = tuple(dict.fromkeys((*end_ids(tokenizer), *ends)))
    rows = [RowText(tokenizer, stops, ends) for _ in prompts]
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
                done[row] = rows[row].push(tok) or len(generated[row]) >= limits[row]
            input_ids = nxt[:, None]
            mask = torch.cat([mask, torch.ones_like(input_ids)], dim=1)
            positions = positions[:, -1:] + 1
    end = time.perf_counter()
    return _outputs(rows, generated, logps, steps, start, end, pushed=True)


def torch_forward(model: Any) -> Any:
    """`decode`'s forward function for a transformers causal LM: the module with its own KV cache."""
    device = next(model.parameters()).device

    def forward(input_ids: Any, attention_mask: Any, position_ids: Any, past: Any) -> tuple[Any, Any]:
        out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                    position_ids=position_ids.to(device), past_key_values=past, use_cache=True)
        return out.logits.float().cpu(), out.past_key_values
    return forward
