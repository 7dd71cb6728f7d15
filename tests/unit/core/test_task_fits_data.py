"""A declared task that does not fit the records stops the run, naming the kind, what the records hold and the fix;
so does a base's recorded task under task.kind = "auto" (components/data/taskdata.py check_fit, dataset_task)."""

from __future__ import annotations

import json

import pytest

from lmforge.components.data.taskdata import check_fit, dataset_task, record_shapes, recorded_task
from lmforge.components.errors import UserError
from lmforge.components.sections.task import TaskConfig
from lmforge.components.serving.records import Record
from lmforge.components.serving.task import Task

TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
CHAT = Record(id="c", source="t", module="m", qualname="q", signature="", docstring="", summary="", text="Hi Hello.",
              messages=json.dumps(TURNS))
DOCSTRING = Record.from_parts(source="stdlib", module="json", qualname="dumps", signature="def dumps(obj):",
                              docstring="Serialize obj.")
PAIR = Record(id="p", source="t", module="m", qualname="q", signature="2 + 2 =", docstring=" 4", summary="4",
              text="2 + 2 = 4")
DOCUMENT = Record(id="d", source="t", module="m", qualname="q", signature="", docstring="one two three",
                  summary="one two three", text="one two three")


def _shapes(tmp_path, *records: Record):
    path = tmp_path / "records-train.jsonl"
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records), encoding="utf-8")
    return record_shapes([path])


@pytest.mark.parametrize("kind, records, held, fix", [
    ("docstring", [CHAT, CHAT], "2 chats", 'task.kind = "chat"'),
    ("completion", [CHAT, DOCUMENT], "1 chats", 'task.kind = "chat"'),
    ("chat", [PAIR, DOCUMENT], "1 prompt/completion pairs", 'task.kind = "completion"'),
    ("docstring", [DOCUMENT, DOCUMENT], "2 documents", 'task.kind = "completion"'),
])
def test_a_declared_kind_that_does_not_fit_the_records_is_refused(tmp_path, kind, records, held, fix):
    with pytest.raises(UserError) as e:
        check_fit(TaskConfig(kind=kind), _shapes(tmp_path, *records), where="data.source x.jsonl")
    msg = str(e.value)
    assert msg.startswith(f'task.kind: "{kind}" does not fit the records') and held in msg and "x.jsonl" in msg
    assert 'task.kind = "auto"' in msg and fix in msg


@pytest.mark.parametrize("kind, records", [
    ("chat", [CHAT, DOCUMENT]), ("docstring", [DOCSTRING, PAIR]), ("docstring", [PAIR, DOCUMENT]),
    ("completion", [DOCSTRING, PAIR, DOCUMENT]),
    ("auto", [CHAT, PAIR, DOCUMENT]),
])
def test_a_kind_that_fits_passes(tmp_path, kind, records):
    check_fit(TaskConfig(kind=kind), _shapes(tmp_path, *records))


def test_a_base_trained_for_another_task_is_refused_under_auto_and_named(tmp_path):
    shapes = _shapes(tmp_path, CHAT)
    with pytest.raises(UserError, match=r"training.model.init: models:/lm@champion was trained for the docstring task"
                                        r".*1 chats.*set task.kind = \"chat\" to retrain it"):
        check_fit(TaskConfig(kind="auto"), shapes, base=Task("docstring"), base_name="models:/lm@champion")
    check_fit(TaskConfig(kind="chat"), shapes, base=Task("docstring"), base_name="models:/lm@champion")  # declared
    check_fit(TaskConfig(kind="auto"), shapes, base=Task("chat"), base_name="models:/lm@champion")


def test_a_base_records_its_task_only_in_lmforge_json(tmp_path):
    assert recorded_task(tmp_path) is None                     # a Hugging Face folder: no task to disagree with
    (tmp_path / "lmforge.json").write_text(json.dumps({"task": Task("chat").to_dict()}))
    assert recorded_task(tmp_path) == Task("chat")


def test_training_refuses_a_declared_kind_the_dataset_does_not_fit(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    (records / "train.jsonl").write_text(json.dumps(CHAT.to_dict()) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match='task.kind: "docstring" does not fit'):
        dataset_task(TaskConfig(kind="docstring"), tmp_path)
    assert dataset_task(TaskConfig(kind="auto"), tmp_path) == Task("chat")
