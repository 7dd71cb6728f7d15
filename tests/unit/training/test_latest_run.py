"""One answer to "the newest training run": Workspace.latest_run, which the train flow's --resume
and the pipeline's interrupted-run check both ask."""

from __future__ import annotations

import json
import os

import pytest

from lmforge.components.errors import UserError
from lmforge.components.workspace import Workspace


def started(ws: Workspace, name: str, created_at: str, *, exported: bool = False, **info) -> None:
    run_dir = ws.run_dir(name)
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_name": name, "created_at": created_at, **info}))
    if exported:
        (run_dir / "export").mkdir()
        (run_dir / "export" / "lmforge.json").write_text("{}")


@pytest.fixture
def ws(tmp_path) -> Workspace:
    return Workspace(tmp_path / "ws").ensure()


def test_the_newest_run_is_the_one_started_last_finished_or_not(ws):
    assert ws.latest_run() is None and ws.latest_run(exported=False) is None
    started(ws, "b-old", "2026-01-01T10:00:00+00:00", exported=True)
    started(ws, "a-new", "2026-01-02T10:00:00+00:00", exported=True)   # newer, though its name sorts first
    started(ws, "c-crashed", "2026-01-03T10:00:00+00:00")              # stopped before exporting
    assert ws.latest_run() == "a-new"                    # what evaluation reads: a finished model
    assert ws.latest_run(exported=False) == "c-crashed"  # what --resume continues


def test_a_stale_latest_pointer_is_not_the_answer(ws):
    # A reused run name whose new attempt failed: runs/LATEST still names it, but its export is gone.
    started(ws, "older", "2026-01-01T10:00:00+00:00", exported=True)
    started(ws, "reused", "2026-01-02T10:00:00+00:00")
    (ws.runs / "LATEST").write_text("reused\n")   # as an older lmforge left it
    assert ws.latest_run() == "older"


def test_an_export_without_run_json_counts_as_a_finished_run_from_its_export_time(ws):
    started(ws, "flow-run", "2020-01-01T00:00:00+00:00", exported=True)
    by_hand = ws.run_dir("copied-in") / "export"
    by_hand.mkdir(parents=True)
    (by_hand / "lmforge.json").write_text("{}")
    assert ws.latest_run() == "copied-in"
    assert ws.latest_run(exported=False) == "flow-run"  # nothing to resume there: no run.json
    os.utime(by_hand / "lmforge.json", (0, 0))           # exported long before flow-run started
    assert ws.latest_run() == "flow-run"


def test_a_broken_run_json_is_named(ws):
    started(ws, "good", "2026-01-01T10:00:00+00:00", exported=True)
    (ws.run_dir("bad")).mkdir(parents=True)
    (ws.run_dir("bad") / "run.json").write_text('{"run_name": "bad"}')
    with pytest.raises(UserError, match=r"training run: .*bad/run.json has no readable created_at.*remove the run's folder"):
        ws.latest_run(exported=False)


def test_resume_and_the_pipeline_ask_the_same_question(ws, monkeypatch, tiny_config):
    from lmforge.components.config import config_hash
    from lmforge.components.training.run import run_name
    from lmforge.flows.pipeline import interrupted_run

    monkeypatch.setattr(Workspace, "latest_dataset", lambda self: "v1")

    def resume_name():
        return run_name(ws, tiny_config.training, config_name=tiny_config.name, resume=True)

    started(ws, "done", "2026-01-01T10:00:00+00:00", exported=True)
    started(ws, "stopped", "2026-01-02T10:00:00+00:00", dataset_version="v1", config_hash=config_hash(tiny_config.training))
    (ws.run_dir("stopped") / "checkpoints" / "step-0000003").mkdir(parents=True)
    (ws.run_dir("stopped") / "checkpoints" / "step-0000003" / "COMPLETE.json").write_text("{}")
    assert resume_name() == "stopped" == ws.latest_run(exported=False)
    assert interrupted_run(ws, tiny_config) == "stopped"
    (ws.run_dir("stopped") / "run.json").write_text("{}")
    for ask in (resume_name, lambda: interrupted_run(ws, tiny_config)):
        with pytest.raises(UserError, match="stopped/run.json has no readable created_at"):
            ask()
