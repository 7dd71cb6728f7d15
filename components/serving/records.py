"""The record every stage passes around, and the text formats built from it.

    r = Record.from_parts(source="stdlib", module="json", qualname="dumps",
                          signature="def dumps(obj, *, indent=None)", docstring="Serialize obj ...")
    r.text                        # the language-modelling document
    r.prompt, r.completion, r.reference, r.turns   # what every task reads (see below)
    read_records(ds / "records" / "train.jsonl")   # list[Record]
    generation_prompt(r.signature)  # what the model is given for code-to-text summarisation
    extract_summary(generated)      # what is scored against r.summary

A record is what every task reads: `prompt`, `completion`, `reference` (what a generation is scored
against), `text` (the language-modelling document) and, for a chat, `turns` (its messages, the last one the
assistant's reply). They are stored under the demo's names, which is what the built-in corpus fills:
prompt = `signature`, completion = `docstring`, reference = `summary`; `messages` (the chat's turns as JSON
text) is stored only when a record has them, so a dataset without chats reads and hashes as before.
components/serving/task.py says how each task renders, stops and scores them.

The language-modelling document puts the docstring right after the signature, as in
source code, so that a model trained on `text` learns to continue
`generation_prompt(signature)` with the docstring; its first sentence is the summary.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass
from typing import Any

DOC_OPEN = '\n    """'
DOC_CLOSE = '"""'

_SENTENCE_END = re.compile(r"(?<=[.!?])\s|\n\s*\n")


def first_sentence(docstring: str) -> str:
    """The first sentence (or first paragraph, if shorter) of a docstring, on one line."""
    text = docstring.strip()
    m = _SENTENCE_END.search(text)
    head = text[: m.start()] if m else text
    return " ".join(head.split())


def generation_prompt(signature: str) -> str:
    return f"{signature}{DOC_OPEN}"


def lm_text(signature: str, docstring: str) -> str:
    return f"{generation_prompt(signature)}{docstring}{DOC_CLOSE}\n"


def extract_summary(generated: str) -> str:
    """The summary from a model's continuation of `generation_prompt`: up to the docstring's end, first sentence."""
    return first_sentence(generated.split(DOC_CLOSE, 1)[0])


def stable_id(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:16]


@dataclass(frozen=True)
class Record:
    id: str
    source: str
    module: str
    qualname: str
    signature: str
    docstring: str
    summary: str
    text: str
    messages: str = ""     # a chat's turns, as JSON text ([{"role", "content"}, ...]); "" for other records

    @property
    def prompt(self) -> str:
        return self.signature

    @property
    def completion(self) -> str:
        return self.docstring

    @property
    def reference(self) -> str:
        return self.summary

    @property
    def turns(self) -> list[dict[str, str]]:
        """A chat's messages, the assistant's reply last; [] for a record that is no chat."""
        import json

        return json.loads(self.messages) if self.messages else []

    @classmethod
    def from_parts(cls, *, source: str, module: str, qualname: str, signature: str, docstring: str) -> "Record":
        return cls(
            id=stable_id(source, module, qualname),
            source=source,
            module=module,
            qualname=qualname,
            signature=signature,
            docstring=docstring,
            summary=first_sentence(docstring),
            text=lm_text(signature, docstring),
        )

    def to_dict(self) -> dict[str, Any]:
        return stored(asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Record":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d or k not in OPTIONAL})


FIELDS = tuple(Record.__dataclass_fields__)
OPTIONAL = ("messages",)  # written only when set


def stored(d: dict[str, Any]) -> dict[str, Any]:
    """A record's dict as it is written: without the optional fields it leaves empty."""
    return {k: v for k, v in d.items() if k not in OPTIONAL or v}


def read_records(path: Any) -> list[Record]:
    """The records of a dataset's records/<split>.jsonl."""
    import json

    with open(path, encoding="utf-8", newline="\n") as f:  # one record a \n-ended line, whatever else it holds
        return [Record.from_dict(json.loads(line)) for line in f if line.strip()]
