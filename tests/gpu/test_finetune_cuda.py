"""On one CUDA device: a base fine-tuned with SFT + LoRA under ZeRO-2 and ZeRO-3, exported merged, and better than the base.

    pytest -m gpu tests/gpu/test_finetune_cuda.py      # skipped (not failed) where CUDA is missing

The same pairs, base and checks as tests/integration/test_sft_lora.py, through lmforge's real
launcher on the one visible GPU (NCCL; num_ranks unset): SFT batches (packed or padded,
position ids and attention masks included) reach the GPU, only the adapters hold optimizer
state, the merged export equals base + adapter, and ROUGE-L on held-out pairs rises. The
precision is fp32 (TF32 matmuls) so that the merged-export comparison has a tight tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_CONFIG
from tests.integration.sft_support import SFT_SETTINGS, make_sft_dataset, optimizer_param_names

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def sft_dataset(tmp_path_factory, checkpoint):
    return make_sft_dataset(tmp_path_factory.mktemp("sft_cuda") / "ws", checkpoint("llama"))


@pytest.mark.parametrize("strategy, batching", [("zero2", "pack"), ("zero3", "pad")])
def test_sft_lora_on_cuda(strategy, batching, sft_dataset, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lmforge.components.config import load_config
    from lmforge.components.evaluation.evaluate_model import evaluate_model_dir
    from lmforge.components.serving.task import Task
    from lmforge.flows.train import train_flow

    ws, version, base, _ = sft_dataset
    monkeypatch.setenv("LMFORGE_HOME", str(ws.root))
    cfg = load_config(TINY_CONFIG, [f"training.model.init={json.dumps(str(base))}", *SFT_SETTINGS,
                                    f"training.parallel.strategy={strategy}", f"training.sft.batching={batching}",
                                    "training.max_steps=40", "training.save_every=40", "training.compile=false",
                                    f"training.run_name=cuda-{strategy}", "evaluation.max_examples=24",
                                    "evaluation.max_new_tokens=12"])
    out = train_flow(cfg)
    run_dir, export = ws.run_dir(out["run"]), Path(out["export"])
    assert out["summary"]["backend"] == "nccl"
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert len(first["memory"]) == 1 and first["memory"][0]["device_peak"] > 0  # one rank, on the GPU

    held = optimizer_param_names(run_dir / "checkpoints" / "step-0000040")
    assert held and all(".lora_A." in n or ".lora_B." in n for n in held)

    merged = AutoModelForCausalLM.from_pretrained(export).eval()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), export / "adapter").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-3), (a - b).abs().max()

    dataset = ws.dataset_dir(version)
    tuned = evaluate_model_dir(export, dataset, cfg.evaluation)
    assert tuned.info["device"].startswith("cuda")
    before = evaluate_model_dir(base, dataset, cfg.evaluation, default_task=Task.load(export)).metrics["rougeL"]
    assert tuned.metrics["rougeL"] > before + 0.05, (tuned.metrics["rougeL"], before)
