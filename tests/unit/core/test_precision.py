"""`precision = "auto"` on CUDA picks bf16 only where the GPU computes it natively.

No GPU is needed: torch.cuda is faked. A V100 or T4 (compute capability 7.x) answers
`is_bf16_supported()` with True by default, because bf16 tensors can be made there, but its
bf16 matmuls are emulated and slower than fp32; only `including_emulation=False` says so.
"""

from __future__ import annotations

import pytest
import torch

from lmforge.components.runtime import accelerator


def fake_gpu(monkeypatch, name: str, capability: tuple[int, int]) -> None:
    native = capability >= (8, 0)

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return native or including_emulation  # what torch 2.x answers on such a GPU

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)


@pytest.mark.parametrize("name, capability", [("Tesla V100-SXM2-16GB", (7, 0)), ("Tesla T4", (7, 5))])
def test_emulated_bf16_gives_fp32(monkeypatch, name, capability):
    fake_gpu(monkeypatch, name, capability)
    choice = accelerator.choose_precision("auto", torch.device("cuda"))
    assert choice.name == "fp32"
    assert name in choice.reason and f"compute capability {capability[0]}.{capability[1]}" in choice.reason
    assert "emulated" in choice.reason


@pytest.mark.parametrize("name, capability", [("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA H100 80GB HBM3", (9, 0))])
def test_native_bf16_gives_bf16(monkeypatch, name, capability):
    fake_gpu(monkeypatch, name, capability)
    choice = accelerator.choose_precision("auto", torch.device("cuda"))
    assert choice.name == "bf16"
    assert name in choice.reason and "native" in choice.reason


def test_a_gpu_without_any_bf16_gives_fp32(monkeypatch):
    fake_gpu(monkeypatch, "Tesla P100", (6, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    choice = accelerator.choose_precision("auto", torch.device("cuda"))
    assert choice.name == "fp32" and "Tesla P100" in choice.reason
