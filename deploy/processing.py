"""Pre- and post-processing for the served model, importable without a server.

    limits = Limits(max_prompt_chars=2000, max_prompt_tokens=192, max_new_tokens=32, max_new_tokens_limit=128)
    text = decode_text(b"Once upon a time", limits)             # BadRequest("invalid_utf8" | "empty_prompt" | ...)
    ids = check_tokens(task.encode(tokenizer, task.parse_prompt(text)), limits)
    max_tokens = parse_max_tokens([16], 1, limits)              # [16]; BadRequest names the field and the row
    sampling = parse_sampling({"temperature": [0.7], "seed": [3]}, 1)   # [Sampling(temperature=0.7, seed=3)]
    stops = parse_stop([[b"\n\n"]], 1)                          # [("\n\n",)]
    rate = rare_token_rate(tokenizer(text)["input_ids"], rare_ids, unk_id)
    device, why = serving_device(model, "GPU", 0, torch.cuda.is_available())  # ("cpu", "quantized::... is CPU-only ...")

The Triton model (deploy/model.py) serves the LLM convention of Triton's own LLM backends (vLLM's,
TensorRT-LLM's): `text_input` in, `text_output` out, with optional `max_tokens`, `temperature`,
`top_p`, `top_k`, `seed`, `stop` and `exclude_input_in_output`. Every check here names the input
and the row it refuses, so a client can fix its request; the model answers it with a 400 and
generates the rest of its batch.

The Triton model runs inside the server's own Python, where lmforge is not installed: the
repository builder copies this file, components/generation.py, components/task.py,
components/modelload.py, components/data/records.py and components/requestlog.py into
`<version>/lmforge_runtime/`, hence the fallback imports. Standard library only (the generation
module imports torch only inside its functions).

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
from typing import Any

try:
    from lmforge.components.generation import Sampling
except ImportError:  # inside a Triton model version folder, beside a copy of generation.py
    from .generation import Sampling  # type: ignore[no-redef]

__all__ = ["BadRequest", "Limits", "check_tokens", "decode_text", "is_well_formed", "load_rare_ids",
           "parse_max_tokens", "parse_sampling", "parse_stop", "rare_token_rate", "serving_device",
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
    max_prompt_chars: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_new_tokens_limit: int


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
        raise BadRequest("prompt_too_long", f"{name}[{row}] has {len(text)} characters, more than the limit "
                                            f"{limits.max_prompt_chars}; shorten it")
    return text


def check_tokens(ids: Sequence[int], limits: Limits, *, row: int = 0) -> list[int]:
    if len(ids) > limits.max_prompt_tokens:
        raise BadRequest("prompt_too_long", f"text_input[{row}] is {len(ids)} tokens as the model's task renders it, "
                                            f"more than the limit {limits.max_prompt_tokens}; shorten it")
    return list(ids)


def _per_row(name: str, values: Sequence[Any] | None, n_rows: int) -> list[Any] | None:
    """One value per row of text_input, or BadRequest: a request sends each optional input once per prompt."""
    if values is None:
        return None
    values = list(values)
    if len(values) != n_rows:
        raise BadRequest("bad_shape", f"{name} has {len(values)} rows but text_input has {n_rows}; "
                                      "send one value per prompt")
    return values


def parse_max_tokens(values: Iterable[int] | None, n_rows: int, limits: Limits) -> list[int]:
    """max_tokens per row (the configured default when the input is absent), each in 1..limit."""
    rows = _per_row("max_tokens", None if values is None else [int(v) for v in values], n_rows)
    if rows is None:
        return [limits.max_new_tokens] * n_rows
    for row, v in enumerate(rows):
        if not 1 <= v <= limits.max_new_tokens_limit:
            raise BadRequest("bad_max_tokens", f"max_tokens[{row}] is {v}; it must be between 1 and "
                                               f"{limits.max_new_tokens_limit}")
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
    try:  # imported here: modelload imports torch, and the rest of this module is standard library only
        from lmforge.components.modelload import cpu_only_kernels
    except ImportError:  # inside the model repository's lmforge_runtime/
        from .modelload import cpu_only_kernels  # type: ignore[no-redef]
    kernels = cpu_only_kernels(model)
    if kernels:
        return "cpu", (f"{', '.join(kernels)} {'is' if len(kernels) == 1 else 'are'} CPU-only: "
                       f"this GPU instance (device {device_id}) runs the model on the CPU")
    return f"cuda:{device_id}", f"Triton instance kind GPU, device {device_id}"
