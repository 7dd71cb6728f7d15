"""Compression fine-tuning, distillation and BPC take their device and precision from components/runtime/accelerator.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.components.runtime import accelerator


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(accelerator.CACHE_ENV, str(tmp_path / "cache"))


@pytest.fixture
def shards(tmp_path):
    from lmforge.components.data.shards import write_shards

    rng = np.random.default_rng(0)
    docs = [rng.integers(4, 512, size=200).tolist() for _ in range(20)]
    return write_shards(tmp_path / "shards", {"train": docs}, vocab_size=512) and tmp_path / "shards"


def slow_bf16(monkeypatch):
    monkeypatch.setattr(accelerator, "matmul_flops",
                        lambda dtype, **k: (1e9 if dtype == torch.bfloat16 else 30e9, 0.01))


@pytest.mark.parametrize("bf16, autocast_seen", [(None, False), (True, True), (False, False)])
def test_finetune_autocasts_only_when_the_precision_says_bf16(monkeypatch, shards, tiny_model_dir, bf16, autocast_seen):
    from transformers import AutoModelForCausalLM

    from lmforge.components.compression.finetune import Finetuner, lm_loss
    from lmforge.components.sections.compression import FinetuneConfig

    slow_bf16(monkeypatch)  # a CPU without native bf16: auto must not pick it
    tuner = Finetuner(FinetuneConfig(seq_len=32, batch_size=2, lr=1e-3, bf16=bf16), shard_dir=shards, seed=0)
    assert tuner.device == accelerator.pick_device()
    assert tuner.precision.name == ("bf16" if autocast_seen else "fp32")
    seen = []

    def loss_fn(model, x, y):
        seen.append((torch.is_autocast_enabled(tuner.device.type), x.device.type))
        return lm_loss(model, x, y)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    losses = tuner.run(model, steps=2, loss_fn=loss_fn)
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert seen == [(autocast_seen, tuner.device.type)] * 2
    assert accelerator.model_device(model) == torch.device("cpu")  # back where it was


def test_bpc_runs_on_the_device_it_is_given_and_leaves_the_model_home(tiny_model_dir):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from lmforge.components.evaluation.bpc import bits_per_character

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    texts = ["Return the number of items.", "Open a file and return a stream."]
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].device.type), with_kwargs=True)
    a = bits_per_character(model, tok, texts, start_id=tok.eos_token_id, context_length=16, batch_size=1, device="cpu")
    b = bits_per_character(model, tok, texts, start_id=tok.eos_token_id, context_length=16, batch_size=3)
    assert a.bpc == pytest.approx(b.bpc, rel=1e-6) and a.tokens == b.tokens
    assert set(seen) == {"cpu", accelerator.pick_device().type}
    assert accelerator.model_device(model) == torch.device("cpu")
