"""The rank entry point: one process of a DeepSpeed training job (run by the deepspeed launcher).

    deepspeed --num_gpus 2 --module --no_local_rank lmforge.components.training.rank --request runs/r1/request.json

The request (a RankRequest, components/training/protocol.py, written by the launcher) holds
the training section, the generated DeepSpeed config, the layout and the paths. Rank 0 appends
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
from typing import Any

import numpy as np
import torch

from lmforge.components.training.collectives import DeviceCollectives, memory_rows
from lmforge.components.training.layout import Layout
from lmforge.components.training.perf import ThroughputWindow, devices_in_job
from lmforge.components.training.protocol import (
    RankRequest,
    emit_event,
    parse_rank_args,
    read_request,
    run_rank,
    straggler_delay,
    watch_supervisor,
)


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


def measure_at_step(engine: Any, into: dict[str, int]) -> None:
    """Model-state bytes into `into` as DeepSpeed's pipeline engine begins its next optimizer step, when every
    gradient is alive (after it, they are freed): the moment the loop measures the other strategies at. Once."""
    from lmforge.components.training.memory import model_state_bytes

    take = engine._take_model_step

    def step(*args: Any, **kwargs: Any) -> Any:
        del engine._take_model_step  # the class's method again from the next step on
        into.update(model_state_bytes(engine))
        return take(*args, **kwargs)
    engine._take_model_step = step


def keep_grad_norm(engine: Any) -> None:
    """engine.get_global_grad_norm() for every precision: DeepSpeed keeps the norm its ZeRO and bf16 optimizers
    compute, but drops the one its fp32 clip (clip_fp32_gradients, no ZeRO) computes; this keeps that one too."""
    from deepspeed.runtime import engine as ds_engine

    def clip() -> None:
        engine._global_grad_norm = ds_engine.clip_grad_norm_(parameters=engine.module.parameters(),
                                                             max_norm=engine.gradient_clipping(), mpu=engine.mpu)
    engine.clip_fp32_gradients = clip


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    watch_supervisor()
    args = parse_rank_args(sys.argv[1:] if argv is None else argv)
    req = read_request(args.request)
    hw = req.hardware
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)  # host-side work; on CPU ranks x threads = cores

    import deepspeed
    import torch.distributed as dist

    from lmforge.components.accelerator import to_device
    from lmforge.components.training import checkpoint as ckpt
    from lmforge.components.training.data import TokenWindows
    from lmforge.components.training.memory import device_peak_bytes, host_peak_rss_bytes, host_rss_bytes, model_state_bytes
    from lmforge.components.training.model import build_model, count_params, flops_per_token, load_tokenizer, model_config
    from lmforge.components.training.nvme import swap_bytes, swap_root
    from lmforge.components.training.perf import mfu
    from lmforge.components.training.pipeline_model import IdleClock, build_pipeline, lm_loss
    from lmforge.components.training.strategies import for_deepspeed

    cfg, layout, ds_config = req.training, req.layout, req.ds_config
    swap = swap_root(ds_config)  # ZeRO-Infinity's NVMe tier: this run's swap folder, or None
    run_dir, ckpt_dir = req.run_dir, req.run_dir / "checkpoints"
    pp, bf16 = layout.pp, layout.bf16
    if hw.device == "cuda":
        # Before the process group: NCCL, all_gather_object and every default-device tensor use this GPU.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not bf16:
            torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls as TF32: the peak in the request assumes it
            torch.backends.cudnn.allow_tf32 = True
    t_import = time.perf_counter()
    deepspeed.init_distributed()
    t_init = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    (run_dir / "ranks" / f"rank{rank}.pid").write_text(str(os.getpid()))

    tokenizer = load_tokenizer(req.tokenizer)
    if req.sft_batching is not None:
        from lmforge.components.training.sft import SFT_DIR, SftBatches

        windows: Any = SftBatches.open(run_dir / SFT_DIR, seq_len=cfg.seq_len, seed=cfg.seed, batching=req.sft_batching,
                                       pad_id=tokenizer.eos_token_id)
    else:
        windows = TokenWindows.open(req.shards, seq_len=cfg.seq_len, seed=cfg.seed)
    zero3 = layout.zero_stage == 3 and pp == 1
    model = build_model(cfg.model, tokenizer, seq_len=cfg.seq_len, seed=cfg.seed,
                        zero3_config=for_deepspeed(ds_config) if zero3 else None)
    n_params = count_params(model)
    moe = None
    if cfg.model.moe.num_experts:
        from lmforge.components.training.moe import MoeRun, optimizer_groups

        moe = MoeRun.attach(model, cfg.model.moe, ep_size=cfg.parallel.expert_parallel, rank=rank)
    lora = cfg.lora.r > 0
    if lora:
        from lmforge.components.training.lora import with_adapters

        model = with_adapters(model, cfg)  # the base frozen; only the adapters reach the optimizer below
    # interleaved-1f1b, zero-bubble, dualpipev: torch.distributed.pipelining behind the same engine calls
    torch_pp = pp > 1 and cfg.parallel.pipeline.schedule != "1f1b"
    if torch_pp:
        from lmforge.components.training.schedules import build_engine

        engine: Any = build_engine(model, req, windows, log=lambda s: print(s, flush=True) if rank == 0 else None)
    elif pp > 1:
        net = build_pipeline(model, stages=pp, partition=ds_config["pipeline"]["partition"],
                             activation_checkpoint_interval=ds_config["pipeline"]["activation_checkpoint_interval"],
                             tensor_parallel=ds_config["pipeline"].get("tensor_parallel", 1))
    else:
        if cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        net = model
    if not torch_pp:
        params: list[Any] = [p for p in net.parameters() if p.requires_grad]
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=optimizer_groups(params) if moe else params,
                                               config=for_deepspeed(ds_config))
        keep_grad_norm(engine)
    if moe:
        moe.check_groups(rank)
    if hw.compile:
        engine.compile()
    if pp > 1:
        dp_rank, dp_size = engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()
    else:
        from deepspeed.utils import groups

        dp_rank, dp_size = groups._get_data_parallel_rank(), groups._get_data_parallel_world_size()
    assert dp_size == layout.dp, (dp_size, layout)
    device = engine.device
    comms = DeviceCollectives(device, world=world)
    idle = (engine.clock if torch_pp else IdleClock.attach(engine)) if pp > 1 else None
    t_engine = time.perf_counter()
    if rank == 0:
        print(f"startup: imports {t_import - t_start:.1f}s, process group {t_init - t_import:.1f}s, "
              f"engine {t_engine - t_init:.1f}s", flush=True)

    start = 0
    if req.resume:
        from lmforge.components.training.universal import load_tag, reseed

        step, folder = ckpt.latest_complete(ckpt_dir)
        tag = load_tag(folder, ds_config)  # <tag>_universal on another world size (job.py converted it)
        _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=not lora)
        assert client is not None and client["step"] == step, (client, step)
        assert client["data_position"] == step * layout.global_batch, (client["data_position"], layout)
        saved_world = len(client["rng"])
        if saved_world == world:
            restore_rng(client["rng"][rank])
        else:  # no saved stream belongs to a rank of a new world: see universal.py
            reseed(seed=cfg.seed, step=step, rank=rank)
        start = step
        if rank == 0:
            how = "" if saved_world == world else f" from {saved_world} ranks on {world} (universal checkpoint {tag})"
            print(f"resumed step {step}{how} from {folder.name}, data position {client['data_position']}", flush=True)

    dtype = torch.bfloat16 if bf16 else torch.float32
    # Measured (or looked up) once before the ranks started: see components/training/perf.py.
    peak = hw.peak_flops_per_device * devices_in_job(hw.device, world)
    token_flops = flops_per_token(cfg.model, model_config(cfg.model, tokenizer, seq_len=cfg.seq_len), seq_len=cfg.seq_len)
    if lora:
        token_flops *= 2 / 3  # a frozen weight gets no weight gradient: forward 2N + backward 2N, not 6N

    def step_tokens(step: int) -> int:
        """Tokens the step trains on: every window's, or (SFT) the real examples' without padding."""
        if req.sft_batching is None:
            return layout.global_batch * cfg.seq_len
        return windows.real_tokens(step, dp_size=dp_size, micro=layout.micro, accum=layout.accum)
    if rank == 0:
        print(f"model {n_params / 1e6:.2f}M params; layout {layout.model_dump_json()}; {hw.device} {hw.precision} "
              f"({hw.precision_reason}); peak {peak / 1e9:.0f} GFLOP/s ({hw.peak_source}); "
              f"compile {'on' if hw.compile else 'off'}", flush=True)

    def place(step: int) -> list[tuple[Any, torch.Tensor]]:
        """The step's micro-batches on the device: (model inputs, labels); the pipeline engine takes (ids, labels)."""
        mbs = windows.micro_batches(step, dp_rank=dp_rank, dp_size=dp_size, micro=layout.micro, accum=layout.accum)
        if pp > 1:
            return [(to_device(x, device), to_device(y, device)) for x, y in mbs]
        return [({k: to_device(v, device) for k, v in (x if isinstance(x, dict) else {"input_ids": x}).items()},
                 to_device(y, device)) for x, y in mbs]

    # Each save declares itself convertible to a universal checkpoint (universal.py); DeepSpeed owns that key
    # under MoE (it refuses it in client_state) and under AutoTP (its own merge patterns), so not there.
    universal_state: dict[str, Any] = {}
    if not moe and layout.tp == 1:
        from lmforge.components.training.universal import universal_info

        universal_state = universal_info()
    loss_val = float("nan")
    straggle = straggler_delay(rank)
    state_mem: dict[str, int] | None = None  # model-state bytes: fixed once Adam's states exist (from step 2)
    state_mem_step = -1
    nxt = place(start) if start < cfg.max_steps else []
    window = ThroughputWindow()
    for step in range(start, cfg.max_steps):
        lr = float(engine.get_lr()[0])  # the scheduler's host value: no device sync
        micro, done = nxt, step + 1
        logging_step = done % cfg.log_every == 0 or done == cfg.max_steps or done == start + 1
        measure_mem = logging_step and state_mem_step < start + 2
        # DeepSpeed's 1F1B, on a step whose bubble is logged: the stages start and end its clock together, as
        # torch's schedules do (schedules.py). Unbounded, each stage timed from the end of its own optimizer step,
        # so the first stage's wait for the last one's first backward overlapped the last stage's previous step,
        # and the last stage's wait for the first one's final backward fell outside its step: 1F1B read below
        # (p-1)/m in every benchmark run (benchmarks/results/parallel.md).
        bounded = pp > 1 and not torch_pp and logging_step
        if bounded:
            comms.barrier()
        t0 = time.perf_counter()
        if pp > 1:
            held: dict[str, int] = {}
            if measure_mem and not torch_pp:
                measure_at_step(engine, held)
            loss = engine.train_batch(iter(micro)).detach().float()
            if bounded:
                comms.barrier()
            if measure_mem:
                state_mem, state_mem_step = held or model_state_bytes(engine), done
        else:
            total = torch.zeros((), device=device)
            if moe:
                moe.start_step(device)
            for i, (x, y) in enumerate(micro):
                out = engine(**x, use_cache=False)  # no cache: transformers reads packed rows from position_ids only then
                mb_loss = lm_loss(out.logits, y)  # logged as the loss; MoE's auxiliary loss is trained on, logged apart
                engine.backward(mb_loss + moe.loss_term() if moe else mb_loss)
                if measure_mem and i == len(micro) - 1:
                    # Measured between the last backward and the step: gradients are all alive here,
                    # which is the moment the ZeRO paper's model-state count describes.
                    state_mem, state_mem_step = model_state_bytes(engine), done
                engine.step()
                total += mb_loss.detach().float()
            loss = total / len(micro)
        step_s = time.perf_counter() - t0  # pipeline: before any collective, so the idle fraction is the schedule's own
        if straggle:
            time.sleep(straggle)  # a straggler on purpose (protocol.STRAGGLER_ENV, benchmarks/bench_ps.py)
        if done < cfg.max_steps:
            nxt = place(done)  # the next batch is built and copied while the device still works on this one
        window.add(step_tokens(step))
        if logging_step:
            loss_val = comms.mean(loss)  # the step's one host sync; steps between logs never wait for the device
            dt, tps = window.read()
            assert state_mem is not None
            idle_fraction = idle.idle_fraction(step_s) if idle is not None else 0.0
            mine = [state_mem["params"], state_mem["grads"], state_mem["optimizer"], state_mem["total"],
                    host_rss_bytes(), device_peak_bytes() or 0, idle_fraction, host_peak_rss_bytes(),
                    swap_bytes(swap, rank=rank)]
            per_rank = memory_rows(comms.gather_floats([float(v) for v in mine]))
            if pp > 1:  # the measured bubble beside the schedule's formula (components/training/schedules.py)
                from lmforge.components.training.schedules import bubble_event

                bubble = bubble_event(engine if torch_pp else None, per_rank, pp=pp, m=layout.accum, gather=comms.gather_objects)
            moe_fields = moe.event(comms.gather_floats) if moe else {}
            norm = None if torch_pp else engine.get_global_grad_norm()  # one value: reduced over the whole grid
            if rank == 0:
                emit_event(run_dir, {"step": done, "loss": loss_val, "lr": lr, "tokens_per_s": tps, "step_s": dt,
                                **({} if norm is None else {"grad_norm": float(norm)}),
                                "mfu": mfu(tokens_per_s=tps, flops_per_token=token_flops, peak_flops=peak),
                                "peak_flops": peak, "flops_per_token": token_flops,
                                "memory": per_rank, "attempt": req.attempt, "max_steps": cfg.max_steps, **moe_fields,
                                **({"bubble": bubble} if pp > 1 else {})})
        elif idle is not None:
            idle.idle_fraction(step_s)
        if done % cfg.save_every == 0 or done == cfg.max_steps:
            rngs = comms.gather_objects(rng_state())
            tag = ckpt.tag_for(done)
            # LoRA: the adapters and their optimizer states only; the frozen base is the init folder's.
            engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False, exclude_frozen_parameters=lora,
                                   client_state={"step": done, "data_position": done * layout.global_batch, "rng": rngs,
                                                 **universal_state})
            comms.barrier()
            if rank == 0:
                ckpt.mark_complete(ckpt_dir, tag, step=done, world_size=world, extra={"layout": layout.to_dict()})
                ckpt.prune(ckpt_dir, keep=cfg.keep_checkpoints)
            comms.barrier()
            window.restart()  # a save is not training time

    _export(engine, req, layout, tokenizer, cfg, windows, dtype, loss_val, peak, n_params)
    comms.barrier()
    if rank == 0 and swap is not None:
        shutil.rmtree(swap, ignore_errors=True)  # the run's NVMe swap files: the checkpoints hold what a resume needs
    # The final barrier is the last collective: run_rank (protocol.py) then ends the process without the
    # interpreter's teardown, whose native destructors aborted finished ranks in CI.
    return 0


def _export(engine: Any, req: RankRequest, layout: Layout, tokenizer: Any, cfg: Any, windows: Any,
            dtype: torch.dtype, final_loss: float, peak: float, n_params: int) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from lmforge.components.accelerator import to_device
    from lmforge.components.training.export import gather_hf_state, write_export
    from lmforge.components.training.model import model_config

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
            from lmforge.components.training.lora import ADAPTER_DIR, merge_adapters

            state = merge_adapters(state, cfg, run_dir / ADAPTER_DIR)
            extra[ADAPTER_DIR] = run_dir / ADAPTER_DIR
        meta = {**req.meta, "steps": cfg.max_steps, "final_loss": final_loss, "params": n_params,
                "dtype": str(dtype).removeprefix("torch."), "layout": layout.to_dict(), "peak_flops": peak}
        # A base's tokenizer is the dataset's (training refused any other): its files go into the export as they are.
        write_export(run_dir / "export", state, model_config(cfg.model, tokenizer, seq_len=cfg.seq_len, dtype=dtype),
                     tokenizer, dtype=dtype, meta=meta, tokenizer_dir=req.tokenizer if cfg.model.init else None, extra=extra)
        print(f"exported {run_dir / 'export'}", flush=True)


if __name__ == "__main__":
    run_rank(main)
