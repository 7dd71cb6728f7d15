"""Shared by the SFT + LoRA tests on CPU (tests/integration/test_sft_lora.py) and CUDA (tests/gpu): learnable
prompt/completion pairs, a base that knows their form but not the mapping, one data-stage run on them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import TINY_CONFIG

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
    from lmforge.components.serving.records import lm_text

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


def make_sft_dataset(root: Path, random_base: Path) -> tuple:
    """(workspace, dataset version, base folder, pairs file): one data-stage run on the pairs with the base's tokenizer."""
    from lmforge.components.config import load_config
    from lmforge.components.workspace import Workspace
    from lmforge.flows.data import data_flow

    base = pretrained_base(random_base, root.parent / "base")
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




def optimizer_param_names(ckpt: Path) -> set[str]:
    """The parameters DeepSpeed's optimizer holds state for, as its checkpoint records them (`param_shapes`)."""
    import torch

    states = torch.load(next(ckpt.glob("*mp_rank_00_model_states.pt")), map_location="cpu", weights_only=False)
    return {name for group in states["param_shapes"] for name in group}
