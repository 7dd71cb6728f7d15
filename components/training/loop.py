"""One rank's training loop around the engine assemble.py built (components/training/rank.py runs it).

    loop = Loop.open(s, comms, pipeline_clock(s), start=resume(s) if req.resume else 0)   # resume: rank.py
    for step in range(loop.start, cfg.max_steps):
        loss, step_s = train_step(s, loop, step, logged=loop.logged(s, step + 1))
        log_step(s, loop, ...)                  # on a logged step: one host sync, one gather, rank 0's event
        save_step(s, loop, step + 1)            # rank.py: every save_every steps and at the last

Only logged steps read anything back from the device (the loss, one gather of the memory figures); throughput is
taken over the steps since the last log. Importing this module imports DeepSpeed and transformers (through
model.py); rank.py imports it after reading the request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmforge.components.runtime.accelerator import to_device
from lmforge.components.training.assemble import RankState
from lmforge.components.training.collectives import DeviceCollectives, memory_rows
from lmforge.components.training.memory import device_peak_bytes, host_peak_rss_bytes, host_rss_bytes, model_state_bytes
from lmforge.components.training.model import flops_per_token, model_config
from lmforge.components.training.nvme import swap_bytes, swap_root
from lmforge.components.training.perf import ThroughputWindow, devices_in_job, mfu
from lmforge.components.training.pipeline_model import IdleClock, lm_loss
from lmforge.components.training.protocol import emit_event, straggler_delay


@dataclass
class Loop:
    """What the step loop carries from one step to the next on one rank."""

    comms: DeviceCollectives
    idle: Any                    # the pipeline's idle clock (IdleClock, or the torch engine's); None without a pipeline
    start: int                   # the first step this launch trains: 0, or the resumed checkpoint's step
    peak: float                  # the job's peak FLOP/s
    token_flops: float           # training FLOPs per token
    swap: Path | None            # ZeRO-Infinity's NVMe tier: this run's swap folder, or None
    universal_state: dict[str, Any]
    straggle: float              # seconds this rank sleeps each step (protocol.STRAGGLER_ENV)
    window: ThroughputWindow = field(default_factory=ThroughputWindow)
    nxt: list[tuple[Any, torch.Tensor]] = field(default_factory=list)   # the next step's micro-batches, on the device
    loss_val: float = float("nan")                                       # the last logged loss
    state_mem: dict[str, int] | None = None  # model-state bytes: fixed once Adam's states exist (from step 2)
    state_mem_step: int = -1

    @classmethod
    def open(cls, s: RankState, comms: DeviceCollectives, idle: Any, *, start: int) -> Loop:
        """The loop from `start`: the FLOP figures (rank 0 prints them with the model and layout), the first
        batch on the device, and the throughput window, which starts last."""
        cfg, hw = s.cfg, s.req.hardware
        # Measured (or looked up) once before the ranks started: see components/training/perf.py.
        peak = hw.peak_flops_per_device * devices_in_job(hw.device, s.world)
        token_flops = flops_per_token(cfg.model, model_config(cfg.model, s.tokenizer, seq_len=cfg.seq_len), seq_len=cfg.seq_len)
        if s.lora:
            token_flops *= 2 / 3  # a frozen weight gets no weight gradient: forward 2N + backward 2N, not 6N
        if s.rank == 0:
            print(f"model {s.n_params / 1e6:.2f}M params; layout {s.layout.model_dump_json()}; {hw.device} {hw.precision} "
                  f"({hw.precision_reason}); peak {peak / 1e9:.0f} GFLOP/s ({hw.peak_source}); "
                  f"compile {'on' if hw.compile else 'off'}", flush=True)
        return cls(comms=comms, idle=idle, start=start, peak=peak, token_flops=token_flops, swap=swap_root(s.req.ds_config),
                   universal_state=universal_state(s), straggle=straggler_delay(s.rank),
                   nxt=place(s, start) if start < cfg.max_steps else [])

    def logged(self, s: RankState, done: int) -> bool:
        """Whether the step that makes `done` steps is logged: every log_every, the last, and this launch's first."""
        return done % s.cfg.log_every == 0 or done == s.cfg.max_steps or done == self.start + 1


def pipeline_clock(s: RankState) -> Any:
    """The idle clock a pipeline's bubble is read from: the torch engine's own, or an IdleClock on DeepSpeed's 1f1b."""
    if s.layout.pp == 1:
        return None
    return s.engine.clock if s.torch_pp else IdleClock.attach(s.engine)


def universal_state(s: RankState) -> dict[str, Any]:
    """What each save adds to declare itself convertible to a universal checkpoint (universal.py). DeepSpeed owns that
    key under MoE (it refuses it in client_state) and under AutoTP (its own merge patterns), so not there."""
    if s.moe or s.layout.tp > 1:
        return {}
    from lmforge.components.training.universal import universal_info

    return universal_info()


def place(s: RankState, step: int) -> list[tuple[Any, torch.Tensor]]:
    """The step's micro-batches on the device: (model inputs, labels); the pipeline engine takes (ids, labels)."""
    layout, device = s.layout, s.engine.device
    mbs = s.windows.micro_batches(step, dp_rank=s.dp_rank, dp_size=s.dp_size, micro=layout.micro, accum=layout.accum)
    if layout.pp > 1:
        return [(to_device(x, device), to_device(y, device)) for x, y in mbs]
    return [({k: to_device(v, device) for k, v in (x if isinstance(x, dict) else {"input_ids": x}).items()},
             to_device(y, device)) for x, y in mbs]


def step_tokens(s: RankState, step: int) -> int:
    """Tokens the step trains on: every window's, or (SFT) the real examples' without padding."""
    if s.req.sft_batching is None:
        return s.layout.global_batch * s.cfg.seq_len
    return s.windows.real_tokens(step, dp_size=s.dp_size, micro=s.layout.micro, accum=s.layout.accum)


def train_step(s: RankState, loop: Loop, step: int, *, logged: bool) -> tuple[torch.Tensor, float]:
    """One optimizer step on loop.nxt, then the next step's batch onto the device while the device still works on
    this one: the step's mean loss (on the device, not read back) and its seconds. A step that is not logged still
    reads the pipeline's idle clock, which zeroes its counters for the next."""
    micro, done, pp = loop.nxt, step + 1, s.layout.pp
    measure_mem = logged and loop.state_mem_step < loop.start + 2
    # DeepSpeed's 1F1B, on a step whose bubble is logged: the stages start and end its clock together, as
    # torch's schedules do (schedules.py). Unbounded, each stage timed from the end of its own optimizer step,
    # so the first stage's wait for the last one's first backward overlapped the last stage's previous step,
    # and the last stage's wait for the first one's final backward fell outside its step: 1F1B read below
    # (p-1)/m in every benchmark run (benchmarks/results/parallel.md).
    bounded = pp > 1 and not s.torch_pp and logged
    if bounded:
        loop.comms.barrier()
    t0 = time.perf_counter()
    if pp > 1:
        loss = pipeline_step(s, loop, micro, done=done, measure_mem=measure_mem, bounded=bounded)
    else:
        loss = micro_batch_step(s, loop, micro, done=done, measure_mem=measure_mem)
    step_s = time.perf_counter() - t0  # pipeline: before any collective, so the idle fraction is the schedule's own
    if loop.straggle:
        time.sleep(loop.straggle)  # a straggler on purpose (protocol.STRAGGLER_ENV, benchmarks/bench_ps.py)
    if done < s.cfg.max_steps:
        loop.nxt = place(s, done)
    loop.window.add(step_tokens(s, step))
    if not logged and loop.idle is not None:
        loop.idle.idle_fraction(step_s)
    return loss, step_s


def pipeline_step(s: RankState, loop: Loop, micro: list[Any], *, done: int, measure_mem: bool, bounded: bool) -> torch.Tensor:
    """A pipeline engine's step (DeepSpeed's 1f1b or torch's schedules): train_batch over the micro-batches."""
    held: dict[str, int] = {}
    if measure_mem and not s.torch_pp:
        measure_at_step(s.engine, held)
    loss = s.engine.train_batch(iter(micro)).detach().float()
    if bounded:
        loop.comms.barrier()
    if measure_mem:
        loop.state_mem, loop.state_mem_step = held or model_state_bytes(s.engine), done
    return loss


def micro_batch_step(s: RankState, loop: Loop, micro: list[Any], *, done: int, measure_mem: bool) -> torch.Tensor:
    """Forward, backward and engine.step per micro-batch (DeepSpeed steps the optimizer at the last): the mean loss."""
    engine, moe = s.engine, s.moe
    total = torch.zeros((), device=engine.device)
    if moe:
        moe.start_step(engine.device)
    for i, (x, y) in enumerate(micro):
        out = engine(**x, use_cache=False)  # no cache: transformers reads packed rows from position_ids only then
        mb_loss = lm_loss(out.logits, y)  # logged as the loss; MoE's auxiliary loss is trained on, logged apart
        engine.backward(mb_loss + moe.loss_term() if moe else mb_loss)
        if measure_mem and i == len(micro) - 1:
            # Measured between the last backward and the step: gradients are all alive here,
            # which is the moment the ZeRO paper's model-state count describes.
            loop.state_mem, loop.state_mem_step = model_state_bytes(engine), done
        engine.step()
        total += mb_loss.detach().float()
    return total / len(micro)


def log_step(s: RankState, loop: Loop, *, done: int, lr: float, loss: torch.Tensor, step_s: float) -> None:
    """A logged step, on every rank: the step's one host sync (the loss), one gather of the memory figures, the
    pipeline's bubble and the MoE fields (collectives too); rank 0 emits the event (protocol.emit_event)."""
    comms, layout = loop.comms, s.layout
    loop.loss_val = comms.mean(loss)  # the step's one host sync; steps between logs never wait for the device
    dt, tps = loop.window.read()
    assert loop.state_mem is not None
    mem = loop.state_mem
    idle_fraction = loop.idle.idle_fraction(step_s) if loop.idle is not None else 0.0
    mine = [mem["params"], mem["grads"], mem["optimizer"], mem["total"], host_rss_bytes(), device_peak_bytes() or 0,
            idle_fraction, host_peak_rss_bytes(), swap_bytes(loop.swap, rank=s.rank)]
    per_rank = memory_rows(comms.gather_floats([float(v) for v in mine]))
    bubble: dict[str, Any] = {}
    if layout.pp > 1:  # the measured bubble beside the schedule's formula (components/training/schedules.py)
        from lmforge.components.training.schedules import bubble_event

        bubble = {"bubble": bubble_event(s.engine if s.torch_pp else None, per_rank, pp=layout.pp, m=layout.accum,
                                         gather=comms.gather_objects)}
    moe_fields = s.moe.event(comms.gather_floats) if s.moe else {}
    norm = None if s.torch_pp else s.engine.get_global_grad_norm()  # one value: reduced over the whole grid
    if s.rank == 0:
        emit_event(s.req.run_dir, {"step": done, "loss": loop.loss_val, "lr": lr, "tokens_per_s": tps, "step_s": dt,
                                   **({} if norm is None else {"grad_norm": float(norm)}),
                                   "mfu": mfu(tokens_per_s=tps, flops_per_token=loop.token_flops, peak_flops=loop.peak),
                                   "peak_flops": loop.peak, "flops_per_token": loop.token_flops,
                                   "memory": per_rank, "attempt": s.req.attempt, "max_steps": s.cfg.max_steps,
                                   **moe_fields, **bubble})


def measure_at_step(engine: Any, into: dict[str, int]) -> None:
    """Model-state bytes into `into` as DeepSpeed's pipeline engine begins its next optimizer step, when every
    gradient is alive (after it, they are freed): the moment the loop measures the other strategies at. Once."""
    take = engine._take_model_step

    def step(*args: Any, **kwargs: Any) -> Any:
        del engine._take_model_step  # the class's method again from the next step on
        into.update(model_state_bytes(engine))
        return take(*args, **kwargs)
    engine._take_model_step = step
