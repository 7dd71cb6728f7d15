"""The machine's measured matmul peak, and model FLOPs utilisation against it.

    peak = matmul_peak_flops(torch.bfloat16, device="cpu")     # FLOP/s of this process's threads
    mfu(tokens_per_s=9000, flops_per_token=3.2e7, peak_flops=7e11)

MFU is measured against what this machine's GEMM actually reaches (not a datasheet), so
on a CPU it says how much of the achievable matmul throughput training uses.
"""

from __future__ import annotations

import time

import torch


def matmul_peak_flops(dtype: torch.dtype, *, device: str = "cpu", n: int = 1024, seconds: float = 0.6) -> float:
    """Best FLOP/s of n x n matmuls over ~`seconds`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a @ b
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        sync()
        best = max(best, 4 * 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def mfu(*, tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    return tokens_per_s * flops_per_token / peak_flops if peak_flops > 0 else 0.0
