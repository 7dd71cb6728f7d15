"""Pipeline schedules past 1F1B on torch.distributed.pipelining: interleaved 1F1B, zero bubble (ZB-V), DualPipeV.

    rule = schedule_rule("dualpipev", stages=2, virtual_stages=2, micro_batches=8, blocks=6)  # None, or (key, value, rule, fix)
    engine = build_engine(model, request, windows)    # on each rank (components/training/rank.py), a RankRequest
    loss = engine.train_batch(iter(micro_batches))    # one optimizer step over m (input_ids, labels) micro-batches
    engine.clock.last                                 # this step's F/I/W/B seconds per local stage
    report = engine.bubble(every_ranks_clock_last)    # measured bubble, its formula, the action-list replay

The model is cut into the same blocks as DeepSpeed's pipeline (pipeline_model.pipeline_layers:
EmbedBlock, DecoderBlock..., NormHeadBlock), so the weights are exactly the other strategies'.
The block sequence is split into p x v contiguous chunks by measured cost (`measure_block_costs`
on rank 0, broadcast, then `partition_by_cost` minimises the slowest chunk); each rank holds v
chunks, placed in a loop (stage s on rank s mod p: interleaved 1F1B) or a V (rank r holds
stages r and 2p-1-r: ZB-V and DualPipeV). "zero-bubble" runs ScheduleZBVZeroBubble rather than
ScheduleInterleavedZeroBubble: with the V placement its last stage shares a rank with the first,
two of the four chunk boundaries are local hand-offs instead of point-to-point messages, and
it is the paper's schedule whose bubble reaches zero at 1F1B's activation memory (ZB-H2 needs
about twice that).

The optimizer step is the DeepSpeed path's: torch AdamW with the same hyperparameters,
DeepSpeed's WarmupCosineLR for the same learning-rate curve, gradients averaged over the
micro-batches (the schedule scales them by 1/m) and over the data-parallel group, then clipped
by the global norm across stages (one all-reduce of the squared norms over the pipeline group).

Bubble: every stage's forward, input-backward, weight-backward and full-backward calls are
timed (TimedStage); idle = the schedule's wall time, from a barrier over the pipeline group to one
after the last stage is done, minus that compute. `bubble_report` (components/training/bubble.py) gives
idle / compute (what the formulas describe) and idle / schedule time, beside the schedule's
formula evaluated with the measured per-chunk times (see `bubble_formula`) and beside the bubble
the schedule's own action list gives with those times and free communication (`simulate_bubble`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.components.training.bubble import StageClock, bubble_report, deepspeed_bubble_report
from lmforge.components.training.partition import (
    describe_partition,
    measure_block_costs,
    partition_by_cost,
    stage_to_rank,
)

SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev")
# schedule -> (torch class, stage placement)
TORCH_SCHEDULES = {"interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop"),
                   "zero-bubble": ("ScheduleZBVZeroBubble", "v"),
                   "dualpipev": ("ScheduleDualPipeV", "v")}
PARTITION_FILE = "pipeline_partition.json"


# ---------------------------------------------------------------------------------------------------------------------
# Before launch: each schedule's rules (read in torch/distributed/pipelining/schedules.py, torch 2.13)
# ---------------------------------------------------------------------------------------------------------------------

def schedule_rule(schedule: str, *, stages: int, virtual_stages: int, micro_batches: int, blocks: int
                  ) -> tuple[str, Any, str, str] | None:
    """The first rule the schedule's settings break, as (key, value, rule, fix); None when they keep them all.

    `blocks` is the pipeline's block count (embedding + decoder layers + norm/head), which the
    p x v chunks must each get at least one of.
    """
    key_v, key_m = "training.parallel.pipeline.virtual_stages", "training.parallel.pipeline.micro_batches"
    p, v, m = stages, virtual_stages, micro_batches
    if schedule == "1f1b":
        if v != 1:
            return (key_v, v, "the 1f1b schedule (DeepSpeed's PipelineEngine) holds one chunk per rank",
                    "Set virtual_stages = 1, or schedule = \"interleaved-1f1b\" for several chunks per rank")
        return None
    if schedule == "interleaved-1f1b":
        if v < 2:
            return (key_v, v, "interleaved 1F1B holds at least 2 chunks per rank (with 1 it is plain 1F1B)",
                    "Set virtual_stages = 2 or more, or schedule = \"1f1b\"")
        rounds = max(1, m // p)
        if m % rounds:
            return (key_m, m, f"interleaved 1F1B runs the micro-batches in rounds of p: m must be a multiple of "
                              f"max(1, m // p) = {rounds} (torch's ScheduleInterleaved1F1B)",
                    f"Use a multiple of {p} micro-batches (or fewer than {2 * p})")
    if schedule in ("zero-bubble", "dualpipev") and v != 2:
        name = "ZB-V (ScheduleZBVZeroBubble)" if schedule == "zero-bubble" else "DualPipeV (ScheduleDualPipeV)"
        return (key_v, v, f"{name} places exactly 2 chunks per rank, in a V", "Set virtual_stages = 2")
    if schedule == "dualpipev" and m < p * v:
        return (key_m, m, f"DualPipeV needs at least as many micro-batches as stages (p x v = {p * v})",
                f"Use at least {p * v} micro-batches")
    if p * v > blocks:
        return ("training.parallel.pipeline.virtual_stages", v,
                f"p x v = {p * v} chunks, and the model has {blocks} blocks (embedding, decoder layers, head) to share out",
                f"Use fewer stages or virtual_stages, or more layers (at most {blocks} chunks)")
    return None


# ---------------------------------------------------------------------------------------------------------------------
# The engine: what rank.py asks of DeepSpeed's PipelineEngine, on torch's schedules
# ---------------------------------------------------------------------------------------------------------------------

class RankChunks:
    """This rank's chunks, read the way hf_export.py reads a DeepSpeed PipelineModule (`forward_funcs`)."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks

    @property
    def forward_funcs(self) -> list[Any]:
        return [block for chunk in self.chunks for block in chunk]

    def parameters(self) -> Any:
        for chunk in self.chunks:
            yield from chunk.parameters()


@dataclass(frozen=True)
class Grid:
    """The data-parallel coordinates rank.py reads from a DeepSpeed engine's `grid`."""

    dp_rank: int
    dp_size: int
    pp_rank: int

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size


def _timed_stage_class() -> Any:
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """A PipelineStage whose forward and backward calls add their seconds to a StageClock."""

        clock: StageClock

        def _timed(self, kind: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = self.clock.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.clock.add(self.stage_index, kind, self.clock.now() - t0)

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("F", super().forward_one_chunk, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                               last_backward: bool = False) -> Any:
            return self._timed("B" if full_backward else "I", super().backward_one_chunk, bwd_chunk_id, loss=loss,
                               full_backward=full_backward, last_backward=last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> Any:
            return self._timed("W", super().backward_weight_one_chunk, bwd_chunk_id, last_backward=last_backward)

    return TimedStage


class TorchPipelineEngine:
    """p x v chunks on torch's pipeline schedules, with the DeepSpeed engine's interface where rank.py uses it:
    train_batch, get_lr, save_checkpoint, load_checkpoint, module, optimizer, device, grid."""

    def __init__(self, *, schedule_name: str, chunks: list[Any], stage_ids: list[int], schedule: Any, optimizer: Any,
                 lr_scheduler: Any, device: Any, grid: Grid, pp_group: Any, dp_group: Any, clock: StageClock,
                 grad_clip: float, partition: dict[str, Any]) -> None:
        self.schedule_name, self.stage_ids, self.schedule = schedule_name, stage_ids, schedule
        self.module = RankChunks(chunks)
        self.optimizer, self.lr_scheduler, self.device, self.grid = optimizer, lr_scheduler, device, grid
        self.pp_group, self.dp_group, self.clock, self.grad_clip = pp_group, dp_group, clock, grad_clip
        self.partition = partition
        self.holds_last = partition["stages"] - 1 in stage_ids

    # -- construction ------------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, model: Any, *, schedule_name: str, pp: int, virtual_stages: int, micro_batches: int,
              ds_config: dict[str, Any], grad_clip: float, device: Any, sample: tuple[Any, Any],
              resume_partition: dict[str, Any] | None = None, log: Any = print) -> "TorchPipelineEngine":
        import torch
        import torch.distributed as dist
        from deepspeed.runtime.lr_schedules import WarmupCosineLR
        from torch.distributed import pipelining

        from lmforge.components.training.pipeline_model import lm_loss, pipeline_layers

        rank, world = dist.get_rank(), dist.get_world_size()
        dp = world // pp
        # DeepSpeed's PipeDataParallelTopology order: the data-parallel coordinate varies fastest.
        pp_rank, dp_rank = rank // dp, rank % dp
        pp_groups = [dist.new_group([s * dp + d for s in range(pp)]) for d in range(dp)]
        dp_groups = [dist.new_group([s * dp + d for d in range(dp)]) for s in range(pp)]
        pp_group, dp_group = pp_groups[dp_rank], dp_groups[pp_rank]
        class_name, placement = TORCH_SCHEDULES[schedule_name]
        n_stages = pp * virtual_stages

        blocks = pipeline_layers(model)
        names = [type(b).__name__ for b in blocks]
        if resume_partition is not None:
            partition = resume_partition
            if partition["stages"] != n_stages or partition["schedule"] != schedule_name:
                from lmforge.components.errors import UserError

                raise UserError("--resume", partition, f"was saved as {partition['stages']} chunks of "
                                f"{partition['schedule']}, this run asks for {n_stages} of {schedule_name}",
                                "Resume with the same training.parallel.pipeline settings")
        else:
            costs: list[Any] = [None]
            if rank == 0:
                for b in blocks:
                    b.to(device)
                costs = [measure_block_costs(blocks, sample[0].to(device), sample[1].to(device))]
            dist.broadcast_object_list(costs, src=0)  # one partition for every rank, measured once
            bounds = partition_by_cost(costs[0], n_stages)
            partition = {"schedule": schedule_name, "stages": n_stages, "bounds": bounds, "costs_s": costs[0],
                         "blocks": names, "placement": placement}
        if rank == 0:
            log(f"pipeline partition ({schedule_name}, {pp} ranks x {virtual_stages} chunks, by measured forward+backward "
                f"cost{' (from the checkpoint)' if resume_partition else ''}):\n"
                + describe_partition(partition["bounds"], partition["costs_s"], names, p=pp, placement=placement))

        bounds = partition["bounds"]
        stage_ids = [s for s in range(n_stages) if stage_to_rank(s, p=pp, placement=placement) == pp_rank]
        chunks = [torch.nn.Sequential(*blocks[bounds[s]:bounds[s + 1]]).to(device) for s in stage_ids]
        clock = StageClock(sync_cuda=(lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda"
                           else None)
        timed = _timed_stage_class()
        stages = []
        for s, chunk in zip(stage_ids, chunks, strict=True):
            stage = timed(chunk, s, n_stages, torch.device(device), group=pp_group)
            stage.clock = clock
            stages.append(stage)

        def loss_fn(logits: Any, labels: Any) -> Any:
            t0 = clock.now()
            try:
                return lm_loss(logits, labels)
            finally:
                # the loss is part of the last stage's forward work (timed, not a forward of its own)
                clock.add(n_stages - 1, "F", clock.now() - t0, count=False)

        schedule = getattr(pipelining, class_name)(stages, n_microbatches=micro_batches, loss_fn=loss_fn,
                                                   scale_grads=True)
        send_after_each_half(schedule)
        opt_params = {k: v for k, v in ds_config["optimizer"]["params"].items() if k not in ("torch_adam",)}
        params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, **opt_params)
        lr_scheduler = WarmupCosineLR(optimizer, **ds_config["scheduler"]["params"])
        return cls(schedule_name=schedule_name, chunks=chunks, stage_ids=stage_ids, schedule=schedule,
                   optimizer=optimizer, lr_scheduler=lr_scheduler, device=torch.device(device),
                   grid=Grid(dp_rank=dp_rank, dp_size=dp, pp_rank=pp_rank), pp_group=pp_group, dp_group=dp_group,
                   clock=clock, grad_clip=grad_clip, partition=partition)

    # -- one step ------------------------------------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def train_batch(self, data_iter: Any) -> Any:
        """One optimizer step over the iterator's (input_ids, labels) micro-batches; the mean loss on every rank."""
        import torch
        import torch.distributed as dist

        micro = list(data_iter)
        x = torch.cat([a for a, _ in micro])
        y = torch.cat([b for _, b in micro])
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[Any] = []
        # The schedule's time is the pipeline's: every stage starts it together (one stage's optimizer step is no
        # bubble of another's) and it ends when the last stage is done (a stage that finishes early idles till then,
        # as the formulas count it; without the barrier that wait would hide in the clipping's all-reduce).
        dist.barrier(group=self.pp_group)
        t0 = self.clock.now()
        self.schedule.step(x, target=y, losses=losses, return_outputs=False)  # the losses only: no merged logits kept
        dist.barrier(group=self.pp_group)
        self.clock.finish(self.clock.now() - t0)
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.grid.dp_size > 1:  # one all-reduce of every gradient, flattened, then averaged back in place
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=self.dp_group)
            flat.div_(self.grid.dp_size)
            for p, g in zip(params, flat.split([p.grad.numel() for p in params]), strict=True):
                p.grad.copy_(g.view_as(p.grad))
        if self.grad_clip > 0:
            sq = torch.stack([p.grad.detach().float().pow(2).sum() for p in params]).sum().reshape(1)
            dist.all_reduce(sq, group=self.pp_group)  # the global norm: every stage's squares
            norm = sq.sqrt()
            coef = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)  # DeepSpeed's clip_grad_norm_
            for p in params:
                p.grad.mul_(coef.to(p.grad.dtype))
        self.optimizer.step()
        self.lr_scheduler.step()
        mine = (torch.stack([t.detach().float() for t in losses]).mean() if self.holds_last
                else torch.zeros((), device=self.device))
        loss = mine.reshape(1).clone()
        dist.all_reduce(loss, group=self.pp_group)  # the last stage's loss, on every stage of this replica
        return loss[0]

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def _file(self, folder: Path) -> Path:
        return folder / f"pp{self.grid.pp_rank:02d}_dp{self.grid.dp_rank:02d}.pt"

    def save_checkpoint(self, save_dir: str, *, tag: str, save_latest: bool = False, exclude_frozen_parameters: bool = False,
                        client_state: dict[str, Any] | None = None) -> None:
        """Every rank writes its chunks, optimizer and scheduler states; rank 0 also the partition (checkpoint.py
        marks the folder complete after the barrier, as for DeepSpeed)."""
        import torch
        import torch.distributed as dist

        del save_latest, exclude_frozen_parameters
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        state = {"chunks": {s: c.state_dict() for s, c in zip(self.stage_ids, self.module.chunks, strict=True)},
                 "optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict(),
                 "client_state": client_state or {}}
        path = self._file(folder)
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(path)
        if dist.get_rank() == 0:
            from lmforge.components.workspace import atomic_write_json

            atomic_write_json(folder / PARTITION_FILE, self.partition)

    def load_checkpoint(self, load_dir: str, *, tag: str, load_module_strict: bool = True) -> tuple[str, dict[str, Any]]:
        import torch

        folder = Path(load_dir) / tag
        state = torch.load(self._file(folder), map_location=self.device, weights_only=False)
        for s, chunk in zip(self.stage_ids, self.module.chunks, strict=True):
            chunk.load_state_dict(state["chunks"][s], strict=load_module_strict)
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        return str(folder), state["client_state"]

    def bubble(self, stats: list[dict[str, Any]]) -> dict[str, Any]:
        """This schedule's bubble report from every rank's clock (rank order), with the action-list simulation."""
        p = self.partition["stages"] // len(self.stage_ids)
        return bubble_report(self.schedule_name, stats, p=p, v=len(self.stage_ids), m=self.schedule._n_microbatches,
                             pipeline_order=self.schedule.pipeline_order if self.grid.dp_size == 1 else None)


def send_after_each_half(schedule: Any) -> None:
    """Lower an action list whose OVERLAP_F_B pairs (DualPipeV's) run one half after the other, as torch's runtime
    runs them, so that a forward's output is sent when the forward ends rather than after the paired backward.

    torch's `_add_send_recv` places a pair's sends after the whole pair, and its runtime runs the pair's
    sub-actions in turn (true overlap needs a function registered for OVERLAP_F_B, which lmforge does
    not register), so the next stage waited a whole backward longer for each of those forwards. The
    compute order is unchanged, and with it every number; only the sends move earlier. A no-op for a
    schedule without pairs.
    """
    order = getattr(schedule, "pipeline_order", None)
    if not order or not any(a is not None and a.sub_actions for actions in order.values() for a in actions):
        return
    flat = {rank: [sub for a in actions if a is not None for sub in (a.sub_actions or (a,))]
            for rank, actions in order.items()}
    schedule._prepare_schedule_with_comms(flat)  # torch's own lowering (send/recv placement) of the flat list


def saved_partition(folder: Path) -> dict[str, Any] | None:
    """The partition a torch-schedule checkpoint was trained with (None for a DeepSpeed checkpoint)."""
    path = Path(folder) / PARTITION_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def build_engine(model: Any, req: Any, windows: Any, *, log: Any = print) -> TorchPipelineEngine:
    """The rank's engine for a torch schedule, from its RankRequest (protocol.py): the partition is measured on one
    micro-batch of step 0, or read back from the checkpoint a resume starts from."""
    import os

    import torch

    from lmforge.components.training import checkpoint as ckpt

    cfg, layout = req.training, req.layout
    pipe = cfg.parallel.pipeline
    cuda = req.hardware.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    resume_partition = None
    if req.resume:
        _, folder = ckpt.latest_complete(req.run_dir / "checkpoints")
        resume_partition = saved_partition(folder)
        if resume_partition is None:
            from lmforge.components.errors import UserError

            raise UserError("--resume", folder, f"was saved by DeepSpeed's 1f1b engine, and this run asks for the "
                                                f"{pipe.schedule} schedule", "Resume with schedule = \"1f1b\"")
    sample = windows.micro_batches(0, dp_rank=0, dp_size=1, micro=layout.micro, accum=1)[0]
    return TorchPipelineEngine.build(model, schedule_name=pipe.schedule, pp=layout.pp, virtual_stages=pipe.virtual_stages,
                                     micro_batches=layout.accum, ds_config=req.ds_config, grad_clip=cfg.grad_clip,
                                     device=device, sample=sample, resume_partition=resume_partition, log=log)


def bubble_event(engine: TorchPipelineEngine | None, per_rank_memory: list[dict[str, Any]], *, pp: int, m: int,
                 gather: Any) -> dict[str, Any]:
    """The `bubble` field of a logged step (every rank calls it: `gather` is a collective for the torch schedules).
    `engine` None = DeepSpeed's 1f1b engine, whose IdleClock idle fractions are in the gathered memory rows."""
    if engine is None:
        return deepspeed_bubble_report([r["idle_fraction"] for r in per_rank_memory], p=pp, m=m)
    return engine.bubble(gather(engine.clock.last))
