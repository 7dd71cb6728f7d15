"""A task: how a prompt is rendered, when generation stops and what is scored. One object for every stage.

    task = Task(kind="chat")                             # or "completion", or the demo's "docstring" preset
    ids = task.encode(tokenizer, [{"role": "user", "content": "Hi"}])   # the chat template + generation prompt
    ids = Task("completion").encode(tokenizer, "Once upon a time")       # [eos, *ids of the prompt as given]
    task.stop_strings                                    # generation ends at eos or at the first of these
    task.scored(generated_text)                          # what is compared with the reference
    task.example(record)                                 # (prompt, reference) of a held-out record, or None
    Task.load(model_dir)                                 # lmforge.json "task": the task travels with the model

Kinds:
- `completion`: the prompt as given, after an eos (every training document follows one); stop at eos or at
  `stop`; the whole completion is scored. A pair's prompt is its prompt; a plain document is split at a word
  boundary (the first `TEXT_PROMPT_WORDS` words prompt its next `TEXT_REFERENCE_WORDS` words).
- `chat`: the messages through the tokenizer's own chat template with the generation prompt; the assistant's
  turn is scored. A tokenizer without a chat template is an error (TaskError), never a silent fallback.
- `docstring`: the demo preset, code-to-text summarisation: a signature, then the docstring opening; stop at the
  docstring close; the first sentence is scored against the docstring's summary. With a tokenizer that has a chat
  template the bare signature is one user turn, as chat models read it.

`infer_kind(records)` follows the data for task.kind = "auto": a chat when a record holds messages, the
docstring preset when every record is shaped as one (the built-in corpus), else completion.

Imports only the standard library and records.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .records import DOC_CLOSE, DOC_OPEN, Record, extract_summary, generation_prompt, lm_text

KINDS = ("completion", "chat", "docstring")
META_FILE = "lmforge.json"  # a model folder's record (components/serving/modelload.py META); its "task" is the task
TEXT_PROMPT_WORDS = 24
TEXT_REFERENCE_WORDS = 24
_WORD = re.compile(r"\S+")

Messages = list[dict[str, str]]
Prompt = str | Messages


class TaskError(ValueError):
    """A prompt or tokenizer the task cannot use; the message says what to change."""


@dataclass(frozen=True)
class Task:
    kind: str = "completion"
    stop: tuple[str, ...] = ()     # stop sequences beyond eos (the docstring preset adds its close)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TaskError(f"task kind {self.kind!r} is unknown; use one of {', '.join(KINDS)}")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    # --- rendering --------------------------------------------------------------------------
    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (DOC_CLOSE, *self.stop) if self.kind == "docstring" else self.stop

    def stops(self, tokenizer: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(stop strings, end ids) of this task's answers with `tokenizer`, beyond eos: `stop_strings`, and a chat
        template's end-of-turn marker (`turn_end`): an end id when it is one special token (decoded text skips
        those), else a stop string (a ChatML template on a tokenizer without <|im_end|> as a token writes it as
        text). The same rule in evaluation, the pyfunc and serving; SFT's targets end with the marker already
        (`answer` renders the template's assistant turn)."""
        marker = self.turn_end(tokenizer)
        if not marker:
            return self.stop_strings, ()
        ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] in set(tokenizer.all_special_ids):
            return self.stop_strings, (ids[0],)
        return (*self.stop_strings, marker), ()

    def turn_end(self, tokenizer: Any) -> str:
        """What the chat template writes after an assistant message, stripped ("<|im_end|>", "<end_of_turn>"); ""
        for a task without a template, or a template that writes nothing there."""
        if not self.uses_template(tokenizer):
            return ""
        probe = "lmforge-turn-probe"
        whole = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": probe}], tokenize=False)
        return whole[whole.rfind(probe) + len(probe):].strip() if probe in whole else ""

    def messages(self, prompt: Prompt) -> Messages:
        """A chat prompt as messages: a list is taken as it is, a string is one user turn."""
        if isinstance(prompt, list):
            return prompt
        text = prompt.removesuffix(DOC_OPEN).strip() if self.kind == "docstring" else prompt
        return [{"role": "user", "content": text}]

    def uses_template(self, tokenizer: Any) -> bool:
        """Whether prompts go through the tokenizer's chat template (chat, or the preset on a chat tokenizer)."""
        has = bool(getattr(tokenizer, "chat_template", None))
        if self.kind == "chat" and not has:
            raise TaskError(f"task kind 'chat' needs a tokenizer with a chat template, and "
                            f"{getattr(tokenizer, 'name_or_path', '') or 'this tokenizer'} has none; give the base a "
                            "chat template (tokenizer_config.json 'chat_template') or set task.kind = \"completion\"")
        return has and self.kind != "completion"

    def text(self, tokenizer: Any, prompt: Prompt) -> str:
        """The prompt as the model reads it, before tokenisation (without the leading eos of plain prompts)."""
        if self.uses_template(tokenizer):
            return tokenizer.apply_chat_template(self.messages(prompt), add_generation_prompt=True, tokenize=False)
        if isinstance(prompt, list):
            raise TaskError(f"task kind {self.kind!r} takes a prompt string, not a list of messages; "
                            "set task.kind = \"chat\" for messages")
        return self.plain(prompt)

    def plain(self, prompt: str) -> str:
        """A string prompt as written before any chat template: the preset adds the docstring opening."""
        if self.kind == "docstring":
            return prompt if prompt.endswith(DOC_OPEN) else generation_prompt(prompt.strip())
        return prompt

    def encode(self, tokenizer: Any, prompt: Prompt, *, max_tokens: int | None = None) -> list[int]:
        """The prompt's ids, cut from the left to `max_tokens` when given: a template's rendering, or
        [eos, *ids of the prompt] (every training document follows an eos; a prompt that starts with one, as a
        benchmark harness's rendered context may, is not given a second)."""
        text = self.text(tokenizer, prompt)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not self.uses_template(tokenizer):
            eos = tokenizer.eos_token_id
            assert eos is not None, "the tokenizer defines an eos token"
            ids = ids if ids[:1] == [eos] else [eos, *ids]
        return ids[-max_tokens:] if max_tokens else ids

    def answer(self, tokenizer: Any, prompt: Prompt, completion: str) -> list[int]:
        """The ids that follow `encode(prompt)` in a fine-tuning example: the completion and the stop rule
        (the docstring close, then eos), or what the chat template adds for an assistant turn."""
        eos = tokenizer.eos_token_id
        if not self.uses_template(tokenizer):
            close = DOC_CLOSE if self.kind == "docstring" else ""
            return [*tokenizer(completion + close, add_special_tokens=False)["input_ids"], eos]
        turns = self.messages(prompt)
        opening = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        whole = tokenizer.apply_chat_template([*turns, {"role": "assistant", "content": completion}], tokenize=False)
        if not whole.startswith(opening):
            raise TaskError(f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'} renders "
                            "an assistant turn that does not continue its own generation prompt; give the base a "
                            "template whose add_generation_prompt output is a prefix of the full conversation (as "
                            "Llama, Qwen and Mistral chat templates are)")
        ids = tokenizer(whole[len(opening):], add_special_tokens=False)["input_ids"]
        return ids if eos in ids else [*ids, eos]

    def parse_prompt(self, text: str) -> Prompt:
        """A prompt sent as text (a Triton text_input, a pyfunc row, a CLI argument): for a chat task, a JSON list
        of {role, content} messages is the chat; any other text is one user turn (or the prompt as given)."""
        if self.kind == "chat" and text.lstrip().startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                return text
            if is_messages(value):
                return [{"role": m["role"], "content": m["content"]} for m in value]
        return text

    def probe_prompt(self) -> str:
        """A prompt of this task's form, as text, for a smoke test when no held-out prompt is at hand."""
        return {"docstring": "def add(a, b):", "chat": '[{"role": "user", "content": "Hello"}]'}.get(self.kind, "The")

    def prompt_as_text(self, prompt: Prompt) -> str:
        """A prompt as a client sends it (parse_prompt's inverse): a chat's messages as JSON, a string as is."""
        return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)

    # --- scoring ----------------------------------------------------------------------------
    def scored(self, generated: str) -> str:
        """What of a generation is compared with the reference: the docstring's first sentence, or all of it."""
        return extract_summary(generated) if self.kind == "docstring" else generated.strip()

    def example(self, record: Record) -> tuple[Prompt, str] | None:
        """(prompt, reference) of a held-out record under this task, or None when it has none."""
        if self.kind == "chat":
            turns = record.turns
            return (turns[:-1], turns[-1]["content"]) if turns else None
        if self.kind == "docstring" or record.signature:
            return (record.signature, record.summary) if record.summary.strip() else None
        return split_document(record.text)

    # --- travelling with the model ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "stop": list(self.stop)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Task":
        return cls(kind=str(d["kind"]), stop=tuple(d.get("stop", ())))

    @classmethod
    def load(cls, folder: Path | str, *, default: "Task | None" = None) -> "Task":
        """The task recorded in a model folder's lmforge.json (training writes it; a compressed variant and an ONNX
        export carry it on); `default` when the folder records none (a base model), else the docstring preset, the
        task of every model lmforge exported before tasks were recorded."""
        path = Path(folder) / META_FILE
        saved = json.loads(path.read_text(encoding="utf-8")).get("task") if path.is_file() else None
        if saved:
            return cls.from_dict(saved)
        return default if default is not None else cls("docstring")


DEMO = Task("docstring")


def is_messages(value: Any) -> bool:
    """Whether `value` is a non-empty list of {role, content} objects with string values (a chat's messages)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def split_document(text: str) -> tuple[str, str] | None:
    """(the first TEXT_PROMPT_WORDS words, as written; the next TEXT_REFERENCE_WORDS, on one line), or None when the
    document is too short to have both (fewer than two words)."""
    words = list(_WORD.finditer(text))
    if len(words) < 2:
        return None
    cut = min(TEXT_PROMPT_WORDS, len(words) // 2)
    prompt = text[: words[cut - 1].end()]
    reference = " ".join(m.group() for m in words[cut: cut + TEXT_REFERENCE_WORDS])
    return prompt, reference


def record_kind(record: Record) -> str:
    """The kind a record's shape implies: chat (messages), docstring (a signature and its docstring), completion."""
    if record.messages:
        return "chat"
    if record.signature and record.text == lm_text(record.signature, record.docstring):
        return "docstring"
    return "completion"


def infer_kind(records: Iterable[Record]) -> str:
    """The task the data implies: chat if any record is one, docstring if all are, else completion."""
    kinds = {record_kind(r) for r in records}
    if "chat" in kinds:
        return "chat"
    return "docstring" if kinds == {"docstring"} else "completion"


# --- does a task fit the data? --------------------------------------------------------------
SHAPES = {"chat": "chats (records with messages)", "docstring": "signature/docstring pairs",
          "pair": "prompt/completion pairs", "document": "documents (text with no prompt)"}
USES = {"chat": ("chat",), "docstring": ("docstring", "pair"), "completion": ("docstring", "pair", "document")}


def record_shape(record: Record) -> str:
    """What a record holds: a chat (messages), a docstring pair (the built-in corpus's shape), a prompt/completion
    pair, or a document with no prompt (one of SHAPES)."""
    if record.messages:
        return "chat"
    if record.signature:
        return "docstring" if record.text == lm_text(record.signature, record.docstring) else "pair"
    return "document"


def shapes_kind(shapes: dict[str, int]) -> str:
    """infer_kind over counted shapes: chat if any record is one, docstring if all are, else completion."""
    held = {s for s, n in shapes.items() if n}
    if "chat" in held:
        return "chat"
    return "docstring" if held == {"docstring"} else "completion"


def misfit(kind: str, shapes: dict[str, int]) -> str | None:
    """Why a task of `kind` cannot use records of these counted shapes, in words; None when it fits.

    A chat task needs chats (the others have no turns to render; a mix is a chat dataset, as infer_kind says); a
    docstring or completion task cannot render a chat's messages; the docstring preset needs records with a prompt
    (a document has none: a corpus of only documents gives it nothing to learn or score)."""
    held = {s: n for s, n in shapes.items() if n}
    unusable = [s for s in held if s not in USES[kind]]
    if not held or not unusable or "chat" not in unusable and any(s in USES[kind] for s in held):
        return None
    said = ", ".join(f"{n} {SHAPES[s]}" for s, n in sorted(held.items()))
    why = "needs chats (messages)" if kind == "chat" else "cannot render " + " or ".join(
        SHAPES[s].split(" (")[0] for s in unusable)
    return f"does not fit the records: they hold {said}, and a {kind} task {why}"
