"""Supervised fine-tuning pairs with no text field: {prompt, completion} and {messages: [{role, content}, ...]}."""

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.components.data.corpuswork import select
from lmforge.components.data.quarantine import raw_bytes, read_quarantine
from lmforge.components.data.readers import ingest, plan_shards
from lmforge.components.data.shardwork import ROWS, ingest_shard
from lmforge.components.data.validate import validate_items, validate_lines
from lmforge.components.sections.data import DataConfig, ValidationConfig


def line(obj) -> bytes:
    return json.dumps(obj).encode()


def chat(*turns) -> list[dict]:
    return [{"role": r, "content": c} for r, c in turns]


def one(obj, cfg: ValidationConfig | None = None):
    result = validate_lines([line(obj) if not isinstance(obj, bytes) else obj], cfg or ValidationConfig())
    assert len(result.clean) + len(result.quarantined) == 1
    return result


def test_prompt_completion_pair_becomes_a_record():
    (kept,) = one({"id": "p1", "prompt": "Translate: chat", "completion": "cat. A pet.", "module": "g"}).clean
    r = kept.record
    assert (r.id, r.module, r.qualname) == ("p1", "g", "p1")
    assert (r.signature, r.docstring, r.summary) == ("Translate: chat", "cat. A pet.", "cat. A pet.")
    assert r.text == "Translate: chat\ncat. A pet."
    (plain,) = one({"prompt": "Q?", "completion": "A."}).clean  # no id: a stable id from the origin, its own group
    assert plain.record.id == plain.record.module == plain.record.qualname and len(plain.record.id) == 16


def test_chat_with_a_single_user_turn_uses_its_content_as_the_prompt():
    (kept,) = one({"id": "c1", "messages": chat(("user", "What is 2+2?"), ("assistant", "4."))}).clean
    r = kept.record
    assert (r.signature, r.docstring, r.summary, r.text) == ("What is 2+2?", "4.", "4.", "What is 2+2?\n4.")


def test_chat_with_several_turns_renders_each_as_role_and_content():
    messages = chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."), ("user", "2+2?"),
                    ("assistant", "4."))
    (kept,) = one({"id": "c2", "messages": messages}).clean
    prompt = "system: Be brief.\nuser: Hi\nassistant: Hello.\nuser: 2+2?"
    assert (kept.record.signature, kept.record.docstring, kept.record.text) == (prompt, "4.", prompt + "\n4.")
    assert kept.record.turns == messages   # the chat itself, for a chat task's template (components/serving/task.py)
    # a system turn and one user turn: still rendered with roles (only a lone user turn is taken as is)
    (sys_user,) = one({"messages": chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."))}).clean
    assert sys_user.record.signature == "system: Be brief.\nuser: Hi"


def test_a_text_field_wins_and_keeps_todays_behaviour():
    (kept,) = one({"id": "t", "text": "Body. More.", "prompt": "p", "completion": "ignored",
                   "messages": chat(("user", "x"), ("assistant", "y"))}).clean
    r = kept.record
    assert (r.signature, r.docstring, r.summary, r.text) == ("p", "Body. More.", "Body.", "Body. More.")
    assert r.messages == "" and "messages" not in r.to_dict()
    assert one({"text": "", "prompt": "p"}).quarantined[0].reason == "empty"  # no pair in it: an empty document


def test_custom_field_names():
    cfg = ValidationConfig(prompt_field="question", completion_field="answer", messages_field="conversation")
    (kept,) = one({"question": "Q?", "answer": "A."}, cfg).clean
    assert kept.record.text == "Q?\nA."
    (conv,) = one({"conversation": chat(("user", "Q?"), ("assistant", "A."))}, cfg).clean
    assert conv.record.signature == "Q?"
    bad = one({"prompt": "Q?", "completion": "A."}, cfg).quarantined[0]
    assert bad.reason == "missing_field" and "'question'" in bad.detail and "'conversation'" in bad.detail


BAD_PAIRS = [
    ({"id": "x", "body": "elsewhere"}, "missing_field", ["'text'", "'prompt'", "'completion'", "'messages'"]),
    ({"prompt": "Q?"}, "missing_field", ["without 'completion'", "'text'", "'messages'"]),
    ({"completion": "A."}, "missing_field", ["without 'prompt'", "'text'", "'messages'"]),
    ({"prompt": 3, "completion": "A."}, "wrong_type", ["'prompt'", "int"]),
    ({"prompt": "Q?", "completion": ["A."]}, "wrong_type", ["'completion'", "list"]),
    ({"prompt": "Q?", "completion": "  \n "}, "empty", ["'completion'"]),
    ({"prompt": "", "completion": "A."}, "empty", ["'prompt'"]),
    ({"prompt": "Q\u0007?", "completion": "A."}, "control_chars", ["'prompt'"]),
    ({"prompt": "Q?", "completion": "lone \udc80"}, "invalid_utf8", ["'completion'"]),
    ({"prompt": "Q" * 60, "completion": "A" * 60}, "too_long", ["121 characters"]),
    ({"prompt": "Q?", "completion": "A" * 121}, "too_long", ["field 'completion' has 121"]),
    ({"messages": {"role": "user"}}, "wrong_type", ["'messages'", "list", "dict"]),
    ({"messages": "[{not json"}, "invalid_json", ["'messages'"]),
    ({"messages": ["hi", "there"]}, "wrong_type", ["messages[0]", "str"]),
    ({"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant"}]}, "wrong_type", ["messages[1]", "'content'"]),
    ({"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": None}]}, "wrong_type",
     ["messages[1]", "NoneType"]),
    ({"messages": chat(("user", "Q?"), ("tool", "42"), ("assistant", "A."))}, "wrong_type",
     ["messages[1]", "'tool'", "system, user, assistant"]),
    ({"messages": [{"role": 1, "content": "Q?"}, {"role": "assistant", "content": "A."}]}, "wrong_type", ["messages[0]"]),
    ({"messages": chat(("user", "Q?"), ("assistant", "A."), ("user", "And?"))}, "missing_field",
     ["end with the assistant", "messages[2]", "'user'"]),
    ({"messages": []}, "missing_field", ["end with the assistant", "empty"]),
    ({"messages": chat(("system", "Be brief."), ("assistant", "A."))}, "missing_field", ["no 'user' message"]),
    ({"messages": chat(("user", "Q?"), ("assistant", " "))}, "empty", ["messages[1]", "completion"]),
    ({"messages": chat(("user", "  "), ("assistant", "A."))}, "empty", ["prompt"]),
    ({"messages": chat(("user", "Q\u0000?"), ("assistant", "A."))}, "control_chars", ["messages[0].content"]),
    ({"messages": chat(("user", "Q" * 60), ("assistant", "A" * 60))}, "too_long", ["121 characters"]),
]


@pytest.mark.parametrize("record, reason, named", BAD_PAIRS, ids=[f"{r}-{i}" for i, (_, r, _) in enumerate(BAD_PAIRS)])
def test_each_bad_pair_is_quarantined_whole_with_its_reason_and_a_detail_naming_the_problem(record, reason, named):
    raw = line(record)
    result = one(raw, ValidationConfig(max_chars=120) if reason == "too_long" else None)
    (q,) = result.quarantined
    assert q.reason == reason
    for part in named:
        assert part in q.detail, (part, q.detail)
    assert raw_bytes(q) == raw


def test_mixed_jsonl_of_documents_pairs_chats_and_bad_lines_reconciles():
    good = [{"id": "t", "text": "A plain document."},
            {"id": "p", "prompt": "Q?", "completion": "A."},
            {"id": "m", "messages": chat(("user", "Hi?"), ("assistant", "Hello."))}]
    bad = [record for record, _, _ in BAD_PAIRS]
    lines = [line(r) for r in good] + [line(r) for r in bad] + [b"", b"{broken", line({"id": "p", "text": "dup id"})]
    result = validate_lines(lines, ValidationConfig(max_chars=120))
    counts = result.counts()
    assert counts["docs_in"] == counts["clean"] + counts["quarantined"] == len(lines)
    assert [k.record.id for k in result.clean] == ["t", "p", "m"]
    by_reason = counts["quarantined_by_reason"]
    assert by_reason["blank_line"] == 1 and by_reason["duplicate_id"] == 1
    assert by_reason["invalid_json"] == 2  # the broken line and the messages string that is not JSON


def test_csv_with_prompt_completion_and_json_messages_cells(tmp_path):
    path = tmp_path / "sft.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "text", "prompt", "completion", "messages"])
        w.writerow(["doc", "A document.", "", "", ""])
        w.writerow(["pair", "", "Q?", "A.", ""])
        w.writerow(["chat", "", "", "", json.dumps(chat(("user", "Hi?"), ("assistant", "Hello.")))])
        w.writerow(["notjson", "", "", "", "[{'role': 'user'}]"])
        w.writerow(["nothing", "", "", "", ""])
    result = validate_items(ingest(DataConfig(source=str(path))).items, ValidationConfig())
    got = {k.record.id: (k.record.signature, k.record.docstring, k.record.text) for k in result.clean}
    assert got == {"doc": ("", "A document.", "A document."), "pair": ("Q?", "A.", "Q?\nA."),
                   "chat": ("Hi?", "Hello.", "Hi?\nHello.")}
    assert [(q.origin, q.reason) for q in result.quarantined] == [("sft.csv:5", "invalid_json"), ("sft.csv:6", "empty")]


def test_parquet_messages_column_holds_the_list_itself(tmp_path):
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "messages": [chat(("user", "Hi?"), ("assistant", "Hello.")),
                                                            chat(("user", "Hi?"))]}), path)
    result = validate_items(ingest(DataConfig(source=str(path))).items, ValidationConfig())
    assert [(k.record.id, k.record.text) for k in result.clean] == [("a", "Hi?\nHello.")]
    assert [q.reason for q in result.quarantined] == ["missing_field"]


def test_prompt_completion_jsonl_goes_through_ingest_and_the_data_stages_shards(tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = [{"id": f"q{i}", "prompt": f"Question {i}: what does socket {i} do?",
             "completion": f"It opens connection {i}.\nThen it waits."} for i in range(6)]
    path.write_bytes(b"\n".join(line(r) for r in rows) + b"\n" + line({"prompt": "no answer"}) + b"\n")
    cfg = DataConfig(source=str(path))
    ingested = ingest(cfg)
    assert ingested.report["items_found"] == 7
    result = validate_items(ingested.items, cfg.validation)
    assert len(result.clean) == 6 and [q.reason for q in result.quarantined] == ["missing_field"]
    # the data stage's own path: per-shard ingest (validate + clean) and select
    refs = [ingest_shard(spec, cfg, tmp_path / f"ingest-{spec['index']}") for spec in plan_shards(cfg)]
    sel = select(refs, cfg, tmp_path / "select")
    assert sel.records_read == sel.docs_in == 7 == sel.clean + sel.quarantined and sel.clean == 6
    table = pq.read_table(tmp_path / "ingest-0" / ROWS).to_pylist()
    assert [(r["id"], r["signature"], r["docstring"], r["text"]) for r in table][0] == (
        "q0", "Question 0: what does socket 0 do?", "It opens connection 0.\nThen it waits.",
        "Question 0: what does socket 0 do?\nIt opens connection 0.\nThen it waits.")
    (q,) = read_quarantine(tmp_path / "select" / "quarantine.jsonl")
    assert q.reason == "missing_field" and raw_bytes(q) == line({"prompt": "no answer"})
