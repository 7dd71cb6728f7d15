"""Cleaning: Unicode NFC and whitespace, applied to every text field of a record.

    clean_text("cafe\u0301  \r\n\n\n\nx\u00a0y ")   # "café\n\nx y"
    clean_record(record)                            # text/summary rebuilt from the cleaned parts
    clean_record(record, derived)                   # ... told which were derived (validate.judge_for_cleaning)
    kept, quarantined = clean_all(validated.clean)  # a record left empty is quarantined as "empty"

Whitespace rules: CRLF/CR become LF; trailing spaces on each line go; exotic spaces
(no-break, thin, ideographic) become a plain space; zero-width characters and the BOM go;
more than one blank line becomes one; the whole text is stripped. Indentation is kept:
it is meaningful in docstrings and code.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import replace

from lmforge.components.data.quarantine import Quarantined, encode_raw, fields_bytes
from lmforge.components.data.validate import Derived, Kept
from lmforge.components.serving.records import Record, first_sentence, lm_text

EMPTIED = "nothing left after whitespace cleaning"

_SPACES = re.compile(r"[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_ZERO_WIDTH = re.compile(r"[\u200b\u200c\u200d\u2060\ufeff]")
_TRAILING = re.compile(r"[ \t]+(?=\n)")
_BLANKS = re.compile(r"\n{3,}")


def clean_text(text: str) -> str:
    text = unicodedata.normalize("NFC", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _ZERO_WIDTH.sub("", _SPACES.sub(" ", text))
    text = _BLANKS.sub("\n\n", _TRAILING.sub("", text))
    return text.strip()


def clean_line(text: str) -> str:
    """For one-line fields (signature, summary): NFC, and all whitespace runs become one space."""
    return " ".join(_ZERO_WIDTH.sub("", unicodedata.normalize("NFC", text)).split())


def clean_record(r: Record, derived: Derived | None = None) -> Record:
    """The record with cleaned fields; derived fields (text, summary) are rebuilt when they were derived.

    `derived` (from validate.judge_for_cleaning) says which they are, so that nothing is compared or built twice;
    without it they are found by comparison. A document's text is its docstring: it is cleaned once.
    """
    derived_text = r.text == lm_text(r.signature, r.docstring) if derived is None else derived.text
    derived_summary = derived.summary if derived is not None else None
    if derived_summary is None:
        derived_summary = r.summary == first_sentence(r.docstring)
    signature, docstring = clean_line(r.signature), clean_text(r.docstring)
    if derived_text:
        text = lm_text(signature, docstring)
    elif r.text == r.docstring:  # the same string (a document): the same cleaned text
        text = docstring
    else:
        text = clean_text(r.text)
    summary = first_sentence(docstring) if derived_summary else clean_line(r.summary)
    return replace(r, signature=signature, docstring=docstring, text=text, summary=summary)


def clean_all(kept: list[Kept]) -> tuple[list[Kept], list[Quarantined]]:
    """Clean every record; one that cleaning leaves empty (only zero-width characters) is quarantined."""
    out, bad = [], []
    for k in kept:
        r = clean_record(k.record)
        if r.docstring and r.text:
            out.append(replace(k, record=r))
        else:
            bad.append(Quarantined(k.origin, "empty", EMPTIED, source=k.origin, format="parquet",
                                   **encode_raw(fields_bytes(k.record.to_dict()))))
    return out, bad
