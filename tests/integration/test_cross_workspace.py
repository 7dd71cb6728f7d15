"""Two workspaces on one registry (a real MLflow server): what A trained and deployed, B monitors and retrains.

A runs data, train and evaluate (v1, which logs its dataset bundle with it) and deploys it on its target
`a` (the alias `production-a`). B has none of A's datasets: it deploys the same version on its own target
`b`, sees shifted traffic, and its monitor builds the reference from what travelled with v1 (no "names
no dataset in this workspace"), decides drift and retrains: on v1's records plus the new domain, from
v1's weights; the gate re-scores the champion on B's evaluation set, which B's registration logged with
v2, and the decision names that set, by hash, as a set any workspace can fetch; with evaluation.gate_set =
"champion" both sides are scored on v1's own set instead, fetched by hash. The two targets' aliases
never move each other. The deploy stage's alias move is made through the function it uses
(gate.production_alias), not through a Triton server: test_deploy_triton covers the rollout itself.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from lmforge.components.config import load_config
from tests.conftest import TINY_CONFIG
from tests.integration.servers import mlflow_server
from tests.integration.test_drift_loop import BASE, new_domain_corpus

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "lmforge-tiny"


def test_workspace_b_monitors_and_retrains_what_workspace_a_deployed(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from lmforge.components.registry import current, set_alias
    from lmforge.components.registry.gate import production_alias, read_decision
    from lmforge.components.registry.travel import fetch_dataset_bundle
    from lmforge.components.serving.requestlog import RequestLog
    from lmforge.components.workspace import Workspace
    from lmforge.flows.data import data_flow
    from lmforge.flows.evaluate import evaluate_flow
    from lmforge.flows.monitor import monitor_flow
    from lmforge.flows.train import train_flow
    from lmforge.monitoring.served import served_model, served_rare_ids, serving_featurizer
    from lmforge.monitoring.traffic import shifted_prompts
    from tests.unit.monitoring.dataset import write_requests

    corpus = new_domain_corpus(tmp_path / "new_domain.jsonl")
    ws_a, ws_b = Workspace(tmp_path / "a").ensure(), Workspace(tmp_path / "b").ensure()

    def cfg(target: str, *extra: str):
        return load_config(TINY_CONFIG, [*BASE, f"deploy.name={target}", "training.max_steps=3",
                                         f"monitoring.retrain_source={corpus}", *extra])

    def deploy(ws: Workspace, c, version: str) -> None:   # the rollout's alias move (deploy/deployment.py)
        set_alias(ws, NAME, production_alias(c.deploy.name), version, reason="test: served on this target")

    with mlflow_server(tmp_path) as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        monkeypatch.chdir(tmp_path)

        # Workspace A: trains, registers (the dataset travels with v1) and deploys on target "a".
        monkeypatch.setenv("LMFORGE_HOME", str(ws_a.root))
        cfg_a = cfg("a")
        data_flow(cfg_a)
        train_flow(cfg_a)
        ev = evaluate_flow(cfg_a)
        assert ev["version"] == "1"
        if not ev["decision"]["promote"]:   # a 3-step model may not beat the unigram baseline; v1 serves anyway
            set_alias(ws_a, NAME, "champion", "1", reason="test setup: v1 serves")
        deploy(ws_a, cfg_a, "1")
        dataset_a = ws_a.latest_dataset()
        a_records = sum(len((ws_a.dataset_dir(dataset_a) / "records" / f"{s}.jsonl").read_text().splitlines())
                        for s in ("train", "validation", "test"))

        # Workspace B: none of A's data; deploys the champion on its own target "b".
        monkeypatch.setenv("LMFORGE_HOME", str(ws_b.root))
        cfg_b = cfg("b", "registry.bpc_margin=10.0")   # the retrained candidate is refused: v1 keeps serving
        assert not ws_b.dataset_dir(dataset_a).exists()
        deploy(ws_b, cfg_b, current(ws_b, NAME, "champion"))
        assert (current(ws_b, NAME, "production-a"), current(ws_b, NAME, "production-b")) == ("1", "1")
        assert current(ws_b, NAME, "production") is None   # the default target's alias is nobody's here

        served = served_model(ws_b, cfg_b)
        assert (served.version, served.dataset_version, served.source) == ("1", dataset_a, "registry")
        featurize = serving_featurizer(served.model_dir, served_rare_ids(ws_b, served, cfg_b.deploy.rare_token_min_count))
        now = datetime.now(timezone.utc)
        write_requests(RequestLog(ws_b.requests), shifted_prompts(n=120, seed=0, noise=0.3, held_out=["def f(x)"]),
                       featurize, ts=now)   # what B's Triton logs for v1 (model "lmforge", version "1")

        out = monitor_flow(cfg_b, now=now)
        assert out["decision"] == "drift: retrain" and out["served_version"] == "1", out
        assert (out["dataset_version"], out["dataset_source"]) == (dataset_a, "registry")
        r = out["retrain"]
        assert r["outcome"] == "refused" and r["candidate"] == "2" and r["serving"] == "1", r
        assert "below the margin 10.0" in r["reason"], r["reason"]
        corpus_stage = r["stages"]["corpus"]
        assert corpus_stage["dataset"] == {"version": dataset_a, "from": "registry"}
        assert corpus_stage["old"] == a_records and corpus_stage["new"] > 0   # A's records plus the new domain

        # The gate compared on B's evaluation set, logged with v2 and named (by hash) in the decision.
        client = MlflowClient()
        mv = client.get_model_version(NAME, "2")
        assert "decision_json" not in mv.tags                # the whole decision is an artifact of v2's run
        decision = read_decision(ws_b, NAME, "2")
        eval_set = decision["eval_set"]
        assert eval_set["logged_with"] == "v2" and eval_set["dataset_version"] != dataset_a
        assert mv.tags["decision_eval_set"] == eval_set["sha256"]
        assert "re-scored" in eval_set["how"] and "evaluation set" in eval_set["how"], eval_set
        bundle = fetch_dataset_bundle(ws_a, NAME, "2")      # A (or anyone) fetches the very set that decided
        ref = json.loads((bundle / "dataset.json").read_text())
        assert ref["eval_set_sha256"] == eval_set["sha256"] and ref["eval_split"] == eval_set["split"]

        # With evaluation.gate_set = "champion", both sides are scored on v1's own set, fetched by its hash.
        v1_set = json.loads((fetch_dataset_bundle(ws_b, NAME, "1") / "dataset.json").read_text())
        theirs = evaluate_flow(cfg("b", "registry.bpc_margin=10.0", "evaluation.gate_set=champion"))
        assert theirs["version"] == "3" and theirs["summary"]["eval_set"] == v1_set["eval_set_sha256"][:12]
        d3 = theirs["decision"]
        assert d3["champion_version"] == "1" and d3["eval_set"]["logged_with"] == "v1", d3
        assert d3["eval_set"]["dataset_version"] == dataset_a and d3["eval_set"]["how"].startswith("champion v1: ")

        # Two targets, two aliases: moving B's does not move A's.
        deploy(ws_b, cfg_b, "2")
        assert (current(ws_a, NAME, "production-a"), current(ws_a, NAME, "production-b")) == ("1", "2")
