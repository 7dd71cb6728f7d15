"""The rank entry point: one process of a DeepSpeed training job (run by the deepspeed launcher).

    deepspeed --num_gpus 2 --module --no_local_rank components.training.rank --request runs/r1/request.json

The request (written by components/training/launcher.py) holds the training section, the
generated DeepSpeed config, the layout and the paths. Rank 0 appends one JSON line per
logged step to <run>/metrics.jsonl and prints it after EVENT_PREFIX for the launcher's
progress bar. Every `save_every` steps all ranks save a checkpoint, and rank 0 marks it
complete only after a barrier. At the end every rank takes part in the export.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lmforge.components.errors import UserError
from lmforge.components.training.launcher import EVENT_PREFIX, USER_ERROR_PREFIX, watch_supervisor


def parse_args(argv: list[str]) -> argparse.Namespace:
    # Launchers other than ours may still append --local_rank=N; the rank reads LOCAL_RANK instead.
    argv = [a for a in argv if not a.startswith("--local_rank")]
    p = argparse.ArgumentParser(prog="lmforge.components.training.rank")
    p.add_argument("--request", required=True, type=Path)
    return p.parse_args(argv)


def _emit(run_dir: Path, event: dict[str, Any]) -> None:
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(event) + "\n")
    print(EVENT_PREFIX + json.dumps(event), flush=True)


def _rng_state() -> list[int]:
    return torch.get_rng_state().tolist()


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    watch_supervisor()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    req = json.loads(args.request.read_text())
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)

    import deepspeed
    import torch.distributed as dist

    from lmforge.components.sections.training import TrainingConfig
    from lmforge.components.training import checkpoint as ckpt
    from lmforge.components.training.data import TokenWindows
    from lmforge.components.training.memory import device_peak_bytes, host_rss_bytes, model_state_bytes
    from lmforge.components.training.model import build_model, count_params, load_tokenizer, train_flops_per_token
    from lmforge.components.training.perf import matmul_peak_flops, mfu
    from lmforge.components.training.pipeline_model import IdleClock, build_pipeline, lm_loss
    from lmforge.components.training.strategies import for_deepspeed

    cfg = TrainingConfig.model_validate(req["training"])
    layout, ds_config = req["layout"], req["ds_config"]
    run_dir, ckpt_dir = Path(req["run_dir"]), Path(req["run_dir"]) / "checkpoints"
    t_import = time.perf_counter()
    deepspeed.init_distributed()
    t_init = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    (run_dir / "ranks" / f"rank{rank}.pid").write_text(str(os.getpid()))

    tokenizer = load_tokenizer(Path(req["tokenizer"]))
    windows = TokenWindows.open(Path(req["shards"]), seq_len=cfg.seq_len, seed=cfg.seed)
    model = build_model(cfg.model, tokenizer, seq_len=cfg.seq_len, seed=cfg.seed)
    n_params = count_params(model)
    pp, tp, bf16 = layout["pp"], layout["tp"], layout["bf16"]
    if pp > 1:
        net = build_pipeline(model, stages=pp, partition=ds_config["pipeline"]["partition"],
                             activation_checkpoint_interval=ds_config["pipeline"]["activation_checkpoint_interval"])
    else:
        if cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        net = model
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           config=for_deepspeed(ds_config))
    if pp > 1:
        dp_rank, dp_size = engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()
    else:
        from deepspeed.utils import groups

        dp_rank, dp_size = groups._get_data_parallel_rank(), groups._get_data_parallel_world_size()
    assert dp_size == layout["dp"], (dp_size, layout)
    device = engine.device
    idle = IdleClock.attach(engine) if pp > 1 else None
    t_engine = time.perf_counter()
    if rank == 0:
        print(f"startup: imports {t_import - t_start:.1f}s, process group {t_init - t_import:.1f}s, "
              f"engine {t_engine - t_init:.1f}s", flush=True)

    start = 0
    if req["resume"]:
        step, folder = ckpt.latest_complete(ckpt_dir)
        _, client = engine.load_checkpoint(str(ckpt_dir), tag=folder.name)
        assert client is not None and client["step"] == step, (client, step)
        torch.set_rng_state(torch.tensor(client["rng"][rank], dtype=torch.uint8))
        start = step
        if rank == 0:
            print(f"resumed from {folder.name} (step {step}, data position {client['data_position']})", flush=True)

    dtype = torch.bfloat16 if bf16 else torch.float32
    peak_t = torch.tensor([matmul_peak_flops(dtype, device=str(device))], dtype=torch.float64)
    dist.all_reduce(peak_t)  # ranks share the machine: the sum is what all of them together reach
    peak = float(peak_t.item())
    flops_per_token = train_flops_per_token(cfg.model, vocab_size=len(tokenizer), seq_len=cfg.seq_len)
    tokens_per_step = layout["global_batch"] * cfg.seq_len
    if rank == 0:
        print(f"model {n_params / 1e6:.2f}M params; layout {json.dumps(layout)}; peak {peak / 1e9:.0f} GFLOP/s", flush=True)

    loss_val = float("nan")
    for step in range(start, cfg.max_steps):
        lr = float(engine.get_lr()[0])
        t0 = time.perf_counter()
        micro = windows.micro_batches(step, dp_rank=dp_rank, dp_size=dp_size, micro=layout["micro"], accum=layout["accum"])
        done = step + 1
        logging_step = done % cfg.log_every == 0 or done == cfg.max_steps or done == start + 1
        mem: dict[str, int] = {}
        if pp > 1:
            loss = engine.train_batch(iter([(x.to(device), y.to(device)) for x, y in micro])).detach().float()
        else:
            total = torch.zeros((), device=device)
            for i, (x, y) in enumerate(micro):
                out = engine(input_ids=x.to(device))
                mb_loss = lm_loss(out.logits, y.to(device))
                engine.backward(mb_loss)
                if logging_step and i == len(micro) - 1:
                    # Measured between the last backward and the step: gradients are all alive here,
                    # which is the moment the ZeRO paper's model-state count describes.
                    mem = model_state_bytes(engine)
                engine.step()
                total += mb_loss.detach().float()
            loss = total / len(micro)
        dt = time.perf_counter() - t0  # before the logging collective, so the idle fraction is the schedule's own
        idle_fraction = idle.idle_fraction(dt) if idle is not None else 0.0
        dist.all_reduce(loss)
        loss_val = float(loss.item()) / world
        if logging_step:
            mem = mem or model_state_bytes(engine)
            mem.update(rss=host_rss_bytes(), device_peak=device_peak_bytes() or 0, idle_fraction=idle_fraction)
            per_rank: list[Any] = [None] * world
            dist.all_gather_object(per_rank, mem)
            if rank == 0:
                tps = tokens_per_step / dt
                _emit(run_dir, {"step": done, "loss": loss_val, "lr": lr, "tokens_per_s": tps, "step_s": dt,
                                "mfu": mfu(tokens_per_s=tps, flops_per_token=flops_per_token, peak_flops=peak),
                                "memory": per_rank, "attempt": req["attempt"], "max_steps": cfg.max_steps})
        if done % cfg.save_every == 0 or done == cfg.max_steps:
            rngs: list[Any] = [None] * world
            dist.all_gather_object(rngs, _rng_state())
            tag = ckpt.tag_for(done)
            engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False,
                                   client_state={"step": done, "data_position": done * layout["global_batch"], "rng": rngs})
            dist.barrier()
            if rank == 0:
                ckpt.mark_complete(ckpt_dir, tag, step=done, world_size=world, extra={"layout": layout})
                ckpt.prune(ckpt_dir, keep=cfg.keep_checkpoints)
            dist.barrier()

    _export(engine, req, layout, tokenizer, cfg, windows, dtype, loss_val, peak, n_params)
    dist.barrier()
    return 0


def _export(engine: Any, req: dict[str, Any], layout: dict[str, Any], tokenizer: Any, cfg: Any, windows: Any,
            dtype: torch.dtype, final_loss: float, peak: float, n_params: int) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from lmforge.components.training.export import gather_hf_state, write_export
    from lmforge.components.training.model import llama_config

    rank = dist.get_rank()
    run_dir = Path(req["run_dir"])
    probe = windows.batch(windows.window_ids(0, 2))[0]
    if layout["pp"] == 1:
        # The engine's own logits on a fixed batch, so a test can check the export reproduces them.
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=probe.to(engine.device)).logits.float().cpu()
        engine.train()
        if rank == 0:
            save_file({"input_ids": probe, "logits": logits.contiguous()}, str(run_dir / "probe.safetensors"))
    state = gather_hf_state(engine, zero_stage=layout["zero_stage"], tp=layout["tp"], pp=layout["pp"])
    if rank == 0:
        assert state is not None
        meta = {**req["meta"], "steps": cfg.max_steps, "final_loss": final_loss, "params": n_params,
                "dtype": str(dtype).removeprefix("torch."), "layout": layout, "peak_flops": peak}
        write_export(run_dir / "export", state, llama_config(cfg.model, tokenizer, seq_len=cfg.seq_len, dtype=dtype),
                     tokenizer, dtype=dtype, meta=meta)
        print(f"exported {run_dir / 'export'}", flush=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        # The launcher turns this line back into the same UserError in the parent process.
        print(USER_ERROR_PREFIX + json.dumps({"what": e.what, "value": None if e.value is None else str(e.value),
                                              "problem": e.problem, "fix": e.fix}), flush=True)
        sys.exit(2)
