"""A pipeline schedule's bubble: its formula, a replay of its own action list, and what a step measured.

    bubble_formula("zero-bubble", p=2, v=2, m=8, t=ChunkTimes(f=1.0, i=1.0, w=1.0, b=2.0))   # 0.0
    simulate_bubble(schedule.pipeline_order, {(stage, "F"): 0.01, ...}, n_stages=4)          # idle / compute per rank
    clock = StageClock(); clock.add(0, "F", 0.01); clock.finish(schedule_s=0.05)             # one step, one rank
    bubble_report("dualpipev", [every rank's clock.last], p=2, v=2, m=8)                     # what is logged

Every figure is idle / compute, what the papers' formulas describe; `bubble_of_step` is idle / schedule time.
The engines that produce the measurements are components/training/schedules.py (torch's schedules, StageClock)
and pipeline_model.IdleClock (DeepSpeed's 1F1B, deepspeed_bubble_report).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

KINDS = ("F", "I", "W", "B")   # forward, input backward, weight backward, full backward


@dataclass(frozen=True)
class ChunkTimes:
    """Mean seconds per micro-batch per chunk: forward, input backward, weight backward, full backward (I + W)."""

    f: float
    i: float
    w: float
    b: float


FORMULAS = {
    "1f1b": "(p-1)/m",
    "interleaved-1f1b": "(p-1)/(v*m)",
    "zero-bubble": "((p-1)t_F + max(0, (p-1)(t_F+t_I-2t_W))) / (m*v*(t_F+t_I+t_W))  [ZB-H2 / ZB-V, Qi et al. 2023, "
                   "plus the warm-up ramp a synchronous optimizer step keeps]",
    "dualpipev": "max(0, (PP/2-1)(t_F&B+t_B-3t_W)) / (m*v*(t_F+t_B)), PP = p*v stages, t_F&B = t_F+t_B  "
                 "[DeepSeek-V3 report / DualPipe README]",
}


def bubble_formula(schedule: str, *, p: int, v: int, m: int, t: ChunkTimes | None = None) -> float:
    """The schedule's bubble as a fraction of a rank's compute (idle / compute), in per-chunk times.

    1F1B: (p-1)(t_F+t_B) idle against m(t_F+t_B) compute = (p-1)/m; interleaved: (p-1)/(v*m).
    Zero bubble (ZB-V): the ZB-H2 expression of Qi et al. 2023 with t_B the input backward,
    (p-1)(t_F+t_I-2t_W) floored at 0, plus the warm-up ramp (p-1)t_F, against m*v*(t_F+t_I+t_W).
    The paper's zero assumes its optimizer post-validation, which lets a step's ramp overlap the
    previous step's tail; its authors note (huggingface.co/spaces/sail/pipeline-parallelism-with-
    controllable-memory, "Optimizer Post Validation") that an all-reduce across the stages before the step
    (the global gradient norm for clipping, which lmforge takes) "makes zero bubble impossible":
    the last rank cannot start before (p-1) forwards, and with balanced ranks every rank then idles
    that long. With t_F = t_I = t_W this is (p-1)/(3*m*v), what torch's ZB-V action list gives
    (bubble_simulated) at p = 2, 3 and 4 (tested). DualPipeV (DeepSeek-V3 report,
    table 2, and the DualPipe README, where B is a full backward chunk and PP the stages of the
    V, p*v): (PP/2-1)(t_F&B+t_B-3t_W), floored at 0, against m*v*(t_F+t_B); on the CPU a rank
    runs the overlapped F and B of torch's OVERLAP_F_B one after the other, so t_F&B = t_F + t_B.
    """
    if schedule == "1f1b":
        return (p - 1) / m
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m)
    assert t is not None, "the zero-bubble and DualPipe formulas need the measured F/I/W times"
    if schedule == "zero-bubble":
        compute = m * v * (t.f + t.i + t.w)
        idle = (p - 1) * t.f + max(0.0, (p - 1) * (t.f + t.i - 2 * t.w))
        return idle / compute if compute > 0 else float("nan")
    if schedule == "dualpipev":
        compute = m * v * (t.f + t.b)
        stages = p * v
        return max(0.0, (stages / 2 - 1) * ((t.f + t.b) + t.b - 3 * t.w)) / compute if compute > 0 else float("nan")
    raise ValueError(f"unknown schedule {schedule!r}")


def _deps(action: Any, n_stages: int) -> list[tuple[int, str, int]]:
    s, kind, mb = action.stage_index, action.computation_type.value, action.microbatch_index
    if kind == "F":
        return [(s - 1, "F", mb)] if s > 0 else []
    if kind in ("I", "B"):
        out = [(s, "F", mb)]
        if s < n_stages - 1:
            out.append((s + 1, "IB", mb))
        return out
    if kind == "W":
        return [(s, "I", mb)]
    raise ValueError(f"unexpected action {action}")


def simulate_bubble(pipeline_order: dict[int, list[Any]], durations: dict[tuple[int, str], float], *, n_stages: int
                    ) -> dict[int, float]:
    """Idle / compute per rank when the schedule's own action list (compute-only `pipeline_order`, as torch's
    schedules build it) runs with these per-(stage, kind) durations and free communication."""
    done: dict[tuple[int, str, int], float] = {}
    flat: dict[int, list[Any]] = {}
    for rank, actions in pipeline_order.items():
        seq = []
        for a in actions:
            if a is None:
                continue
            subs = getattr(a, "sub_actions", None)
            seq.extend(subs if subs else [a])
        flat[rank] = seq
    pos = dict.fromkeys(flat, 0)
    free = dict.fromkeys(flat, 0.0)
    busy = dict.fromkeys(flat, 0.0)
    progressed = True
    while progressed:
        progressed = False
        for rank, seq in flat.items():
            while pos[rank] < len(seq):
                a = seq[pos[rank]]
                ready = 0.0
                for s, kind, mb in _deps(a, n_stages):
                    key = next(((s, k, mb) for k in (("I", "B") if kind == "IB" else (kind,)) if (s, k, mb) in done), None)
                    if key is None:
                        break
                    ready = max(ready, done[key])
                else:
                    kind = a.computation_type.value
                    dur = durations.get((a.stage_index, kind), 0.0)
                    start = max(free[rank], ready)
                    free[rank] = start + dur
                    busy[rank] += dur
                    done[(a.stage_index, kind, a.microbatch_index)] = free[rank]
                    pos[rank] += 1
                    progressed = True
                    continue
                break
    if any(pos[r] < len(flat[r]) for r in flat):
        raise RuntimeError("the schedule's actions wait on each other: it cannot run as written")
    end = max(free.values())
    return {r: (end - busy[r]) / busy[r] if busy[r] > 0 else float("nan") for r in flat}


@dataclass
class StageClock:
    """Seconds each local stage spent in F, I, W and B during the last step, and the step's schedule time."""

    sync_cuda: Any = None
    current: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    last: dict[str, Any] = field(default_factory=dict)

    def now(self) -> float:
        if self.sync_cuda is not None:
            self.sync_cuda()  # queued kernels finish first, else a call's time is its launch time (as IdleClock)
        return time.perf_counter()

    def add(self, stage: int, kind: str, seconds: float, *, count: bool = True) -> None:
        slot = self.current.setdefault((stage, kind), [0.0, 0])
        slot[0] += seconds
        slot[1] += int(count)

    def finish(self, schedule_s: float) -> None:
        compute = sum(v[0] for v in self.current.values())
        self.last = {"schedule_s": schedule_s, "compute_s": compute,
                     "stages": {f"{s}:{k}": list(v) for (s, k), v in sorted(self.current.items())}}
        self.current = {}

    def idle_fraction(self, step_seconds: float) -> float:
        """Idle / schedule time of the last step (IdleClock's quantity; the optimizer is outside both)."""
        del step_seconds  # the engine timed the schedule itself, without the optimizer step
        s, c = self.last.get("schedule_s", 0.0), self.last.get("compute_s", 0.0)
        return max(0.0, 1.0 - c / s) if s > 0 else 0.0


def chunk_times(stats: list[dict[str, Any]], *, m: int) -> ChunkTimes:
    """Per-chunk, per-micro-batch seconds from every rank's last step: t_f a forward, t_b a whole backward (a full B,
    or an I plus its W), and t_i, t_w one input and one weight backward where the schedule split them.

    t_i and t_w leave stage 0 out when another stage split its backward: torch runs stage 0's whole
    backward in its W (its input is token ids, with no gradient to compute), so there I is empty and
    W is a full backward, which says nothing about how a chunk's backward divides.
    """
    del m  # the counts say how many actions ran
    sums: dict[str, list[float]] = {k: [0.0, 0.0] for k in KINDS}
    split: dict[str, list[float]] = {k: [0.0, 0.0] for k in ("I", "W")}
    for rank_stats in stats:
        for key, (seconds, count) in rank_stats["stages"].items():
            stage, kind = key.split(":")
            sums[kind][0] += seconds
            sums[kind][1] += count
            if kind in split and int(stage) > 0:
                split[kind][0] += seconds
                split[kind][1] += count
    source = split if split["I"][1] and split["W"][1] else {k: sums[k] for k in ("I", "W")}

    def mean(pair: list[float]) -> float:
        return pair[0] / pair[1] if pair[1] else 0.0

    backwards = sums["B"][1] + sums["I"][1]
    b = (sums["B"][0] + sums["I"][0] + sums["W"][0]) / backwards if backwards else 0.0
    return ChunkTimes(f=mean(sums["F"]), i=mean(source["I"]), w=mean(source["W"]), b=b)


def bubble_report(schedule: str, stats: list[dict[str, Any]], *, p: int, v: int, m: int,
                  pipeline_order: dict[int, list[Any]] | None = None) -> dict[str, Any]:
    """The logged bubble of one step from every rank's StageClock.last (gathered, in global rank order)."""
    per_rank = [(s["schedule_s"] - s["compute_s"]) / s["compute_s"] if s["compute_s"] > 0 else float("nan") for s in stats]
    of_step = [max(0.0, s["schedule_s"] - s["compute_s"]) / s["schedule_s"] if s["schedule_s"] > 0 else 0.0 for s in stats]
    t = chunk_times(stats, m=m)
    out: dict[str, Any] = {
        "schedule": schedule, "p": p, "v": v, "m": m,
        "bubble": sum(per_rank) / len(per_rank), "bubble_of_step": sum(of_step) / len(of_step),
        "bubble_per_rank": per_rank, "bubble_formula": bubble_formula(schedule, p=p, v=v, m=m, t=t),
        "formula": FORMULAS[schedule], "t_f": t.f, "t_i": t.i, "t_w": t.w, "t_b": t.b,
    }
    if pipeline_order is not None:
        durations: dict[tuple[int, str], float] = {}
        for rank_stats in stats:
            for key, (seconds, count) in rank_stats["stages"].items():
                stage, kind = key.split(":")
                durations[(int(stage), kind)] = seconds / max(1, count)
        sim = simulate_bubble(pipeline_order, durations, n_stages=p * v)
        out["bubble_simulated"] = sum(sim.values()) / len(sim)
    return out


def deepspeed_bubble_report(idle_fractions: list[float], *, p: int, m: int) -> dict[str, Any]:
    """The 1f1b (DeepSpeed engine) bubble from each rank's IdleClock idle fraction f = idle / schedule time:
    idle / compute = f / (1 - f)."""
    per_rank = [f / (1 - f) if f < 1 else float("inf") for f in idle_fractions]
    return {"schedule": "1f1b", "p": p, "v": 1, "m": m, "bubble": sum(per_rank) / len(per_rank),
            "bubble_of_step": sum(idle_fractions) / len(idle_fractions), "bubble_per_rank": per_rank,
            "bubble_formula": bubble_formula("1f1b", p=p, v=1, m=m), "formula": FORMULAS["1f1b"]}
