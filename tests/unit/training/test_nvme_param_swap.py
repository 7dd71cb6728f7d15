"""offload_param = "nvme": what place_swap sets so that DeepSpeed keeps the parameters in their swap files between uses
(components/training/nvme.py swap_params), and --resume refused for such a run."""

from __future__ import annotations

import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.training import Offload, TrainingConfig
from lmforge.components.training.layout import check_layout
from lmforge.components.training.strategies import deepspeed_config, for_deepspeed


def placed(tmp_path, world_size: int = 2, **parallel) -> dict:
    from lmforge.components.training.nvme import place_swap

    c = TrainingConfig.model_validate({"model": {"preset": "tiny"}, "micro_batch_size": 4, "max_steps": 10,
                                       "warmup_steps": 2, "parallel": {"strategy": "zero3", **parallel,
                                                                       "nvme_path": str(tmp_path / "nvme")}})
    ds = deepspeed_config(c, check_layout(c, vocab_size=512, world_size=world_size))
    return place_swap(ds, run_dir=tmp_path / "runs" / "r1", largest_param=512 * 64)


@pytest.mark.parametrize("optimizer", ["nvme", "cpu"])
def test_parameters_on_nvme_stay_in_their_swap_files(tmp_path, optimizer):
    z = placed(tmp_path, offload_optimizer=optimizer, offload_param="nvme")["zero_optimization"]
    assert z["offload_param"]["max_in_cpu"] == 0  # DeepSpeed's 1e9 would copy a small model back into host memory
    assert z["stage3_max_reuse_distance"] == 0    # else every swapped parameter holds a swap buffer fwd -> bwd
    assert z["offload_param"]["buffer_size"] == 512 * 64 and z["offload_param"]["buffer_count"] == 5
    assert z["sub_group_size"] == int(1e8)        # bounds the pinned write-back buffer of one sub-group's parameters


def test_deepspeed_reads_the_parameter_swap_settings_as_written(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    one = placed(tmp_path, world_size=1, offload_optimizer="cpu", offload_param="nvme")  # no process group here
    parsed = DeepSpeedConfig(for_deepspeed(one)).zero_config
    assert parsed.offload_param.max_in_cpu == 0 and parsed.max_reuse_distance == 0
    assert parsed.offload_param.buffer_size == 512 * 64 and parsed.sub_group_size == int(1e8)


def test_only_the_optimizer_on_nvme_leaves_the_parameter_settings_alone(tmp_path):
    z = placed(tmp_path, offload_optimizer="nvme", offload_param="cpu")["zero_optimization"]
    assert z["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert "stage3_max_reuse_distance" not in z and z["sub_group_size"] == int(1e8)  # the optimizer swapper's


def test_resume_with_the_parameters_on_nvme_is_refused_as_not_yet(tmp_path):
    from lmforge.components.training.nvme import check_resume

    check_resume(Offload.CPU, tmp_path, offload_param=Offload.CPU)
    with pytest.raises(UserError) as e:
        check_resume(Offload.CPU, tmp_path, offload_param=Offload.NVME)
    text = str(e.value)
    assert "not yet" in text and 'offload_param = "nvme"' in text and "offload_optimizer = \"nvme\"" not in text
    assert "checkpoint load" in text and "without --resume" in text
    with pytest.raises(UserError) as both:
        check_resume(Offload.NVME, tmp_path, offload_param=Offload.NVME)
    assert 'offload_optimizer = "nvme" and offload_param = "nvme"' in str(both.value)
