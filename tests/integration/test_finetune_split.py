"""A base split by tensor or pipeline parallelism trains as data parallelism does, where its architecture allows it.

On 2 CPU ranks, 3 steps in fp32, the same global batch of 8 windows each step: AutoTP (2-way)
on a tiny GPT-NeoX (one fused query_key_value projection) and 2 pipeline stages on a tiny
Phi-3 (fused qkv/gate_up projections) log the same losses as DDP on the same base and data,
and export the same model. An architecture a layout cannot split (GPT-2's Conv1D or a tied
head for AutoTP, GPT-NeoX or a tied head for the pipeline, Phi-3's tensor-parallel plan for
AutoTP) is refused before launch: tests/unit/training/test_base_split.py.
"""

from __future__ import annotations

import pytest

from tests.integration.train_support import run_training, tiny_training

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

LAYOUTS = {"ddp": ({"strategy": "ddp"}, 4),
           "tp2": ({"strategy": "zero1", "tensor": {"autotp_size": 2}}, 8),          # dp 1: 8 windows a step
           "pp2": ({"strategy": "ddp", "pipeline": {"stages": 2, "micro_batches": 2, "partition": "uniform"}}, 4)}


def base_dataset(ws, base):
    """The base's tokenizer and shards of standard-library docstrings, as the data stage leaves them."""
    from transformers import AutoTokenizer

    from lmforge.components.data.shards import write_shards
    from lmforge.components.model.basemodel import copy_tokenizer
    from lmforge.components.workspace import atomic_write_json
    from tests.integration.train_support import stdlib_records

    d = ws.dataset_dir("base0001")
    copy_tokenizer(base, d / "tokenizer")
    tok = AutoTokenizer.from_pretrained(base)
    ids = [tok(r.text)["input_ids"] + [tok.eos_token_id] for r in stdlib_records()]
    write_shards(d / "shards", {"train": ids[20:], "validation": ids[:20]}, vocab_size=len(tok))
    atomic_write_json(d / "manifest.json", {"version": "base0001"})
    ws.set_latest_dataset("base0001")


@pytest.mark.parametrize("kind, layout", [("gpt_neox", "tp2"), ("phi3", "pp2")])
def test_a_split_base_trains_and_exports_as_data_parallel_does(kind, layout, workspace, checkpoint):
    import torch
    from transformers import AutoModelForCausalLM

    base = checkpoint(kind)
    base_dataset(workspace, base)
    losses, exports = {}, {}
    for name in ("ddp", layout):
        parallel, micro = LAYOUTS[name]
        cfg = tiny_training(model={"init": str(base)}, parallel=parallel, micro_batch_size=micro, max_steps=3,
                            precision="fp32", save_every=100)
        events, run_dir = run_training(workspace, f"{kind}-{name}", cfg, version="base0001")
        losses[name] = [e["loss"] for e in events]
        exports[name] = AutoModelForCausalLM.from_pretrained(run_dir / "export").eval()
    assert losses[layout] == pytest.approx(losses["ddp"], abs=1e-4), losses
    assert exports[layout].config.model_type == kind
    ids = torch.randint(0, exports["ddp"].config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = exports["ddp"](input_ids=ids).logits, exports[layout](input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-3), (a - b).abs().max()
