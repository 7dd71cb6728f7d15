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

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

NOUNS = ["name", "path", "size", "value", "count", "mode", "text", "user", "group", "port", "host", "key", "item", "line",
         "file", "node", "label", "color", "index", "score"]
VERBS = {"get": "Return the {} of the object.", "set": "Set the {} to a new value.", "reset": "Reset the {} to its default.",
         "check": "Check that the {} is valid."}


def pairs_file(path: Path) -> Path:
    """Prompt/completion pairs whose completion follows from the prompt: learnable in a few dozen steps."""
    rows = [{"prompt": f"def {verb}_{noun}(self):", "completion": template.format(noun), "module": f"{verb}_{noun}"}
            for verb, template in VERBS.items() for noun in NOUNS]
    rows += [{"prompt": f"def {verb}_{noun}_{i}(self, other):", "completion": template.format(noun),
              "module": f"{verb}_{noun}_{i}"} for i in range(3) for verb, template in VERBS.items() for noun in NOUNS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def pretrained_base(random_base: Path, out: Path) -> Path:
    """The random llama checkpoint taught to write docstrings (plain causal LM, full weights, a second or so) for other
    functions than the pairs': a base that knows the form and the words, not which prompt leads to which answer."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(random_base)
    model = AutoModelForCausalLM.from_pretrained(random_base)
    from lmforge.components.data.records import lm_text

    texts = [tok.eos_token + lm_text(f"def {n}_info(self):", f"Describe the {n}.") for n in NOUNS]
    texts += [tok.eos_token + lm_text(f"def show_{n}(self, other):", f"Show the {n} of the other object.") for n in NOUNS]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    torch.manual_seed(0)
    for _ in range(150):
        enc = tok(rng.sample(texts, 16), return_tensors="pt", padding=True)
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        logits = model(**enc).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


SFT_SETTINGS = ["training.objective=sft", "training.lora.r=8", "training.lora.target_modules=[]", "training.lr=0.01",
                "training.warmup_steps=2", "training.precision=fp32", "training.seq_len=48", "training.micro_batch_size=8",
                "data.max_docs=1000", "data.dedup.enabled=false"]


@pytest.fixture(scope="module")
def sft_dataset(tmp_path_factory, checkpoint):
    """One data-stage run on the pairs with the llama base's tokenizer, shared by both strategies."""
    import os

    from lmforge.components.config import load_config
    from lmforge.components.workspace import Workspace
    from lmforge.flows.data import data_flow

    root = tmp_path_factory.mktemp("sft") / "ws"
    base = pretrained_base(checkpoint("llama"), root.parent / "base")
    source = pairs_file(root.parent / "pairs.jsonl")
    old = os.environ.get("LMFORGE_HOME")
    os.environ["LMFORGE_HOME"] = str(root)
    try:
        cfg = load_config(TINY_CONFIG, [f"data.source={json.dumps(str(source))}",
                                        f"training.model.init={json.dumps(str(base))}", *SFT_SETTINGS])
        data = data_flow(cfg)
    finally:
        os.environ.pop("LMFORGE_HOME") if old is None else os.environ.__setitem__("LMFORGE_HOME", old)
    return Workspace(root), data["dataset_version"], base, source


def _optimizer_param_names(ckpt: Path) -> set[str]:
    """The parameters DeepSpeed's optimizer holds state for, as its checkpoint records them (`param_shapes`)."""
    import torch

    states = torch.load(next(ckpt.glob("*mp_rank_00_model_states.pt")), map_location="cpu", weights_only=False)
    return {name for group in states["param_shapes"] for name in group}


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_sft_with_lora_trains_adapters_only_exports_base_plus_adapter_and_beats_the_base(strategy, sft_dataset,
                                                                                         monkeypatch):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lmforge.components.config import load_config
    from lmforge.components.evaluation.evaluate import evaluate_model_dir
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
    held = _optimizer_param_names(run_dir / "checkpoints" / "step-0000040")
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
    before = evaluate_model_dir(base, dataset, cfg.evaluation).metrics["rougeL"]
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
