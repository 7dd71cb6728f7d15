"""A Mixture-of-Experts preset through the whole pipeline: data -> ... -> train (expert_parallel = 2) -> ... -> served.

The tiny preset at 4 layers with 4 experts (top-1), its experts spread over the 2 CPU ranks.
Training logs the routing to MLflow; the champion is a Qwen3-MoE folder; compression builds
int8, low-rank and LoRA variants, which act on the nn.Linear projections (attention and head)
and leave the router and the fused 3D expert tensors as they are, while channel pruning is not
built (no gated-MLP projections); Triton serves production.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY_CONFIG

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

MOE = ["training.model.num_layers=4", "training.model.moe.num_experts=4", "training.parallel.expert_parallel=2",
       "training.max_steps=80", "training.save_every=80", "training.log_every=20", "training.precision=fp32",
       "compression.quantize.casts=[]", "compression.prune.enabled=false", "compression.distill.enabled=false",
       "compression.lora.steps=2", "deploy.validation_latency_ms=60000"]


def test_a_moe_preset_trains_expert_parallel_and_serves(workspace):
    import torch
    from mlflow import MlflowClient

    from lmforge.components.compression.variant import load_variant
    from lmforge.components.config import load_config
    from lmforge.components.registry import current, download_model
    from lmforge.components.tracking import use_workspace
    from lmforge.deploy import client, deployment
    from lmforge.deploy.server import running_server
    from lmforge.flows.pipeline import pipeline_flow

    cfg = load_config(TINY_CONFIG, MOE)
    name = cfg.registry.model_name
    try:
        stages = pipeline_flow(cfg)["stages"]
        assert set(stages) == {"data", "features", "train", "evaluate", "compress", "deploy", "monitor"}

        # MLflow holds each logged step's auxiliary loss, per-expert load and dropped fraction.
        use_workspace(workspace)
        mlf = MlflowClient()
        run_id = stages["train"]["result"]["mlflow_run_id"]
        for key in ("moe_aux_loss", "moe_dropped_fraction", *(f"expert_tokens_e{i}" for i in range(4))):
            history = mlf.get_metric_history(run_id, key)
            assert [m.step for m in history] == [1, 20, 40, 60, 80], key
        loads = [mlf.get_metric_history(run_id, f"expert_tokens_e{i}")[-1].value for i in range(4)]
        assert sum(loads) == 4 * 64 * 2 * 4  # micro-batch x seq_len x ranks x sparse layers, top-1

        ev = stages["evaluate"]["result"]
        assert ev["decision"]["promote"], ev["decision"]["reason"]
        champion = download_model(workspace, name, current(workspace, name, "champion"))
        config = json.loads((champion / "config.json").read_text())
        assert config["model_type"] == "qwen3_moe" and config["num_local_experts"] == 4  # num_experts, as saved

        comp = stages["compress"]["result"]
        assert {"int8", "lowrank", "lora"} <= set(comp["versions"]), comp
        assert "gated MLP" in comp["not_registered"]["channels"]
        int8 = load_variant(download_model(workspace, name, comp["versions"]["int8"]))
        experts = int8.model.layers[0].mlp.experts
        assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.shape[0] == 4  # left whole

        production = current(workspace, name, "production")
        assert production in {ev["version"], *comp["versions"].values()}
        (gen,) = client.generate(running_server(workspace).url, ["def add(a, b):"], params=client.Params(max_tokens=4))
        assert gen.output_tokens == len(gen.token_ids) <= 4
        assert stages["monitor"]["result"]
    finally:
        deployment.stop(workspace)
