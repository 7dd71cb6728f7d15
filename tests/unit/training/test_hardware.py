"""Device, precision and peak are chosen from the hardware; MFU is true; collectives stay on the engine's device.

No GPU is needed: CUDA is faked where a decision depends on it, and the engine's device is
`meta` (not the CPU) so that a CPU tensor reaching a collective, which NCCL rejects with
"No backend type associated with device type cpu", fails here too.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from lmforge.components.errors import UserError
from lmforge.components.runtime import accelerator
from lmforge.components.training import collectives, perf, rank
from lmforge.components.training.launcher import LaunchRequest, command


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(accelerator.CACHE_ENV, str(tmp_path / "cache"))


def fake_rates(monkeypatch, rates: dict[torch.dtype, float]) -> list[torch.dtype]:
    calls: list[torch.dtype] = []

    def matmul_flops(dtype, *, n, device="cpu", seconds=0.1, max_reps=50):
        calls.append(dtype)
        return rates[dtype], 2 * n ** 3 / rates[dtype]

    monkeypatch.setattr(accelerator, "matmul_flops", matmul_flops)
    monkeypatch.setattr(perf, "matmul_flops", matmul_flops)
    return calls


@pytest.mark.parametrize("bf16, fp32, chosen", [(1.1e9, 34e9, "fp32"), (650e9, 175e9, "bf16"), (36e9, 34e9, "fp32")])
def test_auto_precision_on_cpu_follows_the_measured_matmul_rates(monkeypatch, bf16, fp32, chosen):
    fake_rates(monkeypatch, {torch.bfloat16: bf16, torch.float32: fp32})
    choice = accelerator.choose_precision("auto", "cpu")
    assert choice.name == chosen
    assert f"bf16 matmul {bf16 / 1e9:.1f} vs fp32 {fp32 / 1e9:.1f} GFLOP/s on one core" in choice.reason


def test_cpu_probe_is_cached_per_machine_and_isa_override(monkeypatch):
    calls = fake_rates(monkeypatch, {torch.bfloat16: 1e9, torch.float32: 30e9})
    monkeypatch.setattr(accelerator.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert accelerator.choose_precision("auto", "cpu").name == "fp32"
    measured = len(calls)
    again = accelerator.choose_precision("auto", "cpu")
    assert len(calls) == measured and "cached" in again.reason
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # other kernels run: measured anew
    accelerator.choose_precision("auto", "cpu")
    assert len(calls) == 2 * measured
    monkeypatch.setattr(accelerator.os, "getloadavg", lambda: (99.0, 0.0, 0.0))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    accelerator.choose_precision("auto", "cpu")
    accelerator.choose_precision("auto", "cpu")  # measured on a busy machine: not trusted from the cache
    assert len(calls) == 4 * measured


def test_explicit_precision_and_cuda_auto(monkeypatch):
    assert accelerator.choose_precision("fp32", "cpu").name == "fp32"
    assert accelerator.choose_precision("bf16", "cpu").reason == "bf16 was set in the config"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-16GB")
    choice = accelerator.choose_precision("auto", torch.device("cuda"))
    assert choice.name == "fp32" and "is_bf16_supported() is False on Tesla V100" in choice.reason
    with pytest.raises(UserError, match="is not a precision"):
        accelerator.choose_precision("fp16", "cpu")


@pytest.mark.parametrize("name, precision, product, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", "NVIDIA H100 SXM", 989.4),
    ("NVIDIA H100 PCIe", "bf16", "NVIDIA H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "tf32", "NVIDIA H100 NVL", 417.5),
    ("NVIDIA H200", "bf16", "NVIDIA H200 SXM", 989.4),
    ("NVIDIA A100-SXM4-80GB", "bf16", "NVIDIA A100", 312),
    ("NVIDIA L40S", "bf16", "NVIDIA L40S", 362.05),
    ("NVIDIA L4", "bf16", "NVIDIA L4", 121),
    ("NVIDIA A10", "tf32", "NVIDIA A10", 62.5),
])
def test_datasheet_peaks(name, precision, product, tflops):
    peak = perf.datasheet_peak(name, precision)
    assert peak is not None and peak.flops == pytest.approx(tflops * 1e12)
    assert peak.source.startswith(f"datasheet: {product} ") and f"dense {precision}" in peak.source


def test_unknown_gpu_is_measured_and_fp32_on_cuda_means_tf32():
    assert perf.datasheet_peak("NVIDIA GH200 480GB", "bf16") is None
    assert perf.datasheet_peak("NVIDIA A10G", "bf16") is None
    assert perf.peak_precision("fp32", torch.device("cuda")) == "tf32"
    assert perf.peak_precision("fp32", torch.device("cpu")) == "fp32"


def test_measured_peak_is_cached_when_quiet_and_keeps_the_best(monkeypatch):
    calls = fake_rates(monkeypatch, {torch.float32: 100e9})
    monkeypatch.setattr(perf.os, "getloadavg", lambda: (99.0, 0, 0))  # busy: measured, not trusted
    first = perf.measured_peak("fp32", torch.device("cpu"))
    cores, _ = perf.physical_cores()
    assert first.flops == 100e9 * cores and first.source.startswith("measured: best fp32 GEMM")
    fake_rates(monkeypatch, {torch.float32: 60e9})  # a slower, busier second look never lowers the peak
    monkeypatch.setattr(perf.os, "getloadavg", lambda: (0.0, 0, 0))
    assert perf.measured_peak("fp32", torch.device("cpu")).flops == 100e9 * cores
    calls = fake_rates(monkeypatch, {torch.float32: 1e9})
    cached = perf.measured_peak("fp32", torch.device("cpu"))  # quiet and cached: not measured again
    assert calls == [] and cached.flops == 100e9 * cores and cached.source.endswith("(cached)")


def test_mfu_is_the_formula_and_never_above_one():
    assert perf.mfu(tokens_per_s=1000, flops_per_token=1e6, peak_flops=4e9) == pytest.approx(0.25)
    with pytest.raises(perf.MfuAboveOne, match="MFU 2.550 > 1"):
        perf.mfu(tokens_per_s=2550, flops_per_token=1e6, peak_flops=1e9)


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert accelerator.visible_gpus() == ["2", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert accelerator.visible_gpus() == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2a,GPU-1c3d")
    with pytest.raises(UserError, match="CUDA_VISIBLE_DEVICES: GPU-8f2a,GPU-1c3d names GPUs by UUID"):
        accelerator.visible_gpus()


def test_launcher_names_the_given_gpus_and_never_num_gpus_on_cuda(tmp_path):
    def cmd(**kw):
        return command(LaunchRequest(run_dir=tmp_path, request={}, **kw), tmp_path / "r.json", tmp_path, 29500)

    on_gpus = cmd(num_ranks=2, gpus=("2", "3"))
    assert on_gpus[on_gpus.index("--include") + 1] == "localhost:2,3" and "--num_gpus" not in on_gpus
    one = cmd(num_ranks=1, gpus=("5", "7"))
    assert one[one.index("--include") + 1] == "localhost:5"
    cpu = cmd(num_ranks=2)
    assert cpu[cpu.index("--num_gpus") + 1] == "2" and "--include" not in cpu
    multi = cmd(num_ranks=2, gpus=("0",), hostfile="/etc/hosts")
    assert "--hostfile" in multi and "--include" not in multi and "--num_gpus" not in multi


def test_num_ranks_is_checked_against_the_visible_gpus(monkeypatch):
    from lmforge.components.sections.training import TrainingConfig
    from lmforge.components.training.job import num_ranks_for

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert num_ranks_for(TrainingConfig(), ["3"]) == 1          # unset: every visible GPU
    assert num_ranks_for(TrainingConfig(), []) == 2             # CPU: two processes
    assert num_ranks_for(TrainingConfig(num_ranks=3), []) == 3
    with pytest.raises(UserError) as e:
        num_ranks_for(TrainingConfig(num_ranks=2), ["3"])
    assert str(e.value).count("\n") == 0
    assert "training.num_ranks: 2 is more than the 1 visible GPU(s) (CUDA_VISIBLE_DEVICES=3)" in str(e.value)
    assert "at most 1" in str(e.value)


def test_fused_adamw_only_on_cuda_and_never_for_the_host_optimizer():
    from lmforge.components.sections.training import TrainingConfig
    from lmforge.components.training.layout import check_layout
    from lmforge.components.training.strategies import applied, deepspeed_config

    def ds(device, **par):
        c = TrainingConfig.model_validate({"model": {"preset": "tiny"}, "max_steps": 10, "warmup_steps": 2, "parallel": par})
        return deepspeed_config(c, check_layout(c, vocab_size=512, world_size=2), device=device)

    assert ds("cuda", strategy="zero2")["optimizer"]["params"]["fused"] is True
    assert "fused_adamw" in applied(ds("cuda", strategy="zero2"))
    assert "fused" not in ds("cpu", strategy="zero2")["optimizer"]["params"]
    offload = ds("cuda", strategy="zero2", offload_optimizer=True)
    assert "fused" not in offload["optimizer"]["params"] and "fused_adamw" not in applied(offload)


# --- collectives --------------------------------------------------------------------------

DEVICE = torch.device("meta")  # stands for the GPU: a tensor left on the CPU is caught


@pytest.fixture
def nccl_like(monkeypatch):
    """torch.distributed collectives replaced by ones that check what NCCL checks: the device."""
    import torch.distributed as dist

    seen: list[torch.device] = []

    def check(t):
        seen.append(t.device)
        if t.device != DEVICE:
            raise RuntimeError(f"No backend type associated with device type {t.device.type}")

    def all_reduce(t, *a, **k):
        check(t)

    def all_gather(out, t, *a, **k):
        check(t)
        for o in out:
            check(o)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    return seen


def test_collectives_put_every_tensor_on_the_engine_device(nccl_like, monkeypatch):
    comms = collectives.DeviceCollectives(DEVICE, world=2)
    monkeypatch.setattr(comms, "host", lambda t: [3.0] * t.numel())  # a meta tensor has no values to read
    cpu_loss = torch.tensor(1.5)  # built on the host, as a careless loop would
    assert comms.mean(cpu_loss) == 1.5
    rows = comms.gather_floats([1.0, 2.0, 3.0])
    assert rows == [[3.0] * 3, [3.0] * 3]
    assert nccl_like and all(d == DEVICE for d in nccl_like)


def test_the_rank_loop_calls_collectives_only_through_device_collectives():
    names = {"all_reduce", "all_gather", "all_gather_object", "broadcast", "reduce", "gather_object",
             "all_gather_into_tensor", "reduce_scatter", "barrier"}
    for module in (rank, collectives):
        tree = ast.parse(inspect.getsource(module))
        inside = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "DeviceCollectives"
                  for n in ast.walk(c)}
        stray = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr in names and isinstance(n.func.value, ast.Name) and n.func.value.id == "dist"
                 and id(n) not in inside]
        assert stray == [], f"collectives outside DeviceCollectives at {module.__name__} lines {stray}"


def test_memory_rows_round_trip():
    rows = collectives.memory_rows([[1.0, 2.0, 3.0, 6.0, 7.0, 0.0, 0.25, 9.0, 4096.0]])
    assert rows == [{"params": 1, "grads": 2, "optimizer": 3, "total": 6, "rss": 7, "device_peak": 0, "idle_fraction": 0.25,
                     "rss_peak": 9, "nvme": 4096}]


def test_rng_state_round_trips_and_reads_old_checkpoints():
    torch.manual_seed(7)
    state = rank.rng_state()
    assert set(state) == {"cpu", "cuda"}
    a = torch.rand(3)
    rank.restore_rng(state)
    assert torch.equal(torch.rand(3), a)
    rank.restore_rng(state["cpu"])  # the list-only format of earlier checkpoints
    assert torch.equal(torch.rand(3), a)


def test_peak_counts_gpus_or_machines(monkeypatch):
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert perf.devices_in_job("cuda", 4) == 4
    assert perf.devices_in_job("cpu", 2) == 1   # two CPU ranks share one machine's peak
    assert perf.devices_in_job("cpu", 4) == 2   # two machines


def test_no_cpu_only_assumptions_in_the_training_hot_path():
    src = Path(rank.__file__).read_text()
    assert 'autocast("cpu"' not in src and "set_rng_state(" in src and "cuda.set_rng_state" in src


def test_training_hardware_on_cpu(monkeypatch):
    from lmforge.components.sections.training import TrainingConfig
    from lmforge.components.training.job import training_hardware

    fake_rates(monkeypatch, {torch.bfloat16: 1e9, torch.float32: 40e9})  # no native bf16
    hw = training_hardware(TrainingConfig())
    assert (hw.device, hw.gpus, hw.precision.name, hw.compile) == ("cpu", (), "fp32", False)
    assert hw.peak.flops == 40e9 * perf.physical_cores()[0] and hw.peak.source.startswith("measured: best fp32 GEMM")
    d = hw.to_dict()
    assert d["precision_reason"] == hw.precision.reason and d["peak_flops_per_device"] == hw.peak.flops
    assert training_hardware(TrainingConfig(compile=True)).compile is True
    with pytest.raises(UserError, match="training.compile: True is not supported with pipeline stages or AutoTP"):
        training_hardware(TrainingConfig(compile=True, parallel={"strategy": "ddp", "pipeline": {"stages": 2}}))


def test_rank_threads_follow_the_cpus_this_process_may_use(monkeypatch):
    """Pinned to 4 of a host's 64 CPUs (taskset, a container's cpuset), 2 ranks get 2 threads each, not 32."""
    import os

    from lmforge.components.runtime import cpus
    from lmforge.components.training import launcher

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    assert cpus.usable_cpus() == 4
    assert cpus.cpu_share(2) == 2
    assert launcher.rank_env(2)["OMP_NUM_THREADS"] == "2"
    assert launcher.rank_env(8)["OMP_NUM_THREADS"] == "1"
