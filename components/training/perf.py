"""The peak FLOP/s a run's MFU is measured against, and the MFU itself (never above 1).

    peak = device_peak("bf16", torch.device("cuda"))   # Peak(flops=9.89e14, source="datasheet: NVIDIA H100 SXM, dense bf16")
    peak = device_peak("fp32", torch.device("cpu"))    # Peak(flops=2.0e11, source="measured: best fp32 GEMM up to 512^2,
                                                       #      one core x 2 physical cores, ...")
    mfu(tokens_per_s=9000, flops_per_token=3.2e7, peak_flops=peak.flops)   # raises MfuAboveOne above 1

For a GPU in the datasheet table the peak is NVIDIA's dense (non-sparse) figure for the
precision in use; fp32 on CUDA runs its matmuls as TF32 (the rank turns it on), so it is
measured against the TF32 figure. Any other device gets a GEMM peak measured once per machine
before ranks start and cached (components/runtime/accelerator.py): an unknown GPU's best large GEMM;
a CPU's best single-core GEMM times its physical cores. A measured figure is a lower bound of the true
peak, so the cache keeps the best one seen and a measurement taken while the machine was busy
is taken again next time.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lmforge.components.runtime.accelerator import cache_get, cache_put, matmul_flops
from lmforge.components.runtime.cpus import usable_cpus

T = 1e12
# (pattern on torch.cuda.get_device_name, product, dense TFLOP/s by precision). Order matters: the
# first match wins, so variants come before the family name. Sources: NVIDIA product datasheets.
DATASHEET: list[tuple[str, str, dict[str, float]]] = [
    (r"H100.*NVL", "NVIDIA H100 NVL", {"bf16": 835 * T, "tf32": 417.5 * T, "fp32": 60 * T}),
    (r"H100.*PCIe", "NVIDIA H100 PCIe", {"bf16": 756.5 * T, "tf32": 378 * T, "fp32": 51.2 * T}),
    (r"\bH100\b", "NVIDIA H100 SXM", {"bf16": 989.4 * T, "tf32": 494.7 * T, "fp32": 66.9 * T}),
    (r"\bH200\b.*NVL", "NVIDIA H200 NVL", {"bf16": 835 * T, "tf32": 417.5 * T, "fp32": 60 * T}),
    (r"\bH200\b", "NVIDIA H200 SXM", {"bf16": 989.4 * T, "tf32": 494.7 * T, "fp32": 66.9 * T}),
    (r"\bA100\b", "NVIDIA A100", {"bf16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}),
    (r"\bL40S\b", "NVIDIA L40S", {"bf16": 362.05 * T, "tf32": 183 * T, "fp32": 91.6 * T}),
    (r"\bL40\b", "NVIDIA L40", {"bf16": 181.05 * T, "tf32": 90.5 * T, "fp32": 90.5 * T}),
    (r"\bL4\b", "NVIDIA L4", {"bf16": 121 * T, "tf32": 60 * T, "fp32": 30.3 * T}),
    (r"\bA10\b", "NVIDIA A10", {"bf16": 125 * T, "tf32": 62.5 * T, "fp32": 31.2 * T}),
]
_SIZES = (512, 1024, 2048, 4096, 8192)
# v3: the CPU figure counts physical cores; v2 entries counted SMT siblings too, and since the
# cache keeps the best figure seen, an old over-count would otherwise be kept for ever.
_CACHE_VERSION = "peak-v3"


@dataclass(frozen=True)
class Peak:
    flops: float       # dense FLOP/s of one device (one GPU, or the whole CPU with all its cores)
    source: str        # "datasheet: ..." or "measured: ..."

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class MfuAboveOne(RuntimeError):
    """An MFU above 1: the FLOP count or the peak is wrong, and the figure must not be logged."""


def datasheet_peak(device_name: str, precision: str) -> Peak | None:
    for pattern, product, figures in DATASHEET:
        if re.search(pattern, device_name) and precision in figures:
            return Peak(figures[precision], f"datasheet: {product} ({device_name}), dense {precision}")
    return None


def peak_precision(precision: str, device: torch.device) -> str:
    """The precision whose peak applies: fp32 matmuls on CUDA run as TF32 (see the rank)."""
    return "tf32" if device.type == "cuda" and precision == "fp32" else precision


def device_peak(precision: str, device: torch.device | str) -> Peak:
    device = torch.device(device)
    key = peak_precision(precision, device)
    if device.type == "cuda":
        found = datasheet_peak(torch.cuda.get_device_name(device), key)
        if found is not None:
            return found
    return measured_peak(key, device)


def physical_cores() -> tuple[int, str]:
    """(cores, what they are) for the CPU peak: physical cores, not logical CPUs.

    SMT siblings share one core's FMA units, so two threads on one core do not double its GEMM
    rate: a peak of one thread's rate x logical CPUs is up to twice too high, and the MFU half
    of the truth. psutil cannot always tell (some containers and VMs hide the topology and it
    returns None); then the logical count is the best figure there is, and the source says so.
    A process confined to fewer CPUs than the machine has (taskset, a container's cpuset) gets
    its share of the cores: physical x allowed logical CPUs / all logical CPUs.
    """
    import psutil

    logical = os.cpu_count() or 1
    allowed = usable_cpus()
    physical = psutil.cpu_count(logical=False)
    cores, what = (physical, "physical cores") if physical else (logical, "logical CPUs (physical cores unknown)")
    if allowed < logical:
        return max(1, cores * allowed // logical), f"{what}, the {allowed} of {logical} CPUs this process may use"
    return cores, what


def measured_peak(precision: str, device: torch.device, *, seconds_per_size: float = 0.25, max_matmul_s: float = 0.1) -> Peak:
    """The best GEMM FLOP/s over growing square sizes (until one matmul takes `max_matmul_s`), cached per machine.

    On a CPU: one core's best, times the physical cores (physical_cores). A matmul of a few milliseconds on one thread
    fits in a scheduler time slice, so the best of many is what the core does when it runs,
    however busy the machine; an all-thread GEMM on a shared machine reads far lower than the
    ranks (one thread each) reach, and the MFU then exceeds 1.
    """
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cores, what = physical_cores()
    # The CPU figure is per core times cores: a process allowed fewer CPUs must not read a whole machine's figure.
    entry = f"{_CACHE_VERSION}:{device.type}:{name}:{precision}" + (f":{cores}cores" if device.type == "cpu" else "")
    cached = cache_get(entry)
    logical = os.cpu_count() or 1
    if cached is not None and cached["quiet"]:
        return Peak(cached["flops"], cached["source"] + " (cached)")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    old_threads, old_tf32 = torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    best, best_n = 0.0, 0
    try:
        for n in _SIZES:
            flops, one = matmul_flops(dtype, n=n, device=device, seconds=seconds_per_size)
            if flops > best:
                best, best_n = flops, n
            if one > max_matmul_s:
                break
    finally:
        torch.set_num_threads(old_threads)
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    if device.type == "cpu":
        best *= cores
        where = f"one core x {cores} {what}"
    else:
        where = name
    source = f"measured: best {precision} GEMM up to {best_n}^2, {where}, {time.strftime('%Y-%m-%d')}"
    if cached is not None and cached["flops"] >= best:
        best, source = cached["flops"], cached["source"]
    # A figure taken while other work shared the cores may be low; measure again next time.
    quiet = device.type != "cpu" or load < logical / 2  # the load average counts runnable threads over logical CPUs
    cache_put(entry, {"flops": best, "source": source, "quiet": quiet, "load_avg": load})
    return Peak(best, source)


def mfu(*, tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: tokens/s x FLOPs/token / peak. Above 1 is a bug and raises MfuAboveOne."""
    assert peak_flops > 0, peak_flops
    value = tokens_per_s * flops_per_token / peak_flops
    if value > 1.0:
        raise MfuAboveOne(f"MFU {value:.3f} > 1: {tokens_per_s:.0f} tokens/s x {flops_per_token:.4g} FLOPs/token exceeds "
                          f"the peak {peak_flops:.4g} FLOP/s; the peak (delete the cached figure in ~/.cache/lmforge/"
                          f"hardware.json to re-measure it) or the FLOP count is wrong")
    return value


def devices_in_job(device_type: str, world: int) -> int:
    """How many devices' peaks the job's throughput is measured against: every GPU, or every
    machine when the ranks are CPU processes that share one machine's cores."""
    if device_type == "cuda":
        return world
    local = int(os.environ.get("LOCAL_SIZE", world) or world)
    return max(1, world // max(1, local))


class ThroughputWindow:
    """Steps and tokens since the last logged step (or the last checkpoint save, which is not training time).

        window.add(tokens)            # after each step
        step_s, tokens_per_s = window.read()   # on a logged step: the averages, and a new window starts
        window.restart()              # after a save
    """

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self.restart()

    def restart(self) -> None:
        self.t0, self.steps, self.tokens = self.clock(), 0, 0

    def add(self, tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens

    def read(self) -> tuple[float, float]:
        elapsed = self.clock() - self.t0
        step_s, tokens_per_s = elapsed / max(self.steps, 1), self.tokens / elapsed
        self.restart()
        return step_s, tokens_per_s
