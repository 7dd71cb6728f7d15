"""The rank entry point: one process of a DeepSpeed training job (run by the deepspeed launcher).

    deepspeed --num_gpus 2 --module --no_local_rank lmforge.components.training.rank --request runs/r1/request.json

The request (a RankRequest, components/training/protocol.py, written by the launcher) holds
the training section, the generated DeepSpeed config, the layout and the paths. main() is a short
sequence: the device and the process group; the model and the engine through the ordered apply_* steps of
assemble.py (MoE, LoRA, torch's pipeline schedules, DeepSpeed's 1f1b stages, activation checkpointing,
DeepSpeed's engine, compile), each applied when the request asks for it; a resume; then loop.py's train_step
for each step and log_step on a logged one, with save_step every `save_every`; and the export. Resume, save_step,
the random streams they carry and the export are here. Rank 0 appends
one JSON line per logged step to <run>/metrics.jsonl and prints it after EVENT_PREFIX for the launcher's
progress bar. Every `save_every` steps all ranks save a checkpoint, and rank 0 marks it
complete only after a barrier. At the end every rank takes part in the export.

The request's `hardware` (components/training/job.py) says the device, the precision and the
peak FLOP/s, all decided before the ranks started. Tensors reach the device in one place each:
batches through `to_device` (pinned, non-blocking on CUDA), collectives through
DeviceCollectives. Only logged steps read anything back from the device (the loss, one gather
of the memory figures); throughput is taken over the steps since the last log.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmforge.components.training.collectives import DeviceCollectives
from lmforge.components.training.protocol import (
    RankRequest,
    export_meta,
    parse_rank_args,
    read_request,
    run_rank,
    watch_supervisor,
)

if TYPE_CHECKING:
    from lmforge.components.training.assemble import RankState
    from lmforge.components.training.loop import Loop


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    watch_supervisor()
    req = read_request(parse_rank_args(sys.argv[1:] if argv is None else argv).request)
    limit_threads()
    # DeepSpeed and transformers load here: the startup line's "imports".
    from lmforge.components.training.assemble import assemble, open_rank
    from lmforge.components.training.loop import Loop, log_step, pipeline_clock, train_step

    use_device(req)
    t_import = time.perf_counter()
    rank, world = join_job(req)
    t_init = time.perf_counter()
    s = assemble(open_rank(req, rank=rank, world=world))
    comms, idle = DeviceCollectives(s.engine.device, world=world), pipeline_clock(s)
    if rank == 0:
        print(f"startup: imports {t_import - t_start:.1f}s, process group {t_init - t_import:.1f}s, "
              f"engine {time.perf_counter() - t_init:.1f}s", flush=True)

    loop = Loop.open(s, comms, idle, start=resume(s) if req.resume else 0)
    cfg = s.cfg
    for step in range(loop.start, cfg.max_steps):
        lr, done = float(s.engine.get_lr()[0]), step + 1  # the scheduler's host value: no device sync
        logged = loop.logged(s, done)
        loss, step_s = train_step(s, loop, step, logged=logged)
        if logged:
            log_step(s, loop, done=done, lr=lr, loss=loss, step_s=step_s)
        if done % cfg.save_every == 0 or done == cfg.max_steps:
            save_step(s, loop, done)

    export(s, final_loss=loop.loss_val, peak=loop.peak)
    comms.barrier()
    if rank == 0 and loop.swap is not None:
        shutil.rmtree(loop.swap, ignore_errors=True)  # the run's NVMe swap files: the checkpoints hold what a resume needs
    # The final barrier is the last collective: run_rank (protocol.py) then ends the process without the
    # interpreter's teardown, whose native destructors aborted finished ranks in CI.
    return 0


def limit_threads() -> None:
    """OMP_NUM_THREADS, when the launcher set it, as torch's thread count: host-side work; on CPU ranks x threads = cores."""
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)


def use_device(req: RankRequest) -> None:
    """On CUDA, before the process group: this rank's GPU (NCCL, all_gather_object and every default-device tensor use
    it), and without bf16 fp32 matmuls as TF32, which the peak in the request assumes."""
    if req.hardware.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not req.layout.bf16:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True


def join_job(req: RankRequest) -> tuple[int, int]:
    """deepspeed.init_distributed, then this rank's pid in <run>/ranks/: (rank, world size)."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    (req.run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    (req.run_dir / "ranks" / f"rank{rank}.pid").write_text(str(os.getpid()))
    return rank, world


def resume(s: RankState) -> int:
    """Every rank loads the newest complete checkpoint and its own random streams, or on another world size
    streams reseeded from the seed, the step and the rank (universal.py): the step to start from."""
    from lmforge.components.training import checkpoint as ckpt
    from lmforge.components.training.universal import load_tag, reseed

    cfg, layout, ckpt_dir = s.cfg, s.layout, s.req.run_dir / "checkpoints"
    step, folder = ckpt.latest_complete(ckpt_dir)
    tag = load_tag(folder, s.req.ds_config)  # <tag>_universal on another world size (job.py converted it)
    _, client = s.engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=not s.lora)
    assert client is not None and client["step"] == step, (client, step)
    assert client["data_position"] == step * layout.global_batch, (client["data_position"], layout)
    saved_world = len(client["rng"])
    if saved_world == s.world:
        restore_rng(client["rng"][s.rank])
    else:  # no saved stream belongs to a rank of a new world: see universal.py
        reseed(seed=cfg.seed, step=step, rank=s.rank)
    if s.rank == 0:
        how = "" if saved_world == s.world else f" from {saved_world} ranks on {s.world} (universal checkpoint {tag})"
        print(f"resumed step {step}{how} from {folder.name}, data position {client['data_position']}", flush=True)
    return step


def save_step(s: RankState, loop: Loop, done: int) -> None:
    """Every rank saves its part of the checkpoint after `done` steps; rank 0 marks it complete after a barrier and
    prunes the old ones. The throughput window starts again after: a save is not training time."""
    from lmforge.components.training import checkpoint as ckpt

    comms, layout, ckpt_dir = loop.comms, s.layout, s.req.run_dir / "checkpoints"
    rngs = comms.gather_objects(rng_state())
    tag = ckpt.tag_for(done)
    # LoRA: the adapters and their optimizer states only; the frozen base is the init folder's.
    s.engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False, exclude_frozen_parameters=s.lora,
                             client_state={"step": done, "data_position": done * layout.global_batch, "rng": rngs,
                                           **loop.universal_state})
    comms.barrier()
    if s.rank == 0:
        ckpt.mark_complete(ckpt_dir, tag, step=done, world_size=s.world, extra={"layout": layout.to_dict()})
        ckpt.prune(ckpt_dir, keep=s.cfg.keep_checkpoints)
    comms.barrier()
    loop.window.restart()


def rng_state() -> dict[str, Any]:
    """This rank's CPU and (when CUDA is up) CUDA generator states, JSON-able."""
    cuda = torch.cuda.get_rng_state().tolist() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state().tolist(), "cuda": cuda}


def restore_rng(state: Any) -> None:
    if isinstance(state, list):  # checkpoints before the CUDA state was kept: the CPU state alone
        state = {"cpu": state, "cuda": None}
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def export(s: RankState, *, final_loss: float, peak: float) -> None:
    """Every rank takes part: a probe for the tests (the engine's logits on a fixed batch, or with DeepSpeed's 1f1b its
    loss on the global batch after the last; none on torch's schedules), the full state gathered in Hugging Face names
    (MoE: every rank's experts), and rank 0 writes <run>/export (LoRA: merged into the base, the adapters beside it)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from lmforge.components.runtime.accelerator import to_device
    from lmforge.components.training.hf_export import gather_hf_state, write_export
    from lmforge.components.training.model import model_config

    engine, req, layout, tokenizer, cfg, windows = s.engine, s.req, s.layout, s.tokenizer, s.cfg, s.windows
    dtype = torch.bfloat16 if layout.bf16 else torch.float32
    rank = dist.get_rank()
    run_dir = req.run_dir
    probe = windows.batch(np.arange(2))[0]
    probe = probe["input_ids"] if isinstance(probe, dict) else probe
    if layout.pp == 1:
        # The engine's own logits on a fixed batch, so a test can check the export reproduces them.
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=probe.to(engine.device)).logits.float().cpu()
        engine.train()
        if rank == 0:
            save_file({"input_ids": probe, "logits": logits.contiguous()}, str(run_dir / "probe.safetensors"))
    else:
        from deepspeed.runtime.pipe.engine import PipelineEngine

        if isinstance(engine, PipelineEngine):
            # No stage holds the logits: the engine's loss on the global batch after the last (one it never trained
            # on), each data-parallel replica its own part; a test checks the export's loss on the same windows.
            step = cfg.max_steps
            mine = windows.micro_batches(step, dp_rank=engine.grid.get_data_parallel_rank(), dp_size=layout.dp,
                                         micro=layout.micro, accum=layout.accum)
            loss = engine.eval_batch(iter([(to_device(x, engine.device), to_device(y, engine.device)) for x, y in mine]))
            if rank == 0:
                every = windows.micro_batches(step, dp_rank=0, dp_size=1, micro=layout.micro, accum=layout.accum * layout.dp)
                save_file({"input_ids": torch.cat([x for x, _ in every]), "labels": torch.cat([y for _, y in every]),
                           "loss": loss.detach().float().cpu().reshape(1)}, str(run_dir / "probe.safetensors"))
    state = gather_hf_state(engine, zero_stage=layout.zero_stage, tp=layout.tp, pp=layout.pp)
    if cfg.model.moe.num_experts:
        from lmforge.components.training.moe import with_all_experts

        state = with_all_experts(state, engine.module, cfg.model.moe.num_experts)  # the experts of every rank
    if rank == 0:
        assert state is not None
        extra = {}
        if cfg.lora.r:
            from lmforge.components.training.lora_training import ADAPTER_DIR, merge_adapters

            state = merge_adapters(state, cfg, run_dir / ADAPTER_DIR)
            extra[ADAPTER_DIR] = run_dir / ADAPTER_DIR
        meta = {**export_meta(req), "steps": cfg.max_steps, "final_loss": final_loss, "params": s.n_params,
                "dtype": str(dtype).removeprefix("torch."), "layout": layout.to_dict(), "peak_flops": peak}
        # A base's tokenizer is the dataset's (training refused any other): its files go into the export as they are.
        write_export(run_dir / "export", state, model_config(cfg.model, tokenizer, seq_len=cfg.seq_len, dtype=dtype),
                     tokenizer, dtype=dtype, meta=meta, tokenizer_dir=req.tokenizer if cfg.model.init else None, extra=extra)
        print(f"exported {run_dir / 'export'}", flush=True)


if __name__ == "__main__":
    run_rank(main)
