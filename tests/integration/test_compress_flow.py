"""The compress stage end to end: a champion in a real MLflow registry -> every variant built,
measured, loaded through its MLflow pyfunc and the serving runtime, registered with its parent_version,
the trade-off table and chart logged, `compressed` set; then every registered variant served by a real
Triton server through the rollout gate.

    .venv/bin/pytest tests/integration/test_compress_flow.py
"""

from __future__ import annotations

import ast
import inspect
import json
import shutil
import textwrap

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _records():
    from lmforge.components.serving.records import Record

    out = []
    for mod in (textwrap, json, shutil):
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                out.append(Record.from_parts(source="stdlib", module=mod.__name__, qualname=node.name,
                                             signature=f"def {node.name}({ast.unparse(node.args)})",
                                             docstring=ast.get_docstring(node)))
    return out


def _dataset(ws, tok) -> str:
    """A small dataset folder in the workspace layout: records, shards, manifest; LATEST set."""
    from lmforge.components.data.shards import write_shards
    from lmforge.components.workspace import atomic_write_json

    records = _records()
    splits = {"train": records[: len(records) // 2], "validation": records[len(records) // 2:][:6],
              "test": records[len(records) // 2:][6:20]}
    version = "testds000001"
    d = ws.dataset_dir(version)
    (d / "records").mkdir(parents=True)
    for name, rs in splits.items():
        (d / "records" / f"{name}.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in rs))
    docs = {n: [tok(r.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rs] for n, rs in splits.items()}
    write_shards(d / "shards", docs, vocab_size=len(tok))
    atomic_write_json(d / "manifest.json", {"version": version, "counts": {k: len(v) for k, v in splits.items()}})
    ws.set_latest_dataset(version)
    return version


# Three variants of three kinds (a load-time recipe, a trained student, a custom layer); the
# unit tests cover every technique, this covers the stage around them in the suite's time budget.
OVERRIDES = ["evaluation.max_new_tokens=8", "compression.quantize.casts=[]", "compression.prune.enabled=false",
             "compression.channels.enabled=false", "compression.lora.enabled=false"]


def test_compress_flow_registers_every_variant_with_lineage(workspace, tiny_model_dir, tmp_path):
    from mlflow import MlflowClient
    from transformers import PreTrainedTokenizerFast

    from lmforge.components.config import load_config
    from lmforge.components.registry import register_model, set_alias
    from tests.conftest import TINY_CONFIG

    tiny_config = load_config(TINY_CONFIG, OVERRIDES)
    from lmforge.components.tracking import use_workspace
    from lmforge.flows.compress import compress_flow

    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    version = _dataset(workspace, tok)
    export = tmp_path / "export"
    shutil.copytree(tiny_model_dir, export)
    (export / "lmforge.json").write_text(json.dumps({"dataset_version": version, "run_name": "tiny-run"}))
    champion = register_model(workspace, tiny_config.registry, export, metrics={"bpc": 9.0}, tags={})
    set_alias(workspace, tiny_config.registry.model_name, "champion", champion, reason="test setup")

    result = compress_flow(tiny_config)

    rows = {r["variant"]: r for r in result["summary"]}
    expected = ["parent", "int8", "distill", "lowrank"]
    assert list(rows) == expected
    assert rows["parent"]["version"] == champion
    assert rows["int8"]["linear_weight_mb"] * 3.5 <= rows["parent"]["linear_weight_mb"]
    assert rows["distill"]["params"] < rows["parent"]["params"]
    assert rows["lowrank"]["params"] < rows["parent"]["params"]
    client = MlflowClient(tracking_uri=use_workspace(workspace).get_tracking_uri())
    name = tiny_config.registry.model_name
    for variant in expected[1:]:
        mv = client.get_model_version(name, rows[variant]["version"])
        assert mv.tags["parent_version"] == champion and mv.tags["variant"] == variant
        assert mv.tags["dataset_version"] == version
    aliases = client.get_registered_model(name).aliases
    if result["compressed"] is None:
        assert "compressed" not in aliases and "none of" in result["policy"]
    else:
        assert str(aliases["compressed"]) == result["compressed"]
        assert rows[result["compressed_variant"]]["qualifies"]
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.tags["parent_version"] == champion
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "tradeoff")}
    assert {"tradeoff/tradeoff.md", "tradeoff/tradeoff.png", "tradeoff/tradeoff.json"} <= artifacts
    assert client.get_experiment(run.info.experiment_id).name == "compression"
    assert result["not_registered"] == {}

    # `lmforge run deploy --set deploy.alias=compressed`: the deploy flow serves the alias through the rollout gate.
    from lmforge.components.registry import download_model, resolve_version
    from lmforge.deploy import client as triton
    from lmforge.deploy import deployment
    from lmforge.flows.deploy import deploy_flow

    if result["compressed"] is None:  # the policy chose none on this random model: point the alias at int8
        set_alias(workspace, name, "compressed", rows["int8"]["version"], reason="test: serve a compressed variant")
    compressed = int(resolve_version(workspace, name, "compressed"))
    deploy_cfg = load_config(TINY_CONFIG, OVERRIDES + [
        "deploy.alias=compressed", "deploy.http_port=0", "deploy.grpc_port=0", "deploy.metrics_port=0",
        "deploy.validation_prompts=2", "deploy.max_new_tokens=6"])
    try:
        out = deploy_flow(deploy_cfg)
        assert out["version"] == compressed
        assert int(resolve_version(workspace, name, "production")) == compressed
        info = deployment.ensure_server(workspace, deploy_cfg.deploy)  # the flow's server, still running
        # Every other registered variant serves through the same gate too.
        for variant in expected[1:]:
            v = int(rows[variant]["version"])
            served = deployment.deploy_version(workspace, deploy_cfg.deploy, info, registry_model=name, version=v,
                                            model_dir=download_model(workspace, name, str(v)))
            assert served.ok and served.serving == [v], (variant, served.reason)
            (gen,) = triton.generate(info.url, ["def foo(x):"], params=triton.Params(max_tokens=4))
            assert gen.output_tokens >= 1
    finally:
        deployment.stop(workspace)


def test_a_variant_that_cannot_load_is_refused_with_the_reason(tiny_model_dir, tmp_path):
    from lmforge.components.compression.lowrank import lowrank_variant
    from lmforge.components.registry.verify import verify_servable
    from lmforge.components.sections.compression import LowRankConfig
    from lmforge.deploy.server import serve_venv

    good = lowrank_variant(tiny_model_dir, tmp_path / "lowrank", LowRankConfig(mode="rank", rank=4))
    assert verify_servable(good, serve_python=serve_venv() / "bin" / "python") is None
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    meta = json.loads((bad / "lmforge.json").read_text())
    meta["load"]["ranks"] = {k: v + 1 for k, v in meta["load"]["ranks"].items()}  # factors no longer fit
    (bad / "lmforge.json").write_text(json.dumps(meta))
    problem = verify_servable(bad, serve_python=serve_venv() / "bin" / "python")
    assert problem is not None and problem.startswith("lmforge cannot load it") and "size" in problem
