"""DeepSpeed's async_io op (NVMe offload) is probed only for a job that swaps to NVMe, and no op probe prints: the
probe is a compile and link test, and without libaio its linker said `/usr/bin/ld: cannot find -laio` on GPU runs that
asked for no NVMe (components/training/ops.py)."""

from __future__ import annotations

import os

import pytest

from lmforge.components.training import ops


class Fake:
    """An op builder that records its probes and loads, and prints what a failed link prints, on file descriptor 2."""

    def __init__(self, class_name: str, log: list[str]) -> None:
        self.class_name, self.log = class_name, log
        self.NAME = {"AsyncIOBuilder": "async_io"}.get(class_name, class_name.lower())

    def is_compatible(self, verbose=False):
        self.log.append(f"probe {self.class_name}")
        os.write(2, b"/usr/bin/ld: cannot find -laio: No such file or directory\n")
        return True

    def absolute_name(self):
        return self.NAME

    def load(self, verbose=False):
        self.log.append(f"load {self.class_name}")


@pytest.fixture
def builders(monkeypatch, tmp_path) -> list[str]:
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    log: list[str] = []
    monkeypatch.setattr(get_accelerator(), "create_op_builder", lambda name: Fake(name, log))
    monkeypatch.setattr(ops, "build_dir", lambda name: tmp_path / name)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # _load exports it for the ranks

    def every_op():
        log.append("probe every op")  # deepspeed.ops.__compatible_ops__: async_io's and gds's link tests among them
        return {}

    monkeypatch.delattr(deepspeed.ops, "__compatible_ops__", raising=False)  # computed on first access, then cached
    monkeypatch.setattr(deepspeed.ops, "_probe_compatible_ops", every_op)
    return log


@pytest.mark.parametrize("ds, device, names", [
    ({"zero_optimization": {"stage": 2}, "optimizer": {"params": {"torch_adam": True}}}, "cuda", []),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
      "optimizer": {"params": {}}}, "cpu", ["ShareMemCommBuilder", "CPUAdamBuilder"]),
])
def test_a_job_without_nvme_never_probes_async_io_and_prints_nothing(builders, capfd, ds, device, names):
    ops.load_ops(ds, device=device)
    assert builders == [f"{what} {n}" for n in names for what in ("probe", "load")]
    out = capfd.readouterr()
    assert "laio" not in out.out + out.err


def test_a_job_with_nvme_probes_and_loads_async_io_quietly(builders, capfd):
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}},
          "optimizer": {"params": {"torch_adam": True}}}
    ops.load_ops(ds, device="cuda")
    assert builders == ["probe AsyncIOBuilder", "load AsyncIOBuilder"]  # once: checked before anything builds
    assert "laio" not in capfd.readouterr().err


def test_a_probe_that_raises_means_cannot_build_and_the_descriptors_come_back(capfd):
    class Broken:
        def is_compatible(self, verbose=False):
            os.write(1, b"noise\n")
            raise RuntimeError("no CUDA toolkit")

    assert ops.probe(Broken()) is False
    os.write(2, b"after\n")
    out = capfd.readouterr()
    assert "noise" not in out.out and out.err == "after\n"
