"""Resume on another number of ranks through DeepSpeed's universal checkpoint (components/training/universal.py).

Per ZeRO stage (2 and 3), three real launches share every assertion: `full` trains 8 steps on 2 ranks
(the uninterrupted reference, checkpoints at 3, 6 and 8); `down` resumes full's step 3 on 1 rank
(to step 8, saving at 6); `up` resumes down's step 6 (saved by 1 rank) on 2 ranks up to step 8. Every
leg has the same max_steps: the LR schedule's length is the config's, not the checkpoint's. The global batch is
4 throughout (micro 2 x accum 1 x dp 2, then 2 x 2 x 1), so the resumed steps train on the same
windows as the reference and their losses must match it.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from lmforge.components.training import checkpoint as ckpt
from lmforge.components.workspace import Workspace
from tests.integration.train_support import tiny_training

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

BASE = {"precision": "fp32", "max_steps": 8, "save_every": 3, "keep_checkpoints": 3, "warmup_steps": 2,
        "micro_batch_size": 2}
# Measured on 2 CPU ranks (fp32), zero2 and zero3: the resumed steps' losses differ from the uninterrupted
# run's by at most 2.4e-7 (the same windows, summed in another order over ranks and micro-batches; the 1 -> 2
# leg is exact); 1e-4 leaves room for that order and nothing else: a shifted batch or a wrong LR schedule
# moved a loss by 2e-2 here (a leg whose max_steps differed from the reference's).
LOSS_TOL = 1e-4


@dataclasses.dataclass
class Leg:
    events: list[dict]
    lines: list[str]
    notes: tuple[str, ...]
    run_dir: Path


def _run(ws: Workspace, name: str, cfg, *, resume: bool = False) -> Leg:
    from lmforge.components.training.job import prepare_job
    from lmforge.components.training.launcher import launch

    run_dir = ws.run_dir(name)
    job = prepare_job(cfg, shards=ws.training_shards("testdata0001"), tokenizer=ws.dataset_dir("testdata0001") / "tokenizer",
                      run_dir=run_dir, resume=resume, meta={"run_name": name, "dataset_version": "testdata0001"},
                      timeout_s=300)
    lines: list[str] = []
    result = launch(job.launch, on_line=lambda rank, line: lines.append(line))
    return Leg(result.events, lines, job.notes, run_dir)


def _seed_from(src: Path, dst: Path, step: int) -> None:
    """A run folder holding only `src`'s checkpoint at `step`, to resume from."""
    tag = ckpt.tag_for(step)
    shutil.copytree(src / "checkpoints" / tag, dst / "checkpoints" / tag)


@pytest.fixture(scope="module", params=["zero2", "zero3"])
def legs(request, ws):
    strategy = request.param
    par = {"parallel": {"strategy": strategy}}
    full = _run(ws, f"{strategy}-full", tiny_training(**BASE, **par, num_ranks=2))
    _seed_from(full.run_dir, ws.run_dir(f"{strategy}-down"), 3)
    down = _run(ws, f"{strategy}-down", tiny_training(**BASE, **par, num_ranks=1, grad_accum_steps=2), resume=True)
    _seed_from(down.run_dir, ws.run_dir(f"{strategy}-up"), 6)
    up = _run(ws, f"{strategy}-up", tiny_training(**BASE, **par, num_ranks=2), resume=True)
    return strategy, full, down, up


def test_the_loss_curve_continues_on_another_world_size(legs):
    strategy, full, down, up = legs
    reference = {e["step"]: e["loss"] for e in full.events}
    assert sorted(reference) == list(range(1, 9))
    for leg, steps in ((down, [4, 5, 6, 7, 8]), (up, [7, 8])):
        assert [e["step"] for e in leg.events] == steps
        diffs = [abs(e["loss"] - reference[e["step"]]) for e in leg.events]
        assert max(diffs) < LOSS_TOL, (strategy, diffs)
    # and the continued run still learns: not a curve that merely starts at the right place
    assert up.events[-1]["loss"] < full.events[0]["loss"] - 0.2


def test_it_says_it_resumed_at_the_saved_step_on_the_new_world(legs):
    _, _, down, up = legs
    assert down.notes[0].startswith("resumed step 3 from 2 ranks on 1 (universal checkpoint, converted step-0000003_universal")
    assert up.notes[0].startswith("resumed step 6 from 1 ranks on 2 (universal checkpoint, converted step-0000006_universal")
    assert any("resumed step 3 from 2 ranks on 1 (universal checkpoint step-0000003_universal)" in x for x in down.lines)
    assert any("resumed step 6 from 1 ranks on 2" in x for x in up.lines)


def test_the_conversion_is_cached_and_a_second_resume_reuses_it(legs, ws):
    from lmforge.components.training.layout import check_layout
    from lmforge.components.training.universal import prepare_elastic

    strategy, _, down, _ = legs
    folder = down.run_dir / "checkpoints" / "step-0000003"
    out = folder.with_name("step-0000003_universal")
    marker = ckpt.verify(out)
    assert marker["converted_from"] == "step-0000003" and marker["world_size"] == 2
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    cfg = tiny_training(**BASE, parallel={"strategy": strategy}, num_ranks=1, grad_accum_steps=2)
    layout = check_layout(cfg, vocab_size=512, world_size=1)
    note = prepare_elastic(folder, ckpt.verify(folder), cfg, layout)
    assert "reused step-0000003_universal" in note
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before
    assert not list(folder.parent.glob(".step-*")) and not (folder.parent / "latest_universal").exists()


def _consolidated(tag_dir: Path, key: str) -> dict[str, torch.Tensor]:
    """The saved ZeRO checkpoint's fp32 weights (key "fp32") or one Adam moment, whole per parameter, by
    DeepSpeed's zero_to_fp32: for a moment, each rank's flat fp32 partition is swapped for the same-shaped
    flat partition of that moment before zero_to_fp32 stitches the partitions together."""
    import tempfile

    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        FP32_FLAT_GROUPS,
        OPTIMIZER_STATE_DICT,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if key == "fp32":
        return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / tag_dir.name
        shutil.copytree(tag_dir, copy)
        for f in copy.glob("*_optim_states.pt"):
            sd = torch.load(f, map_location="cpu", weights_only=False)
            osd = sd[OPTIMIZER_STATE_DICT]
            if SINGLE_PARTITION_OF_FP32_GROUPS in osd:  # ZeRO-1/2
                states = osd[BASE_OPTIMIZER_STATE]["state"]
                osd[SINGLE_PARTITION_OF_FP32_GROUPS] = [states[i][key] for i in range(len(osd[SINGLE_PARTITION_OF_FP32_GROUPS]))]
            else:  # ZeRO-3
                states = osd[OPTIMIZER_STATE_DICT]["state"]
                osd[FP32_FLAT_GROUPS] = [states[i][key] for i in range(len(osd[FP32_FLAT_GROUPS]))]
            torch.save(sd, f)
        return get_fp32_state_dict_from_zero_checkpoint(tmp, tag=tag_dir.name)


def test_the_universal_checkpoint_holds_the_saved_weights_and_adam_moments(legs):
    """Each parameter's fp32 weight, exp_avg and exp_avg_sq in the universal folder equal the 2-rank save's, whole."""
    strategy, full, down, _ = legs
    saved = full.run_dir / "checkpoints" / "step-0000003"
    universal = down.run_dir / "checkpoints" / "step-0000003_universal" / "zero"
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        whole = _consolidated(saved, key)
        assert len(whole) > 10, sorted(whole)
        for name, tensor in whole.items():
            theirs = torch.load(universal / name / f"{key}.pt", map_location="cpu", weights_only=False)
            theirs = theirs["param"] if isinstance(theirs, dict) else theirs
            # ZeRO-1/2's universal files keep each parameter's shape; ZeRO-3's are flat (its loader slices them flat)
            assert theirs.shape in (tensor.shape, (tensor.numel(),)), (strategy, key, name, theirs.shape)
            assert torch.equal(theirs.float().flatten(), tensor.float().flatten()), (strategy, key, name)
        if key != "fp32":
            assert any(t.abs().sum() > 0 for t in whole.values()), f"{key} all zero: not Adam's state after 3 steps"
