"""Data and task agree, or the run stops (issue 44): `lmforge run data` with task.kind = "docstring" on a chat JSONL
exits 2 with an error that names the kind, what the records hold and the fix; with "auto" the same data trains the
chat task, and the exported model records it."""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY_CONFIG
from tests.integration.test_any_task import SFT, chat_base, chats
from tests.integration.test_exit_codes import lmforge

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

QUICK = ["training.max_steps=4", "training.save_every=4"]


def test_a_chat_jsonl_under_the_docstring_task_exits_2_naming_the_kind_the_records_and_the_fix(tmp_path):
    source = chats(tmp_path / "chats.jsonl")
    r = lmforge(tmp_path / "ws", "run", "data", "--set", f"data.source={json.dumps(str(source))}",
                "--set", "task.kind=docstring", "--set", "data.dedup.enabled=false")
    assert r.returncode == 2, r.stderr
    assert 'task.kind: "docstring" does not fit the records: they hold 80 chats' in r.stderr
    assert 'Set task.kind = "auto" to follow the data, or task.kind = "chat"' in r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_the_same_chats_under_auto_train_the_chat_task(tmp_path, checkpoint, monkeypatch):
    from lmforge.components.config import load_config
    from lmforge.components.serving.task import Task
    from lmforge.flows.data import data_flow
    from lmforge.flows.train import train_flow

    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "ws"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    base = chat_base(checkpoint("llama"), tmp_path / "chat-base")
    cfg = load_config(TINY_CONFIG, ["task.kind=auto", f"data.source={json.dumps(str(chats(tmp_path / 'c.jsonl')))}",
                                    f"training.model.init={json.dumps(str(base))}", *SFT, *QUICK])
    data_flow(cfg)
    out = train_flow(cfg)
    assert Task.load(out["export"]) == Task("chat")


def test_a_base_trained_for_chat_refuses_documents_under_auto(tmp_path, checkpoint):
    """A base whose lmforge.json records the chat task, fine-tuned on plain documents: the data stage names it."""
    from tests.integration.test_any_task import texts

    base = chat_base(checkpoint("llama"), tmp_path / "chat-base")
    (base / "lmforge.json").write_text(json.dumps({"task": {"kind": "chat", "stop": []}}), encoding="utf-8")
    r = lmforge(tmp_path / "ws", "run", "data", "--set", f"data.source={json.dumps(str(texts(tmp_path / 't.jsonl')))}",
                "--set", "task.kind=auto", "--set", f"training.model.init={json.dumps(str(base))}")
    assert r.returncode == 2, r.stderr
    assert "was trained for the chat task, which does not fit the records" in r.stderr
