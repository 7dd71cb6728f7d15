"""An int8 variant is measured on the CPU on a GPU host; a float model still goes to the GPU.

torch's dynamic int8 Linear runs `quantized::linear_dynamic`, which has CPU kernels only: on a
GPU host the compress stage's int8 measurement (and an evaluation of an int8 folder) failed
because bits_per_character moved every model to CUDA. No GPU is needed here: CUDA is made to
look present, and every `Module.to` is recorded; one to CUDA is refused with `HandedCuda`
(recorded, never done), so a float model's trip to the GPU shows as that exception.
"""

from __future__ import annotations

import pytest
import torch

from lmforge.components.compression.measure import evaluate_variant
from lmforge.components.compression.quantize import quantize_int8_variant
from lmforge.components.compression.tradeoff import tradeoff_markdown, tradeoff_rows
from lmforge.components.compression.variant import load_variant
from lmforge.components.evaluation import evaluate_model_dir
from lmforge.components.evaluation.bpc import bits_per_character
from lmforge.components.runtime import accelerator
from lmforge.components.sections.compression import CompressionConfig, QuantizeConfig
from lmforge.components.sections.evaluation import EvaluationConfig
from lmforge.components.serving.modelload import load_tokenizer
from tests.integration.evalreg_support import make_eval_dataset

CFG = EvaluationConfig(max_examples=2, max_new_tokens=4, batch_size=2, bpc_max_docs=3)
INT8_REASON = "quantized::linear_dynamic is CPU-only"


class HandedCuda(Exception):
    """A module was asked onto a CUDA device."""


def _device_of(args, kwargs):
    for a in (*args, kwargs.get("device")):
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
    return None


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA looks present; returns the (module class, device type) of every Module.to with a device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    moves: list[tuple[str, str]] = []
    real_to = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device = _device_of(args, kwargs)
        if device is not None:
            moves.append((type(self).__name__, device.type))
            if device.type == "cuda":
                raise HandedCuda(type(self).__name__)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    assert accelerator.pick_device().type == "cuda"
    return moves


@pytest.fixture(scope="module")
def int8_dir(tiny_model_dir, tmp_path_factory):
    return quantize_int8_variant(tiny_model_dir, tmp_path_factory.mktemp("v") / "int8", QuantizeConfig())


def test_runnable_device_keeps_int8_on_the_cpu_and_float_where_wanted(int8_dir, tiny_model_dir):
    int8, parent = load_variant(int8_dir), load_variant(tiny_model_dir)
    assert accelerator.cpu_only_kernels(int8) == ["quantized::linear_dynamic"]
    assert accelerator.cpu_only_kernels(parent) == []
    choice = accelerator.runnable_device(int8, "cuda:0")
    assert choice.device == torch.device("cpu") and choice.fallback and choice.reason == INT8_REASON
    assert choice.label == f"cpu ({INT8_REASON})"
    assert accelerator.runnable_device(parent, "cuda:0").device == torch.device("cuda:0")
    assert accelerator.runnable_device(int8, "cpu").label == "cpu"


def test_a_statically_quantized_module_or_tensor_is_cpu_only_too():
    static = torch.ao.nn.quantized.Linear(4, 4)
    assert accelerator.cpu_only_kernels(torch.nn.Sequential(static)) == ["quantized::linear"]

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8))

    assert accelerator.cpu_only_kernels(Holder())[0].startswith("quantized torch.qint8 tensors")
    assert accelerator.runnable_device(Holder(), "cuda").device.type == "cpu"


def test_bpc_never_hands_an_int8_model_a_cuda_device(fake_cuda, int8_dir):
    model, tok = load_variant(int8_dir), load_tokenizer(int8_dir)
    for device in (None, "cuda"):  # the host's pick, and a caller that asks for the GPU outright
        r = bits_per_character(model, tok, ["def f(x):\n    return x"], start_id=tok.eos_token_id, context_length=16,
                               device=device)
        assert r.bpc > 0
    assert fake_cuda and all(dev == "cpu" for _, dev in fake_cuda)


def test_compress_measures_int8_on_the_cpu_and_a_float_parent_on_the_gpu(fake_cuda, workspace, int8_dir,
                                                                          tiny_model_dir):
    dataset = workspace.dataset_dir(make_eval_dataset(workspace, per_module=3))
    m = evaluate_variant(int8_dir, dataset, CFG)
    assert all(dev == "cpu" for _, dev in fake_cuda)
    assert m["device"] == "cpu" and m["device_reason"] == INT8_REASON and m["device_fallback"] and m["bpc"] > 0
    assert tradeoff_rows(m, {}, CompressionConfig())[0]["device"] == f"cpu ({INT8_REASON})"
    with pytest.raises(HandedCuda):  # the float parent is sent to the GPU (and stopped there by the fake)
        evaluate_variant(tiny_model_dir, dataset, CFG)
    assert fake_cuda[-1][1] == "cuda"


def test_the_tradeoff_table_says_where_each_variant_was_measured():
    base = {"params": 10, "disk_bytes": 4e6, "weight_bytes": 4e6, "tokens_per_s": 10.0, "ttft_ms": 5.0, "bpc": 2.0,
            "rougeL": 0.3, "bleu": 5.0}
    parent = {**base, "device": "cuda", "device_reason": "CUDA is available", "device_fallback": False}
    int8 = {**base, "weight_bytes": 1e6, "device": "cpu", "device_reason": INT8_REASON, "device_fallback": True}
    rows = tradeoff_rows(parent, {"int8": int8}, CompressionConfig())
    assert [r["device"] for r in rows] == ["cuda", f"cpu ({INT8_REASON})"]
    md = tradeoff_markdown(rows)
    assert f"| cpu ({INT8_REASON}) |" in md and "| cuda |" in md
    assert tradeoff_rows(base, {}, CompressionConfig())[0]["device"] == "n/a"  # metrics from before the column


def test_evaluating_an_int8_folder_stays_on_the_cpu(fake_cuda, workspace, int8_dir):
    dataset = workspace.dataset_dir(make_eval_dataset(workspace, per_module=3))
    r = evaluate_model_dir(int8_dir, dataset, CFG)
    assert all(dev == "cpu" for _, dev in fake_cuda)
    assert r.info["device"] == "cpu" and r.info["device_reason"] == INT8_REASON
