"""Pre- and post-processing for the served model, importable without a server.

    limits = Limits(max_prompt_chars=2000, max_prompt_tokens=192, max_new_tokens=32, max_new_tokens_limit=128)
    signature = decode_prompt(b"def foo(x):", limits)          # BadRequest("invalid_utf8" | "empty_prompt" | ...)
    text = build_prompt(signature)                              # the template of components/generation.py
    ids = check_tokens(tokenizer(text)["input_ids"], limits)
    rate = rare_token_rate(tokenizer(signature)["input_ids"], rare_ids, unk_id)
    summary = extract_summary(completion)                       # what is scored and returned
    device, why = serving_device(model, "GPU", 0, torch.cuda.is_available())  # ("cpu", "quantized::... is CPU-only ...")

The Triton model (deploy/model.py) runs inside the server's own Python, where lmforge
is not installed: the repository builder copies this file, components/generation.py,
components/modelload.py, components/data/records.py and components/requestlog.py into
`<version>/lmforge_runtime/`, hence the fallback imports. Standard library only (the
generation module imports torch only inside its functions).

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
    from lmforge.components.data.records import extract_summary, generation_prompt
    from lmforge.components.generation import prompt_text
except ImportError:  # inside a Triton model version folder, beside copies of records.py and generation.py
    from .generation import prompt_text  # type: ignore[no-redef]
    from .records import extract_summary, generation_prompt  # type: ignore[no-redef]

__all__ = ["BadRequest", "Limits", "build_prompt", "check_tokens", "decode_prompt",
           "extract_summary", "generation_prompt", "is_well_formed", "load_rare_ids", "parse_max_new_tokens",
           "rare_token_rate", "serving_device", "VALIDATION_PROMPTS", "validation_prompts"]

RARE_TOKENS_FILE = "rare_tokens.json"

# Fixed prompts the rollout gate sends to a new version: signatures in the style of the corpus.
VALIDATION_PROMPTS: tuple[str, ...] = (
    "def dumps(obj, *, skipkeys=False, ensure_ascii=True, indent=None):",
    "def join(a, *p):",
    "def getsource(object):",
    "def create_connection(address, timeout=None, source_address=None):",
    "class OrderedDict(dict):",
    "def literal_eval(node_or_string):",
    "def urlsplit(url, scheme='', allow_fragments=True):",
    "def sha256(data=b''):",
    "def loads(s, *, cls=None, object_hook=None, parse_float=None):",
    "def splitext(p):",
    "def getmembers(object, predicate=None):",
    "def dedent(text):",
    "def deepcopy(x, memo=None, _nil=[]):",
    "def urlencode(query, doseq=False, safe='', encoding=None, errors=None):",
    "class Counter(dict):",
    "def b64encode(s, altchars=None):",
    "def gethostbyname(host):",
    "def fnmatch(name, pat):",
    "def dump(obj, fp, *, skipkeys=False, indent=None):",
    "def shuffle(self, x):",
)


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


def decode_prompt(raw: object, limits: Limits, *, row: int = 0, name: str = "PROMPT") -> str:
    """A prompt element (bytes from a BYTES tensor, or str) as text, or BadRequest saying what is wrong."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest("invalid_utf8", f"{name}[{row}] is not valid UTF-8 (byte {e.start}); "
                                             "send the prompt as UTF-8 text") from None
    elif isinstance(raw, str):
        text = raw
    else:
        raise BadRequest("bad_type", f"{name}[{row}] is {type(raw).__name__}, expected a string")
    if "\x00" in text:
        raise BadRequest("control_chars", f"{name}[{row}] contains a NUL character; remove it")
    if not text.strip():
        raise BadRequest("empty_prompt", f"{name}[{row}] is empty; send a signature such as 'def foo(x):'")
    if len(text) > limits.max_prompt_chars:
        raise BadRequest("prompt_too_long", f"{name}[{row}] has {len(text)} characters, more than the limit "
                                            f"{limits.max_prompt_chars}; shorten it")
    return text


def build_prompt(signature: str) -> str:
    """The generation prompt for `signature` (components/generation.py's template)."""
    return prompt_text(signature)


def check_tokens(ids: Sequence[int], limits: Limits, *, row: int = 0) -> list[int]:
    if len(ids) > limits.max_prompt_tokens:
        raise BadRequest("prompt_too_long", f"PROMPT[{row}] is {len(ids)} tokens with its template, more than the "
                                            f"limit {limits.max_prompt_tokens}; shorten it")
    return list(ids)


def parse_max_new_tokens(values: Iterable[int] | None, n_rows: int, limits: Limits) -> list[int]:
    """MAX_NEW_TOKENS per row (the configured default when the input is absent), each in 1..limit."""
    if values is None:
        return [limits.max_new_tokens] * n_rows
    values = [int(v) for v in values]
    if len(values) != n_rows:
        raise BadRequest("bad_shape", f"MAX_NEW_TOKENS has {len(values)} rows but PROMPT has {n_rows}; "
                                      "send one value per prompt")
    for row, v in enumerate(values):
        if not 1 <= v <= limits.max_new_tokens_limit:
            raise BadRequest("bad_max_new_tokens", f"MAX_NEW_TOKENS[{row}] is {v}; it must be between 1 and "
                                                   f"{limits.max_new_tokens_limit}")
    return values


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
    for key, kind in (("summary", str), ("completion", str), ("output_tokens", int), ("mean_logprob", float)):
        if not isinstance(result.get(key), kind):
            return f"{key} is missing or not {kind.__name__}"
    if result["output_tokens"] < 1:
        return "no tokens were generated"
    lp = result["mean_logprob"]
    if not math.isfinite(lp) or lp > 1e-6:
        return f"mean_logprob {lp} is not a finite log-probability"
    if result["summary"] != extract_summary(result["completion"]):
        return "summary does not match the completion"
    return None


def validation_prompts(n: int) -> list[str]:
    """The first n fixed prompts, cycled when n exceeds the list."""
    return [VALIDATION_PROMPTS[i % len(VALIDATION_PROMPTS)] for i in range(n)]


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
