"""Fine-tuning a local checkpoint end to end: data (the base's tokenizer) -> train (the base's weights) -> evaluate.

A tiny GPT-2 (Conv1D projections, tied embeddings) on ZeRO-2 and a tiny Qwen2 (grouped-query
attention, tied embeddings) on ZeRO-3, each on 2 CPU ranks: the export keeps the base's
model_type and tokenizer, loads with AutoModelForCausalLM, and the registered version names
the base's folder and content hash.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY_CONFIG

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("kind, strategy", [("gpt2", "zero2"), ("qwen2", "zero3")])
def test_a_base_is_fine_tuned_exported_as_itself_and_registered_with_its_lineage(kind, strategy, workspace, checkpoint):
    import torch
    from mlflow import MlflowClient
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lmforge.components.config import load_config
    from lmforge.components.model.basemodel import check_base, tokenizer_hash
    from lmforge.components.tracking import use_workspace
    from lmforge.flows.data import data_flow
    from lmforge.flows.evaluate import evaluate_flow
    from lmforge.flows.train import train_flow

    base = checkpoint(kind)
    cfg = load_config(TINY_CONFIG, [f"training.model.init={json.dumps(str(base))}", f"training.parallel.strategy={strategy}",
                                    "training.max_steps=4", "training.save_every=4", "training.precision=fp32"])
    data = data_flow(cfg)
    dataset = workspace.dataset_dir(data["dataset_version"])
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert tokenizer_hash(dataset / "tokenizer") == tokenizer_hash(base) == manifest["tokenizer_hash"]
    assert "data-base-tokenizer" in data["tasks"] and "data-tokenizer" not in data["tasks"]

    out = train_flow(cfg)
    assert out["summary"]["steps"] == 4 and out["summary"]["strategy"] == strategy
    export = Path(out["export"])
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.config.model_type == kind
    assert tokenizer_hash(export) == tokenizer_hash(base)
    checked = check_base(base)
    meta = json.loads((export / "lmforge.json").read_text())
    assert meta["base"]["sha256"] == checked.sha256 and meta["base"]["path"] == str(checked.path)
    # The engine's own logits on a fixed batch (fp32 here), reproduced by the exported folder.
    probe = load_file(str(workspace.run_dir(out["run"]) / "probe.safetensors"))
    with torch.no_grad():
        logits = model.eval()(input_ids=probe["input_ids"]).logits.float()
    assert torch.allclose(logits, probe["logits"], atol=1e-4), (logits - probe["logits"]).abs().max()

    # The ranks started from the base's weights, not a fresh init: the first logged loss (before any update, the mean
    # over both ranks' batches) is the base's own loss on those batches. Qwen2 only: GPT-2 trains with dropout.
    if kind == "qwen2":
        from lmforge.components.training.batches import TokenWindows
        from lmforge.components.training.pipeline_model import lm_loss

        windows = TokenWindows.open(workspace.training_shards(data["dataset_version"]), seq_len=cfg.training.seq_len,
                                    seed=cfg.training.seed)
        reference = AutoModelForCausalLM.from_pretrained(base).eval()
        with torch.no_grad():
            losses = [lm_loss(reference(input_ids=x).logits, y).item() for r in range(2)
                      for x, y in windows.micro_batches(0, dp_rank=r, dp_size=2, micro=cfg.training.micro_batch_size, accum=1)]
        first = json.loads((workspace.run_dir(out["run"]) / "metrics.jsonl").read_text().splitlines()[0])
        assert first["step"] == 1 and first["loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-4)

    use_workspace(workspace)
    client = MlflowClient()
    run = client.get_run(out["mlflow_run_id"])
    assert run.data.tags["base.sha256"] == checked.sha256 and run.data.params["model.init"] == str(checked.path)
    assert 0 < run.data.metrics["mfu"] < 1

    ev = evaluate_flow(cfg)
    version = client.get_model_version(cfg.registry.model_name, ev["version"])
    assert version.tags["base_sha256"] == checked.sha256 and version.tags["base_model_type"] == kind
