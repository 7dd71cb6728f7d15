"""ZeRO-Infinity's NVMe tier: the offload keys ("none" | "cpu" | "nvme", true = "cpu"), their refusals, the DeepSpeed
sections they make, the checks before launch (O_DIRECT, libaio) and the planner's NVMe rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.training import Offload, ParallelConfig, TrainingConfig
from lmforge.components.training.layout import check_layout
from lmforge.components.training.strategies import applied, deepspeed_config, for_deepspeed


def training(**parallel) -> TrainingConfig:
    return TrainingConfig.model_validate({"model": {"preset": "tiny"}, "micro_batch_size": 4, "max_steps": 10,
                                          "warmup_steps": 2, "parallel": parallel})


@pytest.mark.parametrize("given, meant", [(True, "cpu"), (False, "none"), ("cpu", "cpu"), ("none", "none")])
def test_the_old_booleans_still_mean_cpu_and_none(given, meant):
    par = ParallelConfig(strategy="zero3", offload_optimizer=given, offload_param=given)
    assert par.offload_optimizer == meant and par.offload_param == meant
    assert bool(par.offload_param) is (meant != "none")  # `if par.offload_param:` reads as before
    assert json.loads(par.model_dump_json())["offload_param"] == meant
    assert ParallelConfig.model_validate_json(par.model_dump_json()) == par  # the request crosses into the ranks as JSON


def test_nvme_takes_a_path_and_zero3():
    par = ParallelConfig(strategy="zero3", offload_optimizer="nvme", offload_param="nvme", nvme_path="/mnt/nvme")
    assert par.offload_optimizer is Offload.NVME and str(par.offload_param) == "nvme"


@pytest.mark.parametrize("parallel, message", [
    ({"strategy": "zero2", "offload_optimizer": "nvme", "nvme_path": "/x"}, 'offload_optimizer = "nvme" needs zero3, not zero2'),
    ({"strategy": "zero1", "offload_optimizer": "nvme", "nvme_path": "/x"}, "offload_optimizer needs zero2 or zero3"),
    ({"strategy": "zero2", "offload_param": "nvme", "nvme_path": "/x"}, "offload_param needs zero3"),
    ({"strategy": "zero3", "offload_param": "nvme"}, 'offload_param = "nvme" needs nvme_path'),
    ({"strategy": "zero3", "offload_optimizer": "cpu", "nvme_path": "/x"}, "neither offload_optimizer nor offload_param"),
    ({"strategy": "zero3", "offload_param": "disk"}, "'none', 'cpu' or 'nvme'"),
])
def test_refusals_name_the_key_and_the_fix(parallel, message):
    from lmforge.components.config import validate_config

    with pytest.raises(UserError) as e:
        validate_config({"training": {"parallel": parallel}})
    assert message in str(e.value)


def test_apply_offload_writes_the_nvme_sections_and_an_aio_section():
    c = training(strategy="zero3", offload_optimizer="nvme", offload_param="nvme", nvme_path="/mnt/nvme")
    ds = deepspeed_config(c, check_layout(c, vocab_size=512, world_size=2))
    z = ds["zero_optimization"]
    assert applied(ds) == ["base", "zero3", "offload_nvme"]
    assert z["offload_optimizer"]["device"] == "nvme" and z["offload_optimizer"]["nvme_path"] == "/mnt/nvme"
    assert z["offload_param"] == {"device": "nvme", "pin_memory": False, "nvme_path": "/mnt/nvme", "buffer_count": 5}
    assert ds["aio"]["intra_op_parallelism"] == 1 and not ds["aio"]["use_gds"] and z["sub_group_size"] == int(1e8)
    assert "torch_adam" not in ds["optimizer"]["params"]  # the host optimizer, DeepSpeedCPUAdam, steps the swapped states
    mixed = training(strategy="zero3", offload_optimizer=True, offload_param="nvme", nvme_path="/mnt/nvme")
    mds = deepspeed_config(mixed, check_layout(mixed, vocab_size=512, world_size=2))
    assert mds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    cpu = training(strategy="zero3", offload_optimizer=True, offload_param=True)
    cds = deepspeed_config(cpu, check_layout(cpu, vocab_size=512, world_size=2))
    assert "aio" not in cds and applied(cds) == ["base", "zero3", "offload"]

    from deepspeed.runtime.config import DeepSpeedConfig

    one = deepspeed_config(c, check_layout(c, vocab_size=512, world_size=1))  # no process group here: world size 1
    parsed = DeepSpeedConfig(for_deepspeed(one))  # DeepSpeed's own reading: devices, path and aio as written
    assert parsed.zero_config.offload_param.device == "nvme" and str(parsed.zero_config.offload_param.nvme_path) == "/mnt/nvme"
    assert parsed.aio_config["queue_depth"] == 8


def test_place_swap_gives_the_run_its_own_folder_and_buffers_sized_to_the_model(tmp_path):
    from lmforge.components.training.nvme import place_swap, swap_bytes, swap_root

    c = training(strategy="zero3", offload_optimizer="nvme", offload_param="nvme", nvme_path=str(tmp_path / "nvme"))
    ds = deepspeed_config(c, check_layout(c, vocab_size=512, world_size=2))
    placed = place_swap(ds, run_dir=tmp_path / "runs" / "r1", largest_param=512 * 64)
    root = tmp_path.resolve() / "nvme" / "lmforge-r1"
    assert swap_root(placed) == root and placed["zero_optimization"]["offload_optimizer"]["nvme_path"] == str(root)
    assert placed["zero_optimization"]["offload_param"]["buffer_size"] == 512 * 64
    assert ds["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path / "nvme")  # the input is left alone
    (root / "zero_stage_3" / "fp32params" / "rank1").mkdir(parents=True)
    (root / "zero_stage_3" / "fp32params" / "rank1" / "0_param.tensor.swp").write_bytes(b"x" * 4096)
    (root / "zero_stage_3" / "optimizer" / "rank1").mkdir(parents=True)
    (root / "zero_stage_3" / "optimizer" / "rank1" / "3.tensor.swp").write_bytes(b"x" * 8192)
    assert swap_bytes(root, rank=1) == 4096 + 8192 and swap_bytes(root, rank=0) == 0 and swap_bytes(None, rank=0) == 0


def test_a_folder_without_o_direct_is_refused_naming_its_file_system(tmp_path):
    from lmforge.components.training.nvme import check_direct_io, fs_type

    check_direct_io(tmp_path / "ok")  # this machine's temporary folder: ext4 or the like, O_DIRECT works
    assert list((tmp_path / "ok").iterdir()) == []  # the probe is gone
    shm = Path("/dev/shm")
    if fs_type(shm) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here to be refused")
    folder = shm / f"lmforge-unit-{tmp_path.name}"
    try:
        with pytest.raises(UserError) as e:
            check_direct_io(folder)
    finally:
        folder.rmdir()
    text = str(e.value)
    assert "training.parallel.nvme_path" in text and "tmpfs" in text and "O_DIRECT" in text and "ext4" in text


def test_nvme_needs_the_async_io_op_and_without_libaio_the_job_is_refused_naming_the_package(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    from lmforge.components.training.ops import load_ops, needed_ops

    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}},
          "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert needed_ops(ds, device="cpu") == ["ShareMemCommBuilder", "AsyncIOBuilder"]

    class NoLibaio:
        NAME = "async_io"

        def is_compatible(self, verbose=False):
            return False

        def load(self):
            raise AssertionError("must not build")

    accel = get_accelerator()
    real = accel.create_op_builder
    monkeypatch.setattr(accel, "create_op_builder", lambda name: NoLibaio() if name == "AsyncIOBuilder" else real(name))
    with pytest.raises(UserError) as e:
        load_ops(ds, device="cuda")
    assert "libaio-dev" in str(e.value) and "libaio-devel" in str(e.value) and "apt-get install -y libaio-dev" in str(e.value)


def test_planner_nvme_row_moves_the_optimizer_and_the_parameters_to_swap_files():
    from lmforge.components.training.planner import PlanInput, make_plan

    rows = {r.strategy: r for r in make_plan(PlanInput(params=7e9, devices=8, memory_gb=80)).rows}
    cpu, nvme = rows["zero3+offload_optimizer+offload_param"], rows["zero3+nvme_optimizer+nvme_param"]
    assert nvme.params_gb == 0 and nvme.optimizer_gb == 0 and nvme.grads_gb == pytest.approx(cpu.grads_gb)
    assert nvme.nvme_gb == pytest.approx(12 * 7 / 8 + 2 * 7 / 8)  # Adam's fp32 states and the bf16 parameters (max_in_cpu 0)
    # host: 5 parameter buffers (the 32000 x 4096 embedding, capped at DeepSpeed's default buffer of 1e8 elements) and
    # 4 fp32 optimizer buffers of a 1e8-element sub-group
    assert nvme.host_gb == pytest.approx((5 * 1e8 * 2 + 4 * 1e8 * 4) / 1e9)
    assert nvme.host_gb < cpu.host_gb / 2 and cpu.nvme_gb == 0
    big = {r.strategy: r for r in make_plan(PlanInput(params=70e9, devices=8, memory_gb=80, hidden_size=8192,
                                                      num_layers=80, num_heads=64)).rows}["zero3+nvme_optimizer+nvme_param"]
    assert big.nvme_gb == pytest.approx(12 * 70 / 8 + 2 * 70 / 8)


def test_plan_command_shows_the_nvme_column():
    import typer
    from typer.testing import CliRunner

    from lmforge.cli.commands.plan import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    out = CliRunner().invoke(app, ["plan", "--model", "tiny", "--devices", "2", "--memory-gb", "1", "--vocab", "512",
                                   "--precision", "fp32", "--json"])
    assert out.exit_code == 0, out.output
    row = {r["strategy"]: r for r in json.loads(out.output)["rows"]}["zero3+nvme_optimizer+nvme_param"]
    params = json.loads(out.output)["params_per_device"]
    assert row["nvme_gb"] == pytest.approx(16 * params / 2 / 1e9)  # Adam's fp32 states and the fp32 weights, halved


def test_resume_with_the_optimizer_on_nvme_is_refused_as_not_yet(tmp_path):
    from lmforge.components.training.nvme import check_resume

    check_resume(Offload.CPU, tmp_path)      # cpu offload resumes as before
    check_resume(Offload.NONE, tmp_path)
    with pytest.raises(UserError) as e:
        check_resume(Offload.NVME, tmp_path)
    assert "not yet" in str(e.value) and str(tmp_path) in str(e.value) and "without --resume" in str(e.value)


@pytest.mark.parametrize("libaio", [True, False])
def test_prebuild_builds_what_a_cpu_job_may_load_and_async_io_only_where_libaio_is(monkeypatch, libaio):
    from deepspeed.accelerator import get_accelerator

    from lmforge.components.training import ops

    class Aio:
        NAME = "async_io"

        def is_compatible(self, verbose=False):
            return libaio

    accel = get_accelerator()
    real = accel.create_op_builder
    monkeypatch.setattr(accel, "create_op_builder", lambda name: Aio() if name == "AsyncIOBuilder" else real(name))
    asked: list[str] = []
    monkeypatch.setattr(ops, "_load", lambda names: asked.extend(names) or names)  # the build itself: every training test
    ops.prebuild()
    shm = ["ShareMemCommBuilder"] if accel.device_name() == "cpu" else []   # CPU ranks' allreduce only
    assert asked == [*shm, "CPUAdamBuilder", *(["AsyncIOBuilder"] if libaio else [])]
