"""Elastic resume's checks, its config gate, its RNG and data arithmetic, and the conversion's atomicity
(components/training/universal.py), without launching ranks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.training import TrainingConfig
from lmforge.components.training import checkpoint as ckpt
from lmforge.components.training.batches import TokenWindows
from lmforge.components.training.layout import check_layout
from lmforge.components.training.strategies import applied, apply_universal_load, deepspeed_config
from lmforge.components.training.universal import check_elastic, convert, load_tag, reseed, universal_dir


def cfg(**kw) -> TrainingConfig:
    base = {"model": {"preset": "tiny"}, "micro_batch_size": 2, "max_steps": 10, "warmup_steps": 2,
            "parallel": {"strategy": "zero2"}}
    base.update(kw)
    return TrainingConfig.model_validate(base)


def marker(world: int, **training) -> dict:
    """A COMPLETE.json as rank 0 writes it for a run of `training` on `world` ranks."""
    layout = check_layout(cfg(**training), vocab_size=512, world_size=world)
    return {"step": 4, "world_size": world, "files": {}, "layout": layout.to_dict()}


FOLDER = Path("/runs/r/checkpoints/step-0000004")


def test_the_same_global_batch_on_another_world_passes():
    new = cfg(grad_accum_steps=2)
    check_elastic(marker(2), new, check_layout(new, vocab_size=512, world_size=1), FOLDER)  # 2 x 1 x 2 = 2 x 2 x 1


def test_another_global_batch_is_refused_with_the_arithmetic_and_the_accumulation_that_keeps_it():
    new = cfg()
    with pytest.raises(UserError) as e:
        check_elastic(marker(2), new, check_layout(new, vocab_size=512, world_size=1), FOLDER)
    msg = str(e.value)
    assert "micro x accum x dp = 2 x 1 x 1 = 2, but step-0000004 was trained at 2 x 1 x 2 = 4" in msg
    assert "Set training.grad_accum_steps=2 (then 2 x 2 x 1 = 4)" in msg


def test_a_global_batch_no_accumulation_reaches_names_the_product_to_hit():
    new = cfg(micro_batch_size=3)
    with pytest.raises(UserError, match=r"micro_batch_size and grad_accum_steps with micro x accum x 1 = 4"):
        check_elastic(marker(2), new, check_layout(new, vocab_size=512, world_size=1), FOLDER)


@pytest.mark.parametrize("saved, new, world, problem", [
    ({"parallel": {"strategy": "zero1", "pipeline": {"stages": 2}}}, {"parallel": {"strategy": "zero1"}}, 1,
     "the saved layout has pipeline stages or AutoTP"),
    ({"parallel": {"strategy": "zero1"}}, {"parallel": {"strategy": "zero1", "tensor": {"autotp_size": 2}}}, 4,
     "this job's layout has pipeline stages or AutoTP"),
    ({"parallel": {"strategy": "ddp"}}, {"parallel": {"strategy": "ddp"}, "grad_accum_steps": 2}, 1,
     "ddp (stage 0) saves none"),
    ({"parallel": {"strategy": "zero3"}}, {"parallel": {"strategy": "zero2"}, "grad_accum_steps": 2}, 1,
     "the checkpoint was saved under zero3"),
    ({}, {"lora_r": 4, "grad_accum_steps": 2}, 1, "not yet: a LoRA checkpoint holds the adapters only"),
    ({}, {"parallel": {"strategy": "zero2", "offload_optimizer": True}, "grad_accum_steps": 2}, 1,
     "not yet: a universal load into offloaded states"),
])
def test_what_a_universal_resume_cannot_continue_is_refused_before_conversion(saved, new, world, problem):
    lora_r = new.pop("lora_r", 0)
    new_cfg = cfg(**new)
    if lora_r:  # set after validation: a LoRA config wants a base folder (init), which check_elastic never reads
        new_cfg = new_cfg.model_copy(update={"lora": new_cfg.lora.model_copy(update={"r": lora_r})})
    with pytest.raises(UserError) as e:
        check_elastic(marker(2, **saved), new_cfg, check_layout(new_cfg, vocab_size=512, world_size=world), FOLDER)
    assert problem in str(e.value) and "cannot resume step-0000004 (saved on 2 ranks)" in str(e.value)


def test_a_marker_without_its_layout_is_refused():
    m = {**marker(2), "layout": None}
    m.pop("layout")
    new = cfg(grad_accum_steps=2)
    with pytest.raises(UserError, match="records no layout"):
        check_elastic(m, new, check_layout(new, vocab_size=512, world_size=1), FOLDER)


def test_the_universal_gate_comes_last_and_only_on_an_elastic_resume():
    c = cfg()
    ds = deepspeed_config(c, check_layout(c, vocab_size=512, world_size=2))
    assert apply_universal_load(ds, False) is ds and "checkpoint" not in ds
    out = apply_universal_load(ds, True)
    assert out["checkpoint"] == {"load_universal": True} and applied(out)[-1] == "universal_load"
    assert load_tag(FOLDER, out) == "step-0000004_universal" and load_tag(FOLDER, ds) == "step-0000004"


def test_reseeding_is_deterministic_and_distinct_per_rank():
    import torch

    draws = {}
    for rank in (0, 1):
        reseed(seed=0, step=4, rank=rank)
        draws[rank] = torch.rand(4)
    reseed(seed=0, step=4, rank=1)
    assert torch.equal(torch.rand(4), draws[1]) and not torch.equal(draws[0], draws[1])


def test_at_the_same_global_batch_any_split_of_ranks_continues_the_data_without_repeats_or_skips():
    """Steps 0-3 on 2 ranks (micro 2, accum 1) then 4-7 on 1 rank (micro 2, accum 2) train on windows
    [0, 32) of the seeded order exactly once each, step by step the same windows as 2 ranks throughout."""
    w = TokenWindows(np.arange(40 * 8 + 1, dtype=np.int64), seq_len=8, seed=3)

    def step_windows(step: int, dp: int, accum: int) -> list[int]:
        rows = [x[:, 0] // 8 for r in range(dp) for x, _ in w.micro_batches(step, dp_rank=r, dp_size=dp, micro=2, accum=accum)]
        return sorted(int(i) for t in rows for i in t)

    seen = [step_windows(s, 2, 1) for s in range(4)] + [step_windows(s, 1, 2) for s in range(4, 8)]
    assert seen[4:] == [step_windows(s, 2, 1) for s in range(4, 8)]
    flat = [i for s in seen for i in s]
    assert sorted(flat) == sorted(w.window_ids(0, 32).tolist()) and len(set(flat)) == 32


def test_a_failed_conversion_leaves_nothing_behind(tmp_path):
    """A checkpoint DeepSpeed cannot convert (no optimizer shards) is a UserError, with no <tag>_universal,
    no temporary folder and no latest_universal pointer left for a later resume to trust."""
    folder = tmp_path / "checkpoints" / "step-0000004"
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    ckpt.mark_complete(folder.parent, folder.name, step=4, world_size=2)
    with pytest.raises(UserError, match="(?s)could not be converted to a universal checkpoint .*num_ranks=2"):
        convert(folder, step=4, world_size=2)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["step-0000004"]
    assert not universal_dir(folder).exists()


def test_prune_takes_a_tags_universal_form_with_it(tmp_path):
    for step in (2, 4, 6):
        d = tmp_path / ckpt.tag_for(step)
        d.mkdir()
        (d / "x").write_text("x")
        ckpt.mark_complete(tmp_path, d.name, step=step, world_size=1)
        universal_dir(d).mkdir()
        (universal_dir(d) / ckpt.MARKER).write_text(json.dumps({"step": step}))
    ckpt.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000004", "step-0000004_universal",
                                                          "step-0000006", "step-0000006_universal"]
