"""Validation with quarantine: every raw item becomes a clean Record or a Quarantined entry.

    result = validate_items(ingested.items, cfg.validation)     # cfg: DataConfig
    result.clean          # list[Kept]: Record + where it came from
    result.quarantined    # list[Quarantined]: the whole raw record, its source, line and reason
    result.counts()       # {"docs_in", "clean", "quarantined", "quarantined_by_reason"}
    validate_lines([b'{"text": "ok"}', b"\\xff"], ValidationConfig())   # JSONL lines, for tests and tools
    judge(item, cfg.validation)   # one item: a Record, or a Quarantined entry (no duplicate_id check)
    judge_for_cleaning(item, cfg.validation)  # (Record without its derived summary, Derived), or Quarantined

A user record (JSONL line, CSV row, Parquet row) comes in one of three shapes; the field names
are ValidationConfig's (text_field, prompt_field, completion_field, messages_field, ...):

    {"text": "...", "prompt": "...", "reference": "..."}    a document; prompt and reference optional
    {"prompt": "...", "completion": "..."}                    a supervised fine-tuning pair
    {"messages": [{"role": "user", "content": "..."},         a chat: the roles are system, user and
                  {"role": "assistant", "content": "..."}]}   assistant; the last turn is the assistant's

A record with a text field is a document, whatever else it holds (an empty text cell of a CSV
row that holds a completion or messages counts as no text field). Otherwise messages, then
prompt + completion. A chat's completion is its last turn, which must be the assistant's, with
at least one user turn before it; its prompt is the turns before the last: the content of the
single user turn as is when that is all there is, else each turn as "<role>: <content>", joined
with "\\n". A pair (either shape) becomes Record(signature=prompt, docstring=completion,
summary=completion, text=prompt + "\\n" + completion), a chat with its turns in `messages`; id and group
as for a document. A CSV
messages cell is the list as a JSON string (decoded here; not JSON: invalid_json); Parquet may
hold the list itself.

Reason codes: invalid_utf8, invalid_json, control_chars, empty, too_long, missing_field,
wrong_type, duplicate_id, and from the readers blank_line, column_count, invalid_csv (a \\r outside
quotes in a CSV row), unparseable_file.
Records in = clean + quarantined, always.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lmforge.components.data.ingest import RawItem
from lmforge.components.data.quarantine import Quarantined, quarantine_entry
from lmforge.components.sections.data import ValidationConfig
from lmforge.components.serving.records import Record, first_sentence, lm_text, stable_id

REASONS = ("invalid_utf8", "invalid_json", "control_chars", "empty", "too_long", "missing_field", "wrong_type", "duplicate_id",
           "blank_line", "column_count", "invalid_csv", "unparseable_file")

# C0/C1 controls except tab, newline, carriage return and form feed (which source code uses as a page break)
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_BAD_CHAR = re.compile(r"[\ud800-\udfff\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")  # either: one scan of a good field


@dataclass(frozen=True)
class Derived:
    """Which fields of a judged Record were built from its other fields, as clean_record would find out by comparing.

    text: text is lm_text(signature, docstring) (a built-in docstring record; never a document or a pair).
    summary: True when the summary is (or, with summarise=False, is to be) first_sentence(docstring); None when
    only a comparison can tell (a reference the user gave, a pair's completion).
    """

    text: bool
    summary: bool | None


@dataclass(frozen=True)
class Kept:
    record: Record
    origin: str
    mtime: float


class Bad(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass
class ValidationResult:
    clean: list[Kept]
    quarantined: list[Quarantined]

    def counts(self) -> dict[str, Any]:
        by_reason = Counter(q.reason for q in self.quarantined)
        return {"docs_in": len(self.clean) + len(self.quarantined), "clean": len(self.clean),
                "quarantined": len(self.quarantined), "quarantined_by_reason": dict(sorted(by_reason.items()))}


def judge(item: RawItem, cfg: ValidationConfig) -> Record | Quarantined:
    """The Record for one raw item, or its quarantine entry (the whole raw record and the reason)."""
    judged = judge_for_cleaning(item, cfg, summarise=True)
    return judged if isinstance(judged, Quarantined) else judged[0]


def judge_for_cleaning(item: RawItem, cfg: ValidationConfig, *,
                       summarise: bool = False) -> tuple[Record, Derived] | Quarantined:
    """As judge, for a record that goes straight to clean_record(record, derived): a derived summary is left ""
    (cleaning derives it from the cleaned docstring; summarise=True fills it), and Derived says what was derived."""
    try:
        if item.error is not None:
            raise Bad(*item.error)
        return _to_record(item, cfg, summarise)
    except Bad as bad:
        return quarantine_entry(item, bad.reason, bad.detail)


def validate_items(items: Iterable[RawItem], cfg: ValidationConfig) -> ValidationResult:
    clean: list[Kept] = []
    quarantined: list[Quarantined] = []
    seen_ids: dict[str, str] = {}
    for item in items:
        judged = judge(item, cfg)
        if isinstance(judged, Quarantined):
            quarantined.append(judged)
        elif judged.id in seen_ids:
            quarantined.append(quarantine_entry(item, "duplicate_id", f"id {judged.id!r} already used by {seen_ids[judged.id]}"))
        else:
            seen_ids[judged.id] = item.origin
            clean.append(Kept(judged, item.origin, item.mtime))
    return ValidationResult(clean, quarantined)


def validate_lines(lines: Iterable[bytes], cfg: ValidationConfig, *, name: str = "<lines>") -> ValidationResult:
    return validate_items((RawItem(f"{name}:{n}", line, 0.0, source=name, line=n, raw=line,
                                   error=None if line.strip() else ("blank_line", "a blank line holds no record"))
                           for n, line in enumerate(lines, 1)), cfg)


def to_record(item: RawItem, cfg: ValidationConfig) -> Record:
    """The Record for one raw item, or Bad(reason, detail)."""
    return _to_record(item, cfg, True)[0]


def _to_record(item: RawItem, cfg: ValidationConfig, summarise: bool) -> tuple[Record, Derived]:
    fields = _decode(item.payload)
    if item.kind == "docstring":
        return _docstring_record(fields, cfg, summarise)
    return _document_record(fields, item.origin, cfg, summarise)


def parse_json(text: str, prefix: str = "") -> Any:
    """The JSON value `text` holds, or Bad("invalid_json") whose detail is `prefix` and where the parse failed."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise Bad("invalid_json", f"{prefix}{e.msg} at column {e.colno}") from None


def _decode(payload: bytes | dict[str, Any]) -> dict[str, Any]:
    if isinstance(payload, bytes):
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Bad("invalid_utf8", f"byte {e.start}: {e.reason}") from None
        obj = parse_json(text)
        if not isinstance(obj, dict):
            raise Bad("wrong_type", f"a line must hold a JSON object, not {type(obj).__name__}")
        return obj
    out = {}
    for key, value in payload.items():
        if isinstance(value, (bytes, bytearray)):
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError as e:
                raise Bad("invalid_utf8", f"field {key!r} byte {e.start}: {e.reason}") from None
        out[key] = value
    return out


def _check_text(name: str, value: str, cfg: ValidationConfig, *, required: bool) -> None:
    if m := _BAD_CHAR.search(value):  # a surrogate anywhere is reported before a control character
        if s := _SURROGATE.search(value, m.start()):
            raise Bad("invalid_utf8", f"field {name!r} holds undecodable data at character {s.start()}")
        raise Bad("control_chars", f"field {name!r} holds control character {m.group()!r} at {m.start()}")
    if required and (not value or value.isspace()):  # what `not value.strip()` says, without the copy
        raise Bad("empty", f"field {name!r} is empty or only whitespace")
    if len(value) > cfg.max_chars:
        raise Bad("too_long", f"field {name!r} has {len(value)} characters, more than validation.max_chars={cfg.max_chars}")


def _optional_str(fields: dict[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise Bad("wrong_type", f"field {name!r} must be a string, not {type(value).__name__}")
    return str(value)


def _document_record(fields: dict[str, Any], origin: str, cfg: ValidationConfig,
                     summarise: bool = True) -> tuple[Record, Derived]:
    text = fields.get(cfg.text_field)
    if text is None or (text == "" and any(fields.get(f) not in (None, "") for f in (cfg.completion_field,
                                                                                      cfg.messages_field))):
        return _pair_record(fields, origin, cfg), Derived(text=False, summary=None)
    if not isinstance(text, str):
        raise Bad("wrong_type", f"field {cfg.text_field!r} must be a string, not {type(text).__name__}")
    rid, prompt, reference, group = (_optional_str(fields, f) for f in
                                     (cfg.id_field, cfg.prompt_field, cfg.reference_field, cfg.group_field))
    _check_text(cfg.text_field, text, cfg, required=True)
    for name, value in ((cfg.id_field, rid), (cfg.prompt_field, prompt), (cfg.reference_field, reference),
                        (cfg.group_field, group)):
        if value is not None:
            _check_text(name, value, cfg, required=False)
    rid = rid if rid is not None else stable_id(origin)
    summary = reference if reference is not None else first_sentence(text) if summarise else ""
    record = Record(id=rid, source=origin.rsplit(":", 1)[0], module=group if group is not None else rid,
                    qualname=rid, signature=prompt or "", docstring=text, summary=summary, text=text)
    return record, Derived(text=False, summary=True if reference is None else None)


def _docstring_record(fields: dict[str, Any], cfg: ValidationConfig, summarise: bool = True) -> tuple[Record, Derived]:
    for name in ("source", "module", "qualname", "signature", "docstring"):
        if not isinstance(fields.get(name), str):
            raise Bad("missing_field", f"docstring record without {name!r}")
    _check_text("docstring", fields["docstring"], cfg, required=True)
    _check_text("signature", fields["signature"], cfg, required=False)
    parts = {k: fields[k] for k in ("source", "module", "qualname", "signature", "docstring")}
    record = Record.from_parts(**parts) if summarise else Record(
        id=stable_id(parts["source"], parts["module"], parts["qualname"]), **parts, summary="",
        text=lm_text(parts["signature"], parts["docstring"]))
    if len(record.text) > cfg.max_chars:
        raise Bad("too_long", f"text has {len(record.text)} characters, more than validation.max_chars={cfg.max_chars}")
    return record, Derived(text=True, summary=True)


_ROLES = ("system", "user", "assistant")


def _shapes(cfg: ValidationConfig) -> str:
    return (f'a record needs {{"{cfg.text_field}": ...}}, {{"{cfg.prompt_field}": ..., "{cfg.completion_field}": ...}} '
            f'or {{"{cfg.messages_field}": [{{"role": ..., "content": ...}}, ...]}}')


def _pair_record(fields: dict[str, Any], origin: str, cfg: ValidationConfig) -> Record:
    """A supervised fine-tuning pair (a chat or a prompt and a completion) as a Record, or Bad."""
    messages = fields.get(cfg.messages_field)
    prompt, completion, turns = (_chat_pair(messages, cfg) if messages not in (None, "")
                                 else (*_prompt_completion(fields, cfg), ""))
    rid, group = _optional_str(fields, cfg.id_field), _optional_str(fields, cfg.group_field)
    for name, value in ((cfg.id_field, rid), (cfg.group_field, group)):
        if value is not None:
            _check_text(name, value, cfg, required=False)
    text = f"{prompt}\n{completion}"
    if len(text) > cfg.max_chars:
        raise Bad("too_long", f"prompt and completion have {len(text)} characters together, more than "
                              f"validation.max_chars={cfg.max_chars}")
    key = rid if rid is not None else stable_id(origin)
    return Record(id=key, source=origin.rsplit(":", 1)[0], module=group if group is not None else key,
                  qualname=key, signature=prompt, docstring=completion, summary=completion, text=text, messages=turns)


def _prompt_completion(fields: dict[str, Any], cfg: ValidationConfig) -> tuple[str, str]:
    """(prompt, completion) of a record with both fields, or Bad."""
    prompt, completion = fields.get(cfg.prompt_field), fields.get(cfg.completion_field)
    if prompt is None and completion is None:
        raise Bad("missing_field", f"no {cfg.text_field!r}, {cfg.prompt_field!r} + {cfg.completion_field!r} or "
                                   f"{cfg.messages_field!r} field (has {sorted(fields)[:8]}): {_shapes(cfg)}")
    both: list[str] = []
    for name, value, other in ((cfg.prompt_field, prompt, cfg.completion_field),
                               (cfg.completion_field, completion, cfg.prompt_field)):
        if value is None:
            raise Bad("missing_field", f"field {other!r} without {name!r} (and no {cfg.text_field!r} or "
                                       f"{cfg.messages_field!r}): {_shapes(cfg)}")
        if not isinstance(value, str):
            raise Bad("wrong_type", f"field {name!r} must be a string, not {type(value).__name__}")
        _check_text(name, value, cfg, required=True)
        both.append(value)
    return both[0], both[1]


def _chat_pair(messages: Any, cfg: ValidationConfig) -> tuple[str, str, str]:
    """(prompt, completion, turns) of a chat: the completion is the last turn (the assistant's); the prompt is the
    turns before it: a lone user turn's content as is, else each turn as "<role>: <content>", joined with "\\n";
    turns is the whole chat as JSON text (Record.messages), which a chat task renders with the chat template."""
    name = cfg.messages_field
    if isinstance(messages, str):  # a CSV cell (or a JSON string in any format): the list as JSON
        messages = parse_json(messages, f"field {name!r} is not a JSON list: ")
    if not isinstance(messages, list):
        raise Bad("wrong_type", f"field {name!r} must be a list of {{role, content}} objects, not {type(messages).__name__}")
    turns: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            what = f"an object with keys {sorted(m)[:8]}" if isinstance(m, dict) else type(m).__name__
            raise Bad("wrong_type", f"{where} must be an object with 'role' and 'content', not {what}")
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or role not in _ROLES:
            raise Bad("wrong_type", f"{where} has role {role!r}; a role is one of {', '.join(_ROLES)}")
        if not isinstance(content, str):
            raise Bad("wrong_type", f"{where} content must be a string, not {type(content).__name__}")
        _check_text(f"{where}.content", content, cfg, required=False)
        turns.append((role, content))
    if not turns or turns[-1][0] != "assistant":
        last = f"its last message ({name}[{len(turns) - 1}]) is from {turns[-1][0]!r}" if turns else "it is empty"
        raise Bad("missing_field", f"field {name!r} must end with the assistant's reply (the completion), but {last}")
    *context, (_, completion) = turns
    if not any(role == "user" for role, _ in context):
        raise Bad("missing_field", f"field {name!r} has no 'user' message before the assistant's reply "
                                   f"({name}[{len(turns) - 1}])")
    if not completion.strip():
        raise Bad("empty", f"{name}[{len(turns) - 1}] (the assistant's reply, the completion) is empty or only whitespace")
    if not any(content.strip() for _, content in context):
        raise Bad("empty", f"the messages before the assistant's reply in field {name!r} (the prompt) are empty "
                           "or only whitespace")
    whole = json.dumps([{"role": role, "content": content} for role, content in turns], ensure_ascii=False)
    if len(context) == 1:
        return context[0][1], completion, whole
    return "\n".join(f"{role}: {content}" for role, content in context), completion, whole
