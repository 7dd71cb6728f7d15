"""On one CUDA device: every strategy trains 5 steps and exports; BPC and fine-tuning run on the GPU.

    pytest -m gpu tests/gpu          # skipped (not failed) where CUDA is missing

Each run goes through lmforge's real launcher (deepspeed --include localhost:<id>, NCCL), with
`num_ranks` unset, so it also checks that the default takes the one visible GPU.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from lmforge.components.workspace import Workspace
from tests.integration.train_support import make_dataset, run_training, tiny_training

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STRATEGIES = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "zero2-offload": {"strategy": "zero2", "offload_optimizer": True},
}


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    w = Workspace(tmp_path_factory.mktemp("gpu") / "ws").ensure()
    make_dataset(w)
    return w


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_trains_on_one_gpu_and_exports(ws, name, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cfg = tiny_training(max_steps=5, warmup_steps=2, save_every=5, parallel=STRATEGIES[name])
    assert cfg.num_ranks is None  # the default: every visible GPU, here one
    events, run_dir = run_training(ws, f"gpu-{name}", cfg, timeout_s=900)
    hw = json.loads((run_dir / "request-0.json").read_text())["hardware"]
    assert hw["device"] == "cuda" and hw["gpus"] == ["0"] and hw["compile"] is True
    assert hw["precision"] == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    losses = [e["loss"] for e in events]
    assert [e["step"] for e in events] == [1, 2, 3, 4, 5] and all(math.isfinite(x) for x in losses)
    for e in events:
        assert 0 < e["mfu"] < 1, e
        assert e["mfu"] == pytest.approx(e["tokens_per_s"] * e["flops_per_token"] / e["peak_flops"], rel=1e-9)
        assert e["memory"][0]["device_peak"] > 0
    model = AutoModelForCausalLM.from_pretrained(run_dir / "export").eval()
    probe = load_file(str(run_dir / "probe.safetensors"))
    with torch.no_grad():
        ours = model(input_ids=probe["input_ids"]).logits.float()
    assert torch.allclose(ours, probe["logits"], atol=5e-2, rtol=5e-2), (ours - probe["logits"]).abs().max()


def test_bpc_on_the_gpu_matches_the_cpu(tiny_model_dir):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from lmforge.components.evaluation.bpc import bits_per_character

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    texts = ["Return the number of items in the container.", "Open a file and return a stream object."] * 4
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].device.type), with_kwargs=True)
    on_gpu = bits_per_character(model, tok, texts, start_id=tok.eos_token_id, context_length=32, batch_size=4)
    on_cpu = bits_per_character(model, tok, texts, start_id=tok.eos_token_id, context_length=32, batch_size=4, device="cpu")
    assert seen[0] == "cuda" and seen[-1] == "cpu"
    assert on_gpu.bpc == pytest.approx(on_cpu.bpc, rel=1e-3) and on_gpu.tokens == on_cpu.tokens


def test_finetune_runs_on_the_gpu(ws, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from lmforge.components.compression.finetune import Finetuner, lm_loss
    from lmforge.components.sections.compression import FinetuneConfig

    tuner = Finetuner(FinetuneConfig(seq_len=32, batch_size=4, lr=1e-3), shard_dir=ws.training_shards("testdata0001"))
    assert tuner.device.type == "cuda"
    seen = []

    def loss_fn(model, x, y):
        seen.append(next(model.parameters()).device.type)
        return lm_loss(model, x, y)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(512)
    losses = tuner.run(model, steps=3, loss_fn=loss_fn)
    assert seen == ["cuda"] * 3 and all(math.isfinite(x) for x in losses)
    assert next(model.parameters()).device.type == "cpu"
