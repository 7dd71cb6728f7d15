"""Resume on another number of ranks through DeepSpeed's universal checkpoint.

    note = prepare_elastic(folder, marker, cfg, layout)   # checks, then converts once: <ckpt>/<tag>_universal
    ds = apply_universal_load(ds)                         # strategies.py: "checkpoint": {"load_universal": true}
    tag = load_tag(folder, ds)                            # in the rank: the tag engine.load_checkpoint reads
    reseed(seed=cfg.seed, step=step, rank=rank)           # a new world's RNG streams

A ZeRO checkpoint holds each rank's flat shard of the fp32 weights and Adam moments; DeepSpeed
refuses it on another data-parallel size. `deepspeed.checkpoint.ds_to_universal` rewrites it as
one file per parameter and state (zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt), which an engine of
any size slices again when its config says `"checkpoint": {"load_universal": true}`.

The conversion runs here, in the parent process before the ranks start (it reads files and needs
no process group), once: the result is kept beside the checkpoint as <tag>_universal with its own
COMPLETE.json, built under a temporary name and renamed into place (workspace.atomic_dir), so a
conversion cut off leaves nothing a later resume would trust. Every save carries
client_state[UNIVERSAL_CHECKPOINT_INFO] (rank.py); the conversion also passes
inject_missing_state, so a checkpoint saved before that still converts (the flag only fills the
info when it is absent).

What is checked before anything converts, each refusal with its reason and a fix:
- the global batch must be the one the checkpoint was saved with. Batches are a pure function of
  (seed, step, global batch) (batches.py, sft.py): step s trains on windows [s*G, (s+1)*G) of one
  seeded order, and any split of those G windows over ranks trains on the same set. With G kept,
  the resumed step s+1 takes exactly the windows after the saved position s*G: no sample repeats
  or is skipped. A different G would move every later step's window range and the LR schedule's
  meaning, so it is refused with the arithmetic and the grad_accum_steps that keeps G.
- the strategy: a ZeRO stage (1, 2, 3) and the same one the checkpoint was saved with. ddp
  (stage 0) keeps no ZeRO shards, and ds_to_universal reads only those (it finds no
  *_optim_states.pt), so it is refused rather than loaded by a path not tested here.
- pipeline stages and AutoTP on either side: lmforge's pipeline saves per-layer files that
  ds_to_universal's Megatron-style TP/PP merge does not describe, and AutoTP's universal merge
  needs the patterns of DeepSpeed's own AutoTP layers; refused, not converted.
- MoE (its expert files convert only under AutoEP), LoRA (only the adapters are saved) and
  offload: not tested with a universal load here, so refused as "not yet".

The saved RNG states are one per old rank and cannot map one to one onto a new world: the data
each new rank sees is a new slice, so no old stream "belongs" to it. Each rank is re-seeded from
(seed, step, rank) instead: deterministic, distinct per rank, and the same on a rerun. (On the
same world size the ranks restore their own states, bit for bit, as before.)
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.sections.training import TrainingConfig
from lmforge.components.training import checkpoint as ckpt
from lmforge.components.training.layout import Layout

SUFFIX = "_universal"
CONVERT_LOG = "convert.log"


def universal_dir(folder: Path) -> Path:
    """Where the universal form of checkpoint `folder` lives: beside it, <tag>_universal."""
    return Path(folder).with_name(Path(folder).name + SUFFIX)


def check_elastic(marker: dict[str, Any], cfg: TrainingConfig, layout: Layout, folder: Path) -> None:
    """Refuse, before any conversion, what a universal resume cannot continue exactly."""
    saved = marker.get("layout")
    old, new = marker["world_size"], layout.world_size

    def refuse(key: str, value: Any, problem: str, fix: str) -> UserError:
        return UserError(key, value, f"cannot resume {folder.name} (saved on {old} ranks) on {new}: {problem}", fix)

    same = f"Resume with training.num_ranks={old}"
    if saved is None:
        raise refuse("--resume", folder, "its marker records no layout (saved before lmforge kept one)", same)
    for side, lay in (("saved", saved), ("this job's", layout.to_dict())):
        if lay["pp"] > 1 or lay["tp"] > 1:
            raise refuse("training.parallel", f"pp={lay['pp']} tp={lay['tp']}",
                         f"the {side} layout has pipeline stages or AutoTP; lmforge's pipeline saves per-layer files "
                         "and AutoTP shards that DeepSpeed's universal conversion does not merge for these models",
                         f"{same}, or train a data-parallel layout (ddp, zero1-3) to change the world size")
    if saved["zero_stage"] == 0 or layout.zero_stage == 0:
        raise refuse("training.parallel.strategy", cfg.parallel.strategy,
                     "a universal checkpoint is converted from ZeRO optimizer shards, and ddp (stage 0) saves none",
                     f"{same}, or train with zero1, zero2 or zero3 to resume on another world size")
    if saved["zero_stage"] != layout.zero_stage:
        raise refuse("training.parallel.strategy", cfg.parallel.strategy,
                     f"the checkpoint was saved under zero{saved['zero_stage']}",
                     f"Resume with training.parallel.strategy = \"zero{saved['zero_stage']}\"")
    if cfg.model.moe.num_experts:
        raise refuse("training.model.moe.num_experts", cfg.model.moe.num_experts,
                     "not yet: DeepSpeed converts expert files only for AutoEP, not lmforge's MoE layers", same)
    if cfg.lora.r:
        raise refuse("training.lora.r", cfg.lora.r, "not yet: a LoRA checkpoint holds the adapters only, and a "
                     "universal load of it is not tested here", same)
    par = cfg.parallel
    if par.offload_optimizer or par.offload_param:
        raise refuse("training.parallel.offload_optimizer", par.offload_optimizer or par.offload_param,
                     "not yet: a universal load into offloaded states is not tested here",
                     f"{same}, or resume without offload")
    check_global_batch(saved, layout, folder)


def check_global_batch(saved: dict[str, Any], layout: Layout, folder: Path) -> None:
    """The same global batch, or a refusal with both products and the grad_accum_steps that keeps it."""
    if saved["global_batch"] == layout.global_batch:
        return
    g, per_step = saved["global_batch"], layout.micro * layout.dp
    fix = (f"Set training.grad_accum_steps={g // per_step} (then {layout.micro} x {g // per_step} x {layout.dp} = {g})"
           if g % per_step == 0 else
           f"Pick micro_batch_size and grad_accum_steps with micro x accum x {layout.dp} = {g}")
    raise UserError("training.grad_accum_steps", layout.accum,
                    f"gives a global batch of micro x accum x dp = {layout.micro} x {layout.accum} x {layout.dp} = "
                    f"{layout.global_batch}, but {folder.name} was trained at {saved['micro']} x {saved['accum']} x "
                    f"{saved['dp']} = {g}; the data position (step x global batch) and the LR schedule only continue "
                    "without repeated or skipped samples at the same global batch", fix)


def convert(folder: Path, *, step: int, world_size: int) -> tuple[Path, bool]:
    """<tag>_universal for checkpoint `folder`: (path, converted now). Reused when complete; atomic when built."""
    from lmforge.components.workspace import atomic_dir

    out = universal_dir(folder)
    if (out / ckpt.MARKER).is_file():
        ckpt.verify(out)
        return out, False
    with atomic_dir(out) as tmp:
        _ds_to_universal(folder, tmp, world_size=world_size)
        ckpt.mark_complete(tmp.parent, tmp.name, step=step, world_size=world_size, extra={"converted_from": folder.name})
    return out, True


def _ds_to_universal(folder: Path, out: Path, *, world_size: int) -> None:
    """DeepSpeed's converter, in this process: with one extract and one merge worker it runs inline, with no
    process pool forked from the flow's process. Its progress lines go to <out>/convert.log, and their last
    ones into the error when it fails."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(folder), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    log = out / CONVERT_LOG
    try:
        with open(log, "w", encoding="utf-8") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            ds_to_universal.main(args)
    except Exception as e:
        lines = log.read_text(encoding="utf-8").splitlines() if log.is_file() else []
        tail = " | ".join(line.strip() for line in lines[-4:] if line.strip())  # one line, as every UserError is
        raise UserError("--resume", folder, f"could not be converted to a universal checkpoint ({type(e).__name__}: {e})"
                        f"{'; converter output: ' + tail if tail else ''}",
                        f"Resume with training.num_ranks={world_size}, the world it was saved on") from e
    # DeepSpeed also points <out>/../latest_universal at its output folder, here the temporary name; lmforge loads by
    # tag and never reads that pointer, so it is removed rather than left naming a folder about to be renamed.
    (out.parent / "latest_universal").unlink(missing_ok=True)


def prepare_elastic(folder: Path, marker: dict[str, Any], cfg: TrainingConfig, layout: Layout) -> str:
    """Check, convert once, and say what the resume will do (a line for the CLI and the flow)."""
    check_elastic(marker, cfg, layout, folder)
    out, fresh = convert(folder, step=marker["step"], world_size=marker["world_size"])
    how = "converted" if fresh else "reused"
    return (f"resumed step {marker['step']} from {marker['world_size']} ranks on {layout.world_size} (universal checkpoint, "
            f"{how} {out.name}; global batch {layout.global_batch} kept, so the data continues at window "
            f"{marker['step'] * layout.global_batch}; RNG re-seeded per rank from (seed, step, rank))")


def load_tag(folder: Path, ds_config: dict[str, Any]) -> str:
    """The tag the rank hands engine.load_checkpoint: the universal folder's when the config loads universally."""
    return universal_dir(folder).name if ds_config.get("checkpoint", {}).get("load_universal") else Path(folder).name


def reseed(*, seed: int, step: int, rank: int) -> int:
    """Seed torch's generators (CPU and CUDA) from (seed, step, rank); returns the seed used."""
    import numpy as np
    import torch

    value = int(np.random.SeedSequence([seed, step, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)
    torch.manual_seed(value)  # seeds every CUDA device too
    return value


def universal_info() -> dict[str, Any]:
    """The client_state entry each save carries, so ds_to_universal accepts the checkpoint as meant for conversion."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    return {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
