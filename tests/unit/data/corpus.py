"""Corpora for data-stage tests: realistic good documents and one line of every bad kind.

    rows = good_rows(40)                       # dicts with id, module, text, prompt, reference
    write_mixed_jsonl(path, 40)                # good rows with every BAD_LINES entry interleaved
"""

from __future__ import annotations

import json
from pathlib import Path


def good_rows(n: int) -> list[dict]:
    """n distinct, realistic documents in n // 2 groups (modules)."""
    topics = ["socket", "thread", "parser", "archive", "queue", "timer", "cursor", "buffer", "codec", "signal",
              "matrix", "vector", "lexer", "router", "cache", "ledger", "sensor", "kernel", "widget", "stream"]
    verbs = ["Open", "Close", "Read", "Write", "Flush", "Reset", "Parse", "Encode", "Decode", "Merge"]
    rows = []
    for i in range(n):
        t, v = topics[i % len(topics)], verbs[(i // len(topics)) % len(verbs)]
        rows.append({"id": f"doc{i}", "module": f"pkg{i // 2}",
                     "text": f"{v} the {t} number {i}. It takes {i % 7} arguments and returns a {topics[(i * 7) % 20]} "
                             f"handle after {verbs[(i * 3) % 10].lower()}ing {i * 13 % 97} {t}s from the pool.",
                     "prompt": f"def {v.lower()}_{t}_{i}(x):", "reference": f"{v} the {t}."})
    return rows


# (raw JSONL line, expected reason) — one of every bad kind
BAD_LINES: list[tuple[bytes, str]] = [
    (b'{"id": "u8", "text": "caf\xc3\x28 au lait"}', "invalid_utf8"),
    (b'{"id": "js", "text": "unterminated', "invalid_json"),
    (json.dumps({"id": "nul", "text": "a\u0000b"}).encode(), "control_chars"),
    (json.dumps({"id": "esc", "text": "bell \u0007 here"}).encode(), "control_chars"),
    (json.dumps({"id": "sp", "text": "   \n\t "}).encode(), "empty"),
    (json.dumps({"id": "long", "text": "word " * 5000}).encode(), "too_long"),
    (json.dumps({"id": "nofield", "body": "text is elsewhere"}).encode(), "missing_field"),
    (json.dumps({"id": "num", "text": 42}).encode(), "wrong_type"),
    (json.dumps(["not", "an", "object"]).encode(), "wrong_type"),
    (json.dumps({"id": "doc0", "text": "reuses the id of the first good record"}).encode(), "duplicate_id"),
    (json.dumps({"id": "sur", "text": "lone \udc80 surrogate"}).encode(), "invalid_utf8"),
]


def write_mixed_jsonl(path: Path, n_good: int = 40) -> Path:
    good = [json.dumps(r).encode() for r in good_rows(n_good)]
    lines = []
    for i, g in enumerate(good):
        lines.append(g)
        if i < len(BAD_LINES):
            lines.append(BAD_LINES[i][0])
    assert len(good) >= len(BAD_LINES)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path
