"""A local base through the whole pipeline: data -> features -> train -> evaluate -> compress -> deploy -> monitor.

A tiny GPT-2 (Conv1D projections, tied head: the architecture least like the Llama lmforge
trains from scratch) as `training.model.init`, on the tiny config with few steps. The champion
keeps the base's model_type and tokenizer, names its base in its tags and in `lmforge status`,
was gated against the base itself (not the unigram model), and Triton serves it. Compression is
held to int8 (Conv1D made Linear), channels (not built: GPT-2 has no gated MLP) and LoRA (the
default q_proj/v_proj are absent, so every projection in the blocks).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY_CONFIG

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

FEW = ["training.max_steps=4", "training.save_every=4", "training.precision=fp32",
       "compression.quantize.casts=[]", "compression.prune.enabled=false", "compression.distill.enabled=false",
       "compression.lowrank.enabled=false", "compression.lora.steps=2", "deploy.validation_latency_ms=60000"]


def test_a_gpt2_base_goes_through_the_whole_pipeline_and_its_fine_tune_serves(workspace, checkpoint):
    from mlflow import MlflowClient

    from lmforge.cli.status import status_dict
    from lmforge.components.config import load_config
    from lmforge.components.model.basemodel import check_base, tokenizer_hash
    from lmforge.components.registry import current, download_model, version_tags
    from lmforge.components.tracking import use_workspace
    from lmforge.deploy import client, deployment
    from lmforge.deploy.server import running_server
    from lmforge.flows.pipeline import pipeline_flow

    base = checkpoint("gpt2")
    checked = check_base(base)
    cfg = load_config(TINY_CONFIG, [f"training.model.init={json.dumps(str(base))}", *FEW])
    name = cfg.registry.model_name
    try:
        out = pipeline_flow(cfg)
        stages = out["stages"]
        assert set(stages) == {"data", "features", "train", "evaluate", "compress", "deploy", "monitor"}

        # The gate compared the fine-tune with the base, on the same sample, and it won.
        ev = stages["evaluate"]["result"]
        decision = ev["decision"]
        assert decision["promote"], decision["reason"]
        assert "first fine-tune of base" in decision["reason"] and "unigram" not in decision["reason"]
        base_bpc = decision["base"]["metrics"]["bpc"]
        assert ev["metrics"]["bpc"] <= base_bpc - cfg.registry.bpc_margin
        assert decision["base"]["sha256"] == checked.sha256

        # The champion is a GPT-2 with the base's tokenizer and names its base.
        champion = current(workspace, name, "champion")
        assert champion == ev["version"]
        folder = download_model(workspace, name, champion)
        assert json.loads((folder / "config.json").read_text())["model_type"] == "gpt2"
        assert tokenizer_hash(folder) == tokenizer_hash(base)
        tags = version_tags(workspace, name, champion)
        assert tags["base_sha256"] == checked.sha256 and tags["base_path"] == str(checked.path)
        assert tags["base_model_type"] == "gpt2"
        use_workspace(workspace)
        run = MlflowClient().get_run(ev["eval_run_id"])
        assert run.data.metrics["base_bpc"] == pytest.approx(base_bpc)

        # Compression on Conv1D: int8 and LoRA built, channel pruning not built, with the reason.
        comp = stages["compress"]["result"]
        assert {"int8", "lora"} <= set(comp["versions"]), comp
        assert "gated MLP" in comp["not_registered"]["channels"]
        for version in comp["versions"].values():   # every variant keeps the base's tokenizer
            assert tokenizer_hash(download_model(workspace, name, version)) == tokenizer_hash(base)

        # Triton serves production (the champion or its compressed variant) with the base's tokenizer.
        production = current(workspace, name, "production")
        assert production in {champion, *comp["versions"].values()}
        assert tokenizer_hash(download_model(workspace, name, production)) == tokenizer_hash(base)
        (gen,) = client.generate(running_server(workspace).url, ["def add(a, b):"], params=client.Params(max_tokens=4))
        assert gen.output_tokens == len(gen.token_ids) <= 4   # answered (a 4-step model may stop at once, on eos)
        assert stages["monitor"]["result"]

        # `lmforge status` names the base of the training run and of the aliased versions.
        status = status_dict(workspace)
        (row,) = status["training_runs"]
        assert row["base"]["name"] == base.name and row["base"]["sha256"] == checked.sha256
        (model,) = status["registered_models"]
        assert {a: b["sha256"] for a, b in model["bases"].items()} == {a: checked.sha256 for a in model["aliases"]}
    finally:
        deployment.stop(workspace)
