"""The retrain corpus keeps each record's shape: a chat stays a chat, so a chat task retrains on its turns."""

from __future__ import annotations

import json

from lmforge.components.config import load_config
from lmforge.components.data.validate import validate_lines
from lmforge.components.serving.records import Record
from lmforge.flows.retrain import retrain_corpus


def test_a_chat_record_is_written_back_as_a_chat_and_a_document_as_a_document(tmp_path):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    chat = Record(id="c", source="s", module="c", qualname="c", signature="Hi", docstring="Hello.", summary="Hello.",
                  text="Hi\nHello.", messages=json.dumps(turns))
    doc = Record.from_parts(source="s", module="m", qualname="f", signature="def f():", docstring="Do it.")
    records = tmp_path / "records"
    records.mkdir()
    (records / "train.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in (chat, doc)))
    cfg = load_config("tiny")
    out = retrain_corpus(records, cfg, "v1", tmp_path / "corpus.jsonl")
    lines = [line.encode() for line in open(out["path"], encoding="utf-8").read().splitlines()]
    back = [k.record for k in validate_lines(lines, cfg.data.validation).clean]
    assert back[0].turns == turns and back[0].reference == "Hello."
    assert back[1].messages == "" and back[1].prompt == "def f():" and back[1].reference == "Do it."
