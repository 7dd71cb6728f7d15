"""The retrain corpus keeps a record whole when it holds characters str.splitlines() cuts at."""

import json

from lmforge.flows.retrain import jsonl_lines


def test_a_record_with_a_bare_cr_or_u2028_stays_one_line(tmp_path):
    rows = [{"text": "a\rb"}, {"text": "c\u2028d"}, {"text": "e\x85f"}, {"text": "plain"}]
    raw = "".join(json.dumps(r, ensure_ascii=False) + ("\r\n" if i == 1 else "\n") for i, r in enumerate(rows))
    path = tmp_path / "new.jsonl"
    path.write_text(raw + "\n", encoding="utf-8", newline="")     # a blank last line, a CRLF in the middle
    assert [json.loads(line) for line in jsonl_lines(path)] == rows
