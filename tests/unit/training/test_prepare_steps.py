"""prepare_job is PREPARE's steps in order; `auto` precision is resolved after the layout's fp32-only rule is known.

The host is made bf16-capable by faking the measured matmul rates (as test_hardware.py does), so `auto` would pick
bf16 but for the layout.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lmforge.components.errors import UserError
from lmforge.components.runtime import accelerator
from lmforge.components.sections.training import TrainingConfig
from lmforge.components.serving.task import DEMO
from lmforge.components.training import job as jobs
from lmforge.components.training import perf
from lmforge.components.training.job import PREPARE, Draft, check_the_layout, choose_hardware, count_ranks

SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev")


class Tok:
    def __len__(self) -> int:
        return 512


@pytest.fixture
def bf16_host(tmp_path, monkeypatch):
    """A CPU whose bf16 matmul is far faster than fp32 (AVX512-BF16 or AMX): `auto` alone would pick bf16."""
    monkeypatch.setenv(accelerator.CACHE_ENV, str(tmp_path / "cache"))
    rates = {torch.bfloat16: 650e9, torch.float32: 175e9}

    def matmul_flops(dtype, *, n, device="cpu", seconds=0.1, max_reps=50):
        return rates[dtype], 2 * n ** 3 / rates[dtype]

    monkeypatch.setattr(accelerator, "matmul_flops", matmul_flops)
    monkeypatch.setattr(perf, "matmul_flops", matmul_flops)
    assert accelerator.choose_precision("auto", "cpu").name == "bf16"


def training(schedule: str, precision: str = "auto") -> TrainingConfig:
    return TrainingConfig.model_validate({
        "model": {"preset": "tiny"}, "micro_batch_size": 4, "max_steps": 10, "warmup_steps": 2, "num_ranks": 2,
        "precision": precision,
        "parallel": {"strategy": "ddp", "pipeline": {"stages": 2, "micro_batches": 4, "schedule": schedule,
                                                     "virtual_stages": 1 if schedule == "1f1b" else 2}}})


def hardware_and_layout(cfg: TrainingConfig, tmp_path: Path) -> Draft:
    d = Draft(cfg=cfg, shards=tmp_path, tokenizer=tmp_path, run_dir=tmp_path, resume=False, records=tmp_path,
              task=DEMO, meta={}, tok=Tok())
    for step in (count_ranks, choose_hardware, check_the_layout):
        d = step(d)
    return d


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_auto_on_a_bf16_host_trains_every_schedule_in_fp32_where_its_rule_says_so(bf16_host, tmp_path, schedule):
    d = hardware_and_layout(training(schedule), tmp_path)
    assert d.hardware is not None and d.layout is not None
    if schedule == "1f1b":   # DeepSpeed's engine trains in bf16: auto keeps the device's choice
        assert d.hardware.precision.name == "bf16" and d.layout.bf16
        return
    assert d.hardware.precision.name == "fp32" and not d.layout.bf16
    line = f"hardware: {d.hardware.summary()}"   # what the train flow prints (components/training/run.py job_lines)
    assert f"fp32 (auto, and the {schedule} schedule trains in fp32" in line
    assert d.hardware.to_dict()["precision_reason"] == d.hardware.precision.reason


def test_an_explicit_bf16_on_a_torch_schedule_is_still_refused_with_the_fix(bf16_host, tmp_path):
    with pytest.raises(UserError) as e:
        hardware_and_layout(training("interleaved-1f1b", precision="bf16"), tmp_path)
    message = str(e.value)
    assert "training.precision: bf16 breaks the layout rule: not yet: the interleaved-1f1b schedule trains in fp32" \
        in message and 'Set training.precision = "fp32"' in message


def test_auto_resolves_to_fp32_for_the_parameter_server_family(bf16_host, tmp_path):
    cfg = TrainingConfig.model_validate({"model": {"preset": "tiny"}, "num_ranks": 2, "parallel": {"strategy": "ps-sync"}})
    hw = jobs.training_hardware(cfg)
    assert hw.precision.name == "fp32" and "parameter-server family (ps-sync) trains in fp32" in hw.precision.reason


def test_prepare_runs_its_steps_in_order_and_each_skips_what_the_config_does_not_ask(tmp_path, monkeypatch):
    """The hardware (its precision) is chosen before the layout's rules are checked; the gated steps return the
    draft unchanged when their setting is off."""
    names = [step.__name__ for step in PREPARE]
    assert names.index("count_ranks") < names.index("choose_hardware") < names.index("check_the_layout")
    assert names.index("check_the_layout") < names.index("check_resume") < names.index("build_deepspeed")
    assert names.index("build_deepspeed") < names.index("place_nvme")
    d = Draft(cfg=training("1f1b", precision="fp32"), shards=tmp_path, tokenizer=tmp_path, run_dir=tmp_path,
              resume=False, records=tmp_path, task=DEMO, meta={"run_name": "r"}, tok=Tok())
    for gated in (jobs.check_parameter_server, jobs.check_resume, jobs.prepare_sft, jobs.choose_lora, jobs.place_nvme):
        assert gated(d) is d


def test_the_base_step_puts_its_lineage_in_the_meta(tmp_path, monkeypatch):
    """The export records the base it started from without the flow patching the job (no with_meta)."""
    class Base:
        path = tmp_path

        def lineage(self):
            return {"path": str(tmp_path), "sha256": "abc"}

    cfg = training("1f1b")
    monkeypatch.setattr(jobs, "check_base_dataset", lambda c, tok, base: (c, Base()))
    d = Draft(cfg=cfg, shards=tmp_path, tokenizer=tmp_path, run_dir=tmp_path, resume=False, records=tmp_path, task=DEMO,
              meta={"run_name": "r"})
    assert jobs.check_the_base(d).meta == {"run_name": "r", "base": {"path": str(tmp_path), "sha256": "abc"}}
    monkeypatch.setattr(jobs, "check_base_dataset", lambda c, tok, base: (c, None))
    assert jobs.check_the_base(replace(d)) == d
    assert not hasattr(jobs.Job, "with_meta")


def test_run_meta_holds_what_the_flow_used_to_add(tmp_path):
    meta = jobs.run_meta(training("1f1b"), {"run_name": "r", "dataset_version": "v1"})
    assert {"config_hash", "strategy", "seq_len", "objective", "git_commit", "run_name", "dataset_version"} <= set(meta)
    assert meta["strategy"] == "ddp" and meta["dataset_version"] == "v1"
