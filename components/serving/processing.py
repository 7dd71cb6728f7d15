"""Pre- and post-processing for the served model, importable without a server.

    limits = Limits(context=4096, max_new_tokens=32, max_prompt_chars=65536)   # operator caps: 0 = from the context
    text = decode_text(b"Once upon a time", limits)             # BadRequest("invalid_utf8" | "empty_prompt" | ...)
    ids, max_new = check_tokens(task.encode(tokenizer, task.parse_prompt(text)), limits, None)   # default max_tokens
    max_tokens = parse_max_tokens([16], 1, limits)              # [16]; BadRequest names the field and the row
    sampling = parse_sampling({"temperature": [0.7], "seed": [3]}, 1)   # [Sampling(temperature=0.7, seed=3)]
    stops = parse_stop([[b"\n\n"]], 1)                          # [("\n\n",)]
    settings = request_settings({"max_tokens": [16]}, '{"temperature": 0.7, "stop": "\\n", "logprobs": 2}', limits)
    rate = rare_token_rate(tokenizer(text)["input_ids"], rare_ids, unk_id)
    device, why = serving_device(model, "GPU", 0, torch.cuda.is_available())  # ("cpu", "quantized::... is CPU-only ...")

The Triton model (components/serving/triton_model.py) serves the LLM convention of Triton's own LLM backends: `text_input`
in, `text_output` out, with the settings as vLLM's backend takes them (`sampling_parameters`, a JSON
object: max_tokens, temperature, top_p, top_k, seed, stop) or as TensorRT-LLM's does (one input each).
Every check here names the input (and the row) it refuses, so a client can fix its request; the model
answers it with a 400 and goes on with every other request.

The Triton model runs inside the server's own Python, where lmforge is not installed: this package
is copied whole into `<version>/lmforge_serving/`. Standard library only (the generation module imports
torch only inside its functions).

There is no retrieval at serving time: the served model answers the prompt alone, the
way evaluation's headline scores are measured (evaluation's RAG scores are a separate,
evaluation-only comparison).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from .generation import Sampling

__all__ = ["BadRequest", "Limits", "check_tokens", "decode_text", "is_well_formed", "load_rare_ids",
           "parse_max_tokens", "parse_sampling", "parse_sampling_parameters", "parse_stop", "rare_token_rate", "request_settings",
           "serving_device",
           "VALIDATION_FILE", "read_validation_prompts"]

RARE_TOKENS_FILE = "rare_tokens.json"
VALIDATION_FILE = "validation_prompts.json"  # a version's held-out prompts of its own task, for the rollout gate
SAMPLING_INPUTS = {"temperature": float, "top_p": float, "top_k": int, "seed": int}


class BadRequest(ValueError):
    """A request the model refuses: `code` goes to the request log, the message to the client."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Limits:
    """What a request may use. By default the model's context is the only bound: a prompt may use it less the
    request's max_tokens, and max_tokens what the prompt leaves; an operator's caps (non-zero) are tighter."""

    context: int                   # the model's context length, in tokens: prompt + max_tokens must fit in it
    max_new_tokens: int            # max_tokens of a request that does not say (less when the prompt leaves less)
    max_prompt_chars: int          # a cheap bound before tokenizing (model.py: from the tokens allowed)
    max_prompt_tokens: int = 0     # an operator's cap on a prompt's tokens; 0 = the context less max_tokens
    max_new_tokens_limit: int = 0  # an operator's cap on max_tokens; 0 = what the prompt leaves

    @property
    def max_tokens_cap(self) -> int:
        return min(self.max_new_tokens_limit or self.context - 1, self.context - 1)


def context_length(model_config: Any) -> int:
    """A model's context length, in tokens, from its config (the first of the names architectures give it)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        if isinstance(value := getattr(model_config, name, None), int) and value > 0:
            return value
    raise ValueError(f"the model's config ({type(model_config).__name__}) names no context length "
                     "(max_position_embeddings, n_positions, ...)")


def decode_text(raw: object, limits: Limits | None, *, row: int = 0, name: str = "text_input") -> str:
    """A BYTES element (bytes, or str) as text, or BadRequest saying what is wrong; `limits` None: a stop string,
    which may not be empty but has no length limit of its own."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest("invalid_utf8", f"{name}[{row}] is not valid UTF-8 (byte {e.start}); "
                                             "send it as UTF-8 text") from None
    elif isinstance(raw, str):
        text = raw
    else:
        raise BadRequest("bad_type", f"{name}[{row}] is {type(raw).__name__}, expected a string")
    if "\x00" in text:
        raise BadRequest("control_chars", f"{name}[{row}] contains a NUL character; remove it")
    if not text.strip() if limits else not text:
        raise BadRequest("empty_prompt" if limits else "empty_stop", f"{name}[{row}] is empty; send some text")
    if limits and len(text) > limits.max_prompt_chars:
        raise BadRequest("prompt_too_long", f"{name}[{row}] has {len(text)} characters, more than the "
                                            f"{limits.max_prompt_chars} that the tokens it may use can hold; shorten it")
    return text


def check_tokens(ids: Sequence[int], limits: Limits, max_new: int | None, *, row: int = 0) -> tuple[list[int], int]:
    """(the prompt's ids, the request's max_tokens) once both fit the model's context, or BadRequest naming the
    counts; `max_new` None (the request did not say) is the default, less when the prompt leaves less."""
    n = len(ids)
    if limits.max_prompt_tokens and n > limits.max_prompt_tokens:
        raise BadRequest("prompt_too_long", f"text_input[{row}] is {n} tokens as the model's task renders it, "
                                            f"more than this deployment's limit {limits.max_prompt_tokens} "
                                            "(deploy.max_prompt_tokens); shorten it")
    left = limits.context - n
    if max_new is None:
        if left < 1:
            raise BadRequest("prompt_too_long", f"text_input[{row}] is {n} tokens as the model's task renders it; "
                                                f"the model's context is {limits.context} tokens, and at least one "
                                                "must be left to generate; shorten it")
        return list(ids), min(limits.max_new_tokens, left)
    if n + max_new > limits.context:
        raise BadRequest("prompt_too_long", f"text_input[{row}] is {n} tokens as the model's task renders it and "
                                            f"max_tokens is {max_new}: {n + max_new} tokens, more than the model's "
                                            f"context of {limits.context}; shorten the prompt or lower max_tokens")
    return list(ids), max_new


def _per_row(name: str, values: Sequence[Any] | None, n_rows: int) -> list[Any] | None:
    """One value per row of text_input, or BadRequest: a request sends each optional input once per prompt."""
    if values is None:
        return None
    values = list(values)
    if len(values) != n_rows:
        raise BadRequest("bad_shape", f"{name} has {len(values)} rows but text_input has {n_rows}; "
                                      "send one value per prompt")
    return values


def parse_max_tokens(values: Iterable[int] | None, n_rows: int, limits: Limits) -> list[int | None]:
    """max_tokens per row (None when the input is absent: check_tokens gives the default once the prompt is known),
    each in 0..limit (0 only scores the prompt: model.py allows it with prompt_logprobs)."""
    rows = _per_row("max_tokens", None if values is None else [int(v) for v in values], n_rows)
    if rows is None:
        return [None] * n_rows
    cap = limits.max_tokens_cap
    for row, v in enumerate(rows):
        if not 0 <= v <= cap:
            why = ("deploy.max_new_tokens_limit" if limits.max_new_tokens_limit and cap == limits.max_new_tokens_limit
                   else f"the model's context of {limits.context} tokens less one for the prompt")
            raise BadRequest("bad_max_tokens", f"max_tokens[{row}] is {v}; it must be between 1 and {cap} ({why})")
    return rows


def parse_sampling(inputs: dict[str, Sequence[Any] | None], n_rows: int) -> list[Sampling]:
    """A Sampling per row from the optional temperature, top_p, top_k and seed inputs (greedy when all are absent)."""
    cols = {name: _per_row(name, inputs.get(name), n_rows) for name in SAMPLING_INPUTS}
    out = []
    for row in range(n_rows):
        v = {name: kind(col[row]) for name, kind in SAMPLING_INPUTS.items() if (col := cols[name]) is not None}
        checks = (("temperature", lambda t: math.isfinite(t) and t >= 0, "a number >= 0 (0 is greedy)"),
                  ("top_p", lambda p: 0 < p <= 1, "in (0, 1]"), ("top_k", lambda k: k >= 0, ">= 0 (0 keeps every token)"),
                  ("seed", lambda s: s >= 0, ">= 0"))
        for name, ok, rule in checks:
            if name in v and not ok(v[name]):
                raise BadRequest(f"bad_{name}", f"{name}[{row}] is {v[name]}; it must be {rule}")
        out.append(Sampling(**v))
    return out


def parse_stop(values: Sequence[Sequence[Any]] | None, n_rows: int) -> list[tuple[str, ...]]:
    """The stop strings of each row (none when the input is absent)."""
    rows = _per_row("stop", values, n_rows)
    if rows is None:
        return [()] * n_rows
    return [tuple(decode_text(v, None, row=row, name="stop") for v in row_values if v not in (b"", ""))
            for row, row_values in enumerate(rows)]


def load_rare_ids(folder: str | Path) -> frozenset[int]:
    """Token ids seen fewer than `min_count` times in the training data (see deploy/repository.py)."""
    path = Path(folder) / RARE_TOKENS_FILE
    if not path.is_file():
        return frozenset()
    return frozenset(int(i) for i in json.loads(path.read_text())["ids"])


def rare_token_rate(ids: Sequence[int], rare_ids: frozenset[int], unk_id: int | None) -> float:
    """Share of the prompt's tokens that are unknown or rare in training; 0.0 for no tokens."""
    if not ids:
        return 0.0
    n = sum(1 for i in ids if i == unk_id or i in rare_ids)
    return n / len(ids)


# vllm_backend's `sampling_parameters` input: one JSON object; the keys lmforge serves, and what each must be.
SAMPLING_PARAMETERS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int,
                       "stop": list, "logprobs": int, "prompt_logprobs": int, "ignore_eos": bool,
                       "structured_outputs": dict}
# vLLM's StructuredOutputsParams: one constraint per request, and the JSON type each takes (its whitespace options
# are the engine's, not a request's: components/serving/vllm_engine.py sets them).
STRUCTURED_OUTPUTS = {"json": (dict, str), "regex": (str,), "choice": (list,), "grammar": (str,)}
MAX_LOGPROBS = 20   # alternatives a request may ask for per token (vLLM's default max_logprobs)


def parse_sampling_parameters(raw: object | None) -> dict[str, Any]:
    """The `sampling_parameters` JSON string as {key: value} (stop always a list of strings), or BadRequest naming the
    key that is unknown or of the wrong type. None (the input is absent) is {}."""
    if raw is None:
        return {}
    text = decode_text(raw, None, name="sampling_parameters")
    try:
        params = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest("bad_sampling_parameters", f"sampling_parameters is not JSON ({e.msg} at character "
                                                     f"{e.pos}); send a JSON object such as {{\"max_tokens\": 16}}") from None
    if not isinstance(params, dict):
        raise BadRequest("bad_sampling_parameters", "sampling_parameters must be a JSON object, "
                                                     f"not {type(params).__name__}")
    out: dict[str, Any] = {}
    for key, value in params.items():
        kind = SAMPLING_PARAMETERS.get(key)
        if kind is None:
            raise BadRequest("bad_sampling_parameters", f"sampling_parameters.{key} is not served here; the keys are "
                                                         f"{', '.join(SAMPLING_PARAMETERS)}")
        if key == "stop" and isinstance(value, str):
            value = [value]
        if not _is_kind(value, kind):
            want = {list: "a list of strings", int: "an integer", bool: "true or false", dict: "a JSON object"}
            raise BadRequest("bad_sampling_parameters", f"sampling_parameters.{key} is {value!r}; it must be "
                                                         f"{want.get(kind, 'a number')}")
        out[key] = value if kind in (list, dict, bool) else kind(value)
    if "structured_outputs" in out:
        check_structured(out["structured_outputs"])
    return out


def _is_kind(value: object, kind: type) -> bool:
    if kind is list:
        return isinstance(value, list) and all(isinstance(s, str) for s in value)
    if kind in (bool, dict):
        return isinstance(value, kind)
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (kind is float or float(value).is_integer()))


def check_structured(spec: dict[str, Any]) -> None:
    """A structured-output constraint names exactly one of STRUCTURED_OUTPUTS, of its type; BadRequest otherwise."""
    keys = sorted(spec)
    if len(keys) != 1 or keys[0] not in STRUCTURED_OUTPUTS:
        raise BadRequest("bad_sampling_parameters", f"sampling_parameters.structured_outputs has {keys or 'no keys'}; "
                                                     f"give exactly one of {', '.join(STRUCTURED_OUTPUTS)} (as vLLM's "
                                                     "structured_outputs), e.g. {\"json\": {<a JSON schema>}}")
    key, value = keys[0], spec[keys[0]]
    ok = isinstance(value, STRUCTURED_OUTPUTS[key]) and (key != "choice" or all(isinstance(c, str) for c in value))
    if not ok:
        want = {"choice": "a list of strings", "json": "a JSON schema (an object)"}.get(key, "a string")
        raise BadRequest("bad_sampling_parameters", f"sampling_parameters.structured_outputs.{key} is {value!r}; "
                                                     f"it must be {want}")


class Settings(NamedTuple):
    """One request's settings: max_tokens (None: not said), sampling, stop strings, and how many alternatives to
    report per generated and per prompt token (None: no log-probabilities; vLLM's logprobs and prompt_logprobs)."""

    max_new: int | None
    sampling: Sampling
    stops: tuple[str, ...]
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    structured: dict[str, Any] | None = None   # one constraint of STRUCTURED_OUTPUTS


def request_settings(inputs: dict[str, list[Any] | None], sampling_parameters: object | None,
                     limits: Limits) -> Settings:
    """One request's Settings, from its individual inputs ({name: [value]}, stop: [[strings]]; None when absent) and
    its sampling_parameters JSON; a setting sent both ways is refused."""
    params = parse_sampling_parameters(sampling_parameters)
    both = sorted(k for k in params if inputs.get(k) is not None)
    if both:
        raise BadRequest("bad_sampling_parameters", f"{', '.join(both)} sent both as an input and in "
                                                     "sampling_parameters; send each setting once")

    def col(name: str) -> list[Any] | None:
        return inputs.get(name) if inputs.get(name) is not None else ([params[name]] if name in params else None)
    max_new = parse_max_tokens(col("max_tokens"), 1, limits)[0]
    sampling = parse_sampling({name: col(name) for name in SAMPLING_INPUTS}, 1)[0]
    top = {k: params.get(k) for k in ("logprobs", "prompt_logprobs")}
    for k, v in top.items():
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise BadRequest("bad_sampling_parameters", f"sampling_parameters.{k} is {v}; it must be between 0 and "
                                                         f"{MAX_LOGPROBS} (the alternatives reported per token)")
    if max_new == 0 and top["prompt_logprobs"] is None:
        raise BadRequest("bad_max_tokens", "max_tokens[0] is 0; it may be 0 only with prompt_logprobs (scoring the "
                                           "prompt); ask for at least 1 token")
    return Settings(max_new, sampling, parse_stop(col("stop"), 1)[0], top["logprobs"], top["prompt_logprobs"],
                    params.get("ignore_eos", False), params.get("structured_outputs"))


def is_well_formed(result: dict) -> str | None:
    """Why a generation result is malformed, or None when it is fine (used by the rollout gate)."""
    for key, kind in (("text_output", str), ("output_tokens", int), ("mean_logprob", float)):
        if not isinstance(result.get(key), kind):
            return f"{key} is missing or not {kind.__name__}"
    if result["output_tokens"] < 1:
        return "no tokens were generated"
    lp = result["mean_logprob"]
    if not math.isfinite(lp) or lp > 1e-6:
        return f"mean_logprob {lp} is not a finite log-probability"
    return None


def read_validation_prompts(version_dir: str | Path, n: int) -> list[str]:
    """The first n of a built version's validation prompts (held-out prompts of its task), cycled when n exceeds them."""
    path = Path(version_dir) / VALIDATION_FILE
    prompts = json.loads(path.read_text(encoding="utf-8"))["prompts"] if path.is_file() else []
    if not prompts:
        raise BadRequest("no_validation_prompts", f"{path} holds no prompts; rebuild the version from a model with "
                                                  "its dataset (lmforge run deploy)")
    return [prompts[i % len(prompts)] for i in range(n)]


# --- where the served model runs ---------------------------------------------------------

def serving_device(model: Any, instance_kind: str, device_id: int | str, cuda_available: bool) -> tuple[str, str]:
    """("cuda:<id>" or "cpu", why) for a Triton model instance of `instance_kind` ("GPU" | "CPU").

    A GPU instance runs a model whose kernels are CPU-only (an int8 variant) on the CPU: moved to
    the GPU, its first request would fail in `quantized::linear_dynamic`.
    """
    if instance_kind != "GPU":
        return "cpu", f"Triton instance kind {instance_kind}"
    if not cuda_available:
        return "cpu", "Triton instance kind GPU, but torch in this Python sees no CUDA device"
    from .modelload import cpu_only_kernels  # here: modelload imports torch; the rest is standard library only
    kernels = cpu_only_kernels(model)
    if kernels:
        return "cpu", (f"{', '.join(kernels)} {'is' if len(kernels) == 1 else 'are'} CPU-only: "
                       f"this GPU instance (device {device_id}) runs the model on the CPU")
    return f"cuda:{device_id}", f"Triton instance kind GPU, device {device_id}"
