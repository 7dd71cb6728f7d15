"""The device a stage runs on and the precision it computes in, both chosen from the hardware found.

    dev = pick_device()                            # torch.device("cuda") when there is a GPU, else cpu
    choice = choose_precision("auto", dev)         # Precision(name="fp32", reason="bf16 matmul 16.8 vs fp32 85.7 GFLOP/s ...")
    with autocast(dev, choice): loss = model(...)  # bf16 autocast only when the choice is bf16
    x = to_device(x, dev)                          # pinned + non-blocking on CUDA, a no-op on CPU
    where = runnable_device(model)                 # DeviceChoice(cpu, "quantized::linear_dynamic is CPU-only") for int8
    gpus = visible_gpus()                          # ["0", "1"]: the GPUs this process may use

Every stage that puts tensors on a device (training ranks, evaluation, compression fine-tuning,
distillation) takes it from here, so placement is decided in one place.

A model goes where its kernels exist: `runnable_device(model, wanted)` is `wanted` (default: the
host's pick) unless the model holds modules whose kernels are CPU-only, torch's quantized layers
(an int8 variant's dynamic `Linear` runs `quantized::linear_dynamic`, fbgemm/qnnpack, CPU only);
then it is the CPU, with that reason. `cpu_only_kernels` lives in components/serving/modelload.py, which
the Triton model repository carries, so the served model asks the same function.

`precision = "auto"` picks bf16 only where it is really faster: on CUDA where the GPU has native
bf16 (`torch.cuda.is_bf16_supported(including_emulation=False)`: compute capability 8.0 or
later; a V100 or T4 only emulates it); on CPU by timing bf16 against fp32 matmuls on one core (a CPU
without AVX512-BF16/AMX runs bf16 5-30x slower than fp32, one with them ~2-4x faster). The probe
runs once per machine (again while the last one came from a busy machine) and is cached in
`machine_cache()` (~/.cache/lmforge, or $LMFORGE_CACHE_DIR), keyed by the CPU, its flags,
torch's build and the ISA overrides (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) that change
which kernels run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lmforge.components.errors import UserError
from lmforge.components.runtime import machine
from lmforge.components.runtime.machine import machine_cache_dir
from lmforge.components.serving.modelload import cpu_only_kernels

CACHE_ENV = machine.CACHE_ENV  # ~/.cache/lmforge unless set (components/runtime/machine.py)
BF16_MIN_SPEEDUP = 1.1  # bf16 must beat fp32 by this much to be worth its rounding
_ISA_ENVS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


@dataclass(frozen=True)
class Precision:
    name: str          # "bf16" | "fp32"
    reason: str        # one line: what was measured or checked, and why this precision

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.name == "bf16" else torch.float32

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def pick_device() -> torch.device:
    """The first visible GPU when CUDA is available, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def visible_gpus() -> list[str]:
    """Physical ids of the GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else all of them."""
    if not torch.cuda.is_available():
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [str(i) for i in range(torch.cuda.device_count())]
    ids = [s.strip() for s in env.split(",") if s.strip()]
    if not all(s.isdigit() for s in ids):
        raise UserError("CUDA_VISIBLE_DEVICES", env, "names GPUs by UUID, and DeepSpeed's launcher takes indices only",
                        "Set it to GPU indices (nvidia-smi -L lists them), e.g. CUDA_VISIBLE_DEVICES=0,1")
    return ids[:torch.cuda.device_count()]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; from pinned memory and non-blocking when that is a GPU."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def model_device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@dataclass(frozen=True)
class DeviceChoice:
    device: torch.device
    reason: str          # one line: why this device
    fallback: bool       # True when the model's kernels overrode the device that was wanted

    @property
    def label(self) -> str:
        """The device, with the reason when the model forced the CPU: cpu (quantized::linear_dynamic is CPU-only)."""
        return f"{self.device} ({self.reason})" if self.fallback else str(self.device)

    def to_dict(self) -> dict[str, Any]:
        return {"device": str(self.device), "reason": self.reason, "fallback": self.fallback}


def runnable_device(model: torch.nn.Module, wanted: torch.device | str | None = None) -> DeviceChoice:
    """Where `model` can run: `wanted` (default: `pick_device()`), or the CPU when its kernels exist there only."""
    if wanted is None:
        device = pick_device()
        why = "CUDA is available" if device.type == "cuda" else "no CUDA device"
    else:
        device, why = torch.device(wanted), "as asked"
    if device.type != "cpu":
        kernels = cpu_only_kernels(model)
        if kernels:
            return DeviceChoice(torch.device("cpu"), f"{', '.join(kernels)} {'is' if len(kernels) == 1 else 'are'} "
                                                     f"CPU-only", True)
    return DeviceChoice(device, why, False)


@contextlib.contextmanager
def on_device(model: torch.nn.Module, device: torch.device | str) -> Iterator[torch.nn.Module]:
    """`model` moved to `device` for the block, and back to where it was after."""
    home = model_device(model)
    model.to(device)
    try:
        yield model
    finally:
        model.to(home)


def autocast(device: torch.device | str, precision: Precision) -> contextlib.AbstractContextManager[Any]:
    device = torch.device(device)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision.name == "bf16")


def choose_precision(requested: str, device: torch.device | str | None = None) -> Precision:
    """`requested` ("auto" | "bf16" | "fp32") resolved for `device`, with the reason."""
    device = torch.device(device) if device is not None else pick_device()
    if requested in ("bf16", "fp32"):
        return Precision(requested, f"{requested} was set in the config")
    if requested != "auto":
        raise UserError("precision", requested, "is not a precision", "Use auto, bf16 or fp32")
    if device.type == "cuda":
        # Native bf16 only: the default (including_emulation=True) is also True on a V100 or T4
        # (compute capability 7.x), where bf16 tensors can be made but their matmuls are emulated
        # and slower than fp32.
        ok = bool(torch.cuda.is_bf16_supported(including_emulation=False))
        name = torch.cuda.get_device_name(device)
        why = (f"native bf16 (compute capability {_capability(device)})" if ok else
               f"compute capability {_capability(device)} < 8.0: "
               + ("bf16 is emulated there, slower than fp32" if torch.cuda.is_bf16_supported() else "no bf16 there"))
        return Precision("bf16" if ok else "fp32",
                         f"torch.cuda.is_bf16_supported() is {ok} on {name} with including_emulation=False: {why}")
    probe = cpu_bf16_probe()
    ratio = probe["bf16_flops"] / max(probe["fp32_flops"], 1.0)
    name = "bf16" if ratio >= BF16_MIN_SPEEDUP else "fp32"
    flags = ", ".join(f"{f}: {'yes' if f in probe['flags'] else 'no'}" for f in ("avx512_bf16", "amx_bf16"))
    return Precision(name, f"bf16 matmul {probe['bf16_flops'] / 1e9:.1f} vs fp32 {probe['fp32_flops'] / 1e9:.1f} GFLOP/s "
                           f"on one core of this CPU ({ratio:.2f}x; {flags}; {'cached' if probe['cached'] else 'measured now'})")


def _capability(device: torch.device) -> str:
    """The compute capability of a CUDA device as "8.0", for a reason string ("unknown" when it cannot be read)."""
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except (RuntimeError, AssertionError, ValueError):  # no driver, or a build without CUDA: only the text suffers
        return "unknown"
    return f"{major}.{minor}"


# --- the per-machine cache ------------------------------------------------------------------

def machine_cache() -> Path:
    return machine_cache_dir() / "hardware.json"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return set(line.split(":", 1)[-1].split())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """What decides matmul speed here: CPU model, its flags, core count, torch build and ISA overrides."""
    isa = ",".join(f"{k}={os.environ.get(k, '')}" for k in _ISA_ENVS)
    raw = f"{cpu_model()}|{sorted(cpu_flags())}|{os.cpu_count()}|torch {torch.__version__}|{isa}"
    return f"{platform.node()}:{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def cache_get(entry: str) -> dict[str, Any] | None:
    path = machine_cache()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data.get(machine_key(), {}).get(entry)


def cache_put(entry: str, value: dict[str, Any]) -> None:
    from lmforge.components.workspace import atomic_write_json

    path = machine_cache()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data.setdefault(machine_key(), {})[entry] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, data)
    except OSError:
        pass  # a read-only home costs a re-measurement next time, nothing else


# --- the CPU probe --------------------------------------------------------------------------

def matmul_flops(dtype: torch.dtype, *, n: int, device: torch.device | str = "cpu", seconds: float = 0.1,
                 max_reps: int = 50) -> tuple[float, float]:
    """(best FLOP/s, seconds of the slowest layout's matmul) of n x n matmuls over about `seconds`.

    Both layouts are timed, `a @ b` and `F.linear(a, b)` (= a @ b.T, what nn.Linear runs): on a
    CPU without native bf16 the second is ~10x faster in bf16, so `a @ b` alone is no peak. A
    layout whose first call already took half a second (or `seconds`) is not repeated.
    """
    import torch.nn.functional as F

    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    best_s, slowest_s = float("inf"), 0.0
    for op in (lambda: a @ b, lambda: F.linear(a, b)):
        t0 = time.perf_counter()
        op()  # first call: kernel selection, allocation
        sync()
        first = time.perf_counter() - t0
        op_best, deadline = first, time.perf_counter() + seconds / 2
        for _ in range(max_reps if first < max(seconds, 0.5) else 0):  # the first call may include thread start-up
            t0 = time.perf_counter()
            op()
            sync()
            op_best = min(op_best, time.perf_counter() - t0)
            if time.perf_counter() > deadline:
                break
        best_s, slowest_s = min(best_s, op_best), max(slowest_s, op_best)
    return 2 * n ** 3 / best_s, slowest_s


def cpu_bf16_probe(*, n: int = 512) -> dict[str, Any]:
    """bf16 and fp32 matmul FLOP/s on this CPU (cached per machine): {"bf16_flops", "fp32_flops", "flags", "cached"}."""
    cached = cache_get("cpu_bf16_probe")
    if cached is not None and cached.get("quiet", False):
        return {**cached, "cached": True}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    # One thread (a few-millisecond matmul fits in a scheduler slice, so the best of several is the
    # core's own rate however busy the machine), alternated, best of each.
    fp32 = bf16 = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(2):
            fp32 = max(fp32, matmul_flops(torch.float32, n=n, seconds=0.05)[0])
            bf16 = max(bf16, matmul_flops(torch.bfloat16, n=n, seconds=0.05)[0])
    finally:
        torch.set_num_threads(threads)
    value = {"bf16_flops": bf16, "fp32_flops": fp32, "n": n, "threads": 1,
             "flags": sorted(f for f in cpu_flags() if "bf16" in f or f.startswith("amx")),
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             # Taken while other work shared the cores: the ratio held, but measure again next time.
             "quiet": load < (os.cpu_count() or 1) / 2, "load_avg": load}
    cache_put("cpu_bf16_probe", value)
    return {**value, "cached": False}
