"""Supervised fine-tuning with LoRA on a base, end to end, on 2 CPU ranks under ZeRO-2 and ZeRO-3.

Prompt/completion JSONL (no `text` field) goes through the data stage with the base's
tokenizer; training.objective = "sft" with training.lora.r = 8 trains adapters only. Checked:
only adapter parameters hold optimizer state (DeepSpeed's own checkpoint says which parameters
its optimizer holds), the merged export's logits equal the base plus the saved adapter (peft),
a resume is exact, and ROUGE-L on the held-out pairs rises over the base.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY_CONFIG
from tests.integration.sft_support import SFT_SETTINGS, make_sft_dataset, optimizer_param_names

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def sft_dataset(tmp_path_factory, checkpoint):
    return make_sft_dataset(tmp_path_factory.mktemp("sft") / "ws", checkpoint("llama"))


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_sft_with_lora_trains_adapters_only_exports_base_plus_adapter_and_beats_the_base(strategy, sft_dataset,
                                                                                         monkeypatch):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lmforge.components.config import load_config
    from lmforge.components.evaluation.evaluate_model import evaluate_model_dir
    from lmforge.components.serving.task import Task
    from lmforge.flows.train import train_flow

    ws, version, base, _ = sft_dataset
    monkeypatch.setenv("LMFORGE_HOME", str(ws.root))
    cfg = load_config(TINY_CONFIG, [f"training.model.init={json.dumps(str(base))}", *SFT_SETTINGS,
                                    f"training.parallel.strategy={strategy}", "training.max_steps=40",
                                    "training.save_every=20", f"training.run_name=sft-{strategy}",
                                    "evaluation.max_examples=24", "evaluation.max_new_tokens=12"])
    out = train_flow(cfg)
    run_dir, export = ws.run_dir(out["run"]), Path(out["export"])

    # Only the adapters hold optimizer state: DeepSpeed's checkpoint lists every parameter its optimizer steps.
    held = optimizer_param_names(run_dir / "checkpoints" / "step-0000040")
    assert held and all(".lora_A." in n or ".lora_B." in n for n in held), sorted(held)[:5]
    peft_names = {n for n in held}
    assert len(peft_names) == 2 * 7 * 2  # A and B on the 7 projections of each of the 2 llama blocks

    # The merged export is the base plus the adapter the run saved beside it.
    merged = AutoModelForCausalLM.from_pretrained(export).eval()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), export / "adapter").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    assert not torch.allclose(a, plain, atol=1e-3)  # the adapters learned something
    meta = json.loads((export / "lmforge.json").read_text())
    assert meta["objective"] == "sft" and meta["lora"]["r"] == 8

    # ROUGE-L on held-out pairs, through the one generation path: the fine-tune over the base.
    dataset = ws.dataset_dir(version)
    tuned = evaluate_model_dir(export, dataset, cfg.evaluation).metrics["rougeL"]
    before = evaluate_model_dir(base, dataset, cfg.evaluation, default_task=Task.load(export)).metrics["rougeL"]
    assert tuned > before + 0.05, (tuned, before)


def test_sft_lora_resume_is_exact(sft_dataset, monkeypatch):
    """Four steps straight, or two, a stop, and two more from the checkpoint: the same losses and the same adapter."""
    from safetensors.torch import load_file

    from lmforge.components.config import load_config
    from lmforge.flows.train import train_flow

    ws, _, base, _ = sft_dataset
    monkeypatch.setenv("LMFORGE_HOME", str(ws.root))
    common = [f"training.model.init={json.dumps(str(base))}", *SFT_SETTINGS, "training.parallel.strategy=zero2",
              "training.save_every=2"]
    straight = train_flow(load_config(TINY_CONFIG, [*common, "training.max_steps=4", "training.run_name=straight"]))
    train_flow(load_config(TINY_CONFIG, [*common, "training.max_steps=2", "training.run_name=resumed"]))
    resumed = train_flow(load_config(TINY_CONFIG, [*common, "training.max_steps=4", "training.run_name=resumed"]),
                         resume=True)

    def losses(name: str) -> list[float]:
        rows = [json.loads(line) for line in (ws.run_dir(name) / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if r["step"] > 2]

    assert losses("straight") == losses("resumed")
    a = load_file(str(Path(straight["export"]) / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(Path(resumed["export"]) / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
