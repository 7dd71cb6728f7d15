"""One list of the stages (components/stages.py): the pipeline runs it in order, and the CLI, the retrain
chain, the run summary and the architecture picture follow it."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.components.stages import STAGES

REPO = Path(__file__).resolve().parents[2]


def test_the_stage_list_imports_no_prefect():
    code = "import sys, lmforge.components.stages; print(sorted(m for m in sys.modules if m.startswith('prefect')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_each_stage_has_its_flow():
    from lmforge.flows.pipeline import stage_flow

    assert [stage_flow(name).name for name in STAGES] == list(STAGES)
    with pytest.raises(KeyError, match="'register' is not a stage"):
        stage_flow("register")


@pytest.fixture
def fake_stages(monkeypatch, workspace):
    """Every stage flow replaced by one that records its call; the registry lookups and links stubbed out."""
    from lmforge.flows import pipeline

    calls: list[tuple[str, dict]] = []
    results: dict[str, dict] = {}
    for name in STAGES:
        flow = pipeline.stage_flow(name)

        def fake(cfg, _name=name, **kwargs):
            calls.append((_name, kwargs))
            result = results.get(_name, {"summary": f"{_name} ran"})
            if isinstance(result, Exception):
                raise result
            return result

        monkeypatch.setattr(sys.modules[flow.fn.__module__], flow.fn.__name__, fake)
    monkeypatch.setattr(pipeline, "missing_model", lambda ws, cfg, stage: None)
    monkeypatch.setattr(pipeline, "interrupted_run", lambda ws, cfg: None)
    monkeypatch.setattr(pipeline, "run_links", lambda: {"mlflow": "here"})
    return calls, results


def test_the_pipeline_runs_every_stage_once_in_order(fake_stages, tiny_config):
    from lmforge.flows.pipeline import pipeline_flow

    calls, _ = fake_stages
    out = pipeline_flow.fn(tiny_config)
    assert calls == [(name, {"resume": False} if name == "train" else {}) for name in STAGES]
    assert list(out) == ["config", "stages", "links"] and out["config"] == tiny_config.name
    assert list(out["stages"]) == list(STAGES)
    assert all(set(s) == {"seconds", "result"} for s in out["stages"].values())
    assert out["stages"]["data"]["result"] == {"summary": "data ran"} and out["links"] == {"mlflow": "here"}
    calls.clear()
    pipeline_flow.fn(tiny_config, resume=True)
    assert ("train", {"resume": True}) in calls


def test_the_pipeline_skips_compress_when_the_gate_declined(fake_stages, tiny_config):
    from lmforge.flows.pipeline import pipeline_flow

    calls, results = fake_stages
    results["evaluate"] = {"decision": {"promote": False, "candidate_version": "4", "champion_version": "3"}}
    out = pipeline_flow.fn(tiny_config)
    assert [name for name, _ in calls] == [name for name in STAGES if name != "compress"]
    assert out["stages"]["compress"]["result"]["summary"].startswith("skipped: the gate declined v4")


@pytest.fixture
def fake_retrain(fake_stages, monkeypatch):
    """retrain_flow over the fake stage flows: a served version, its corpus and the registry stubbed out."""
    from types import SimpleNamespace

    from lmforge.components import registry
    from lmforge.flows import retrain
    from lmforge.monitoring import served

    calls, results = fake_stages
    results["evaluate"] = {"summary": "evaluate ran", "version": "2", "decision": {"promote": True, "reason": "better"}}
    monkeypatch.setattr(served, "served_model", lambda ws, cfg: SimpleNamespace(
        records=Path("records"), dataset_version="d1", source="here", version="1"))
    monkeypatch.setattr(retrain, "retrain_corpus", lambda *args: {"path": "corpus.jsonl", "old": 1, "new": 1})
    monkeypatch.setattr(retrain, "retrain_base", lambda *args: None)
    monkeypatch.setattr(registry, "current", lambda *args: "2")
    return retrain, calls, results


def test_retrain_runs_the_pipelines_stages_in_the_tables_order_and_reports_each(fake_retrain, tiny_config):
    """What a retrain runs is a chain of the stage table (STAGES, in its order, each once), and its result names the
    stages it ran, as retrain.STAGES says (the failure reason reads that list)."""
    retrain, calls, _ = fake_retrain
    out = retrain.retrain_flow.fn(tiny_config)
    ran = [name for name, _ in calls]
    assert out["outcome"] == retrain.SERVING, out
    assert ran == [name for name in STAGES if name in ran] and len(set(ran)) == len(ran) >= 4
    assert ran[0] == "data" and ran[-1] == "deploy"
    assert list(out["stages"]) == ["corpus", *ran] == list(retrain.STAGES)


@pytest.mark.parametrize("failing", ["data", "train", "evaluate", "deploy"])
def test_a_failed_retrain_names_the_stage_that_failed(fake_retrain, tiny_config, failing):
    import json

    from lmforge.components.workspace import Workspace

    retrain, _, results = fake_retrain
    results[failing] = RuntimeError("planted")
    with pytest.raises(RuntimeError, match="planted"):
        retrain.retrain_flow.fn(tiny_config)
    journal = (Workspace.from_env().monitoring / retrain.JOURNAL).read_text().splitlines()
    last = json.loads(journal[-1])
    assert last["outcome"] == retrain.FAILED and last["reason"].startswith(f"{failing} failed: RuntimeError: planted")


def test_the_run_summary_has_a_headline_per_stage():
    from lmforge.cli.summary import HEADLINES

    assert set(HEADLINES) == set(STAGES)


def _draw_architecture():
    spec = importlib.util.spec_from_file_location("draw_architecture", REPO / "scripts" / "draw_architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_picture_draws_a_box_per_stage(monkeypatch):
    draw = _draw_architecture()
    names = [name for name, _, _ in draw.boxes()]
    assert names == ["data", "features", "train", "evaluate", "register", "compress", "deploy", "monitor"]
    monkeypatch.delitem(draw.BOXES, "monitor")
    with pytest.raises(ValueError, match="one entry per stage"):
        draw.boxes()


def test_the_pipeline_and_the_retrain_iterate_the_stage_table(fake_retrain, tiny_config, monkeypatch):
    """Neither spells the stages out: a table without compress runs without it, in both."""
    from lmforge.flows import pipeline

    retrain, calls, _ = fake_retrain
    monkeypatch.setattr(pipeline, "STAGES", ("data", "train", "evaluate"))
    assert list(pipeline.pipeline_flow.fn(tiny_config)["stages"]) == ["data", "train", "evaluate"]
    assert [name for name, _ in calls] == ["data", "train", "evaluate"]
    calls.clear()
    monkeypatch.setattr(retrain, "RETRAINED", ("data", "train", "evaluate", "deploy"))
    assert retrain.retrain_flow.fn(tiny_config)["outcome"] == retrain.SERVING
    assert [name for name, _ in calls] == ["data", "train", "evaluate", "deploy"]


def test_the_stage_table_names_each_flow_where_it_is():
    from lmforge.components.stages import FLOWS, RETRAINED

    assert list(FLOWS) == list(STAGES) and RETRAINED == ("data", "train", "evaluate", "compress", "deploy")
    assert all(importlib.util.find_spec(ref.split(":")[0]) for ref in FLOWS.values())
