"""Pipeline schedules without processes: each schedule's rules against torch's own, the cost partitioner,
the bubble formulas, and the bubble of torch's action lists with given times (components/training/schedules.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from lmforge.components.errors import UserError
from lmforge.components.training.bubble import (
    ChunkTimes,
    StageClock,
    bubble_formula,
    bubble_report,
    deepspeed_bubble_report,
    simulate_bubble,
)
from lmforge.components.training.partition import partition_by_cost, stage_to_rank
from lmforge.components.training.schedules import TORCH_SCHEDULES, schedule_rule
from tests.integration.train_support import tiny_training


def torch_order(schedule: str, *, p: int, v: int, m: int) -> dict[int, list]:
    """The compute-only action list torch's schedule class builds (its constructor's own checks apply)."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    cls = getattr(pipelining, TORCH_SCHEDULES[schedule][0])
    return dict(enumerate(get_schedule_ops(cls, p, m, num_stages_per_rank=v)))


@pytest.mark.parametrize("schedule", list(TORCH_SCHEDULES))
@pytest.mark.parametrize("p, v, m", list(itertools.product([2, 3, 4], [2, 3], [1, 2, 3, 4, 5, 6, 8])))
def test_our_rules_accept_exactly_what_torchs_schedules_accept(schedule, p, v, m):
    ours = schedule_rule(schedule, stages=p, virtual_stages=v, micro_batches=m, blocks=100)
    try:
        torch_order(schedule, p=p, v=v, m=m)
        theirs = None
    except (ValueError, AssertionError) as e:
        theirs = str(e)
    assert (ours is None) == (theirs is None), (ours, theirs)


@pytest.mark.parametrize("schedule, v, m, blocks, key, words", [
    ("1f1b", 2, 4, 6, "virtual_stages", "one chunk per rank"),
    ("interleaved-1f1b", 1, 4, 6, "virtual_stages", "at least 2 chunks"),
    ("interleaved-1f1b", 2, 5, 6, "micro_batches", "multiple of max(1, m // p) = 2"),
    ("zero-bubble", 3, 4, 8, "virtual_stages", "exactly 2 chunks per rank"),
    ("dualpipev", 2, 3, 6, "micro_batches", "at least as many micro-batches as stages (p x v = 4)"),
    ("zero-bubble", 2, 4, 3, "virtual_stages", "4 chunks, and the model has 3 blocks"),
])
def test_a_broken_rule_is_named_with_its_fix(schedule, v, m, blocks, key, words):
    rule = schedule_rule(schedule, stages=2, virtual_stages=v, micro_batches=m, blocks=blocks)
    assert rule is not None
    got_key, _, text, fix = rule
    assert got_key.endswith(key) and words in text and fix


@pytest.mark.parametrize("overrides, key, words", [
    ({"parallel": {"strategy": "zero1", "pipeline": {"stages": 2, "schedule": "zero-bubble", "virtual_stages": 2}}},
     "training.parallel.strategy", "with ddp"),
    ({"precision": "bf16", "parallel": {"strategy": "ddp", "pipeline": {"stages": 2, "schedule": "dualpipev",
                                                                         "virtual_stages": 2, "micro_batches": 4}}},
     "training.precision", "not yet"),
    ({"parallel": {"strategy": "ddp", "pipeline": {"stages": 1, "schedule": "zero-bubble", "virtual_stages": 2}}},
     "training.parallel.pipeline.schedule", "stages = 1"),
    ({"parallel": {"strategy": "ddp", "pipeline": {"stages": 2, "schedule": "dualpipev", "virtual_stages": 2,
                                                   "micro_batches": 2}}},
     "training.parallel.pipeline.micro_batches", "DualPipeV"),
])
def test_check_layout_refuses_before_launch(overrides, key, words):
    from lmforge.components.training.layout import check_layout

    cfg = tiny_training(model={"num_layers": 4}, **overrides)
    with pytest.raises(UserError) as e:
        check_layout(cfg, vocab_size=512, world_size=2, bf16_supported=False)
    assert e.value.what == key and words in e.value.problem, e.value


def test_check_layout_accepts_each_schedule_at_2_stages_by_2():
    from lmforge.components.training.layout import check_layout

    for schedule in TORCH_SCHEDULES:
        cfg = tiny_training(precision="fp32", model={"num_layers": 4}, parallel={"strategy": "ddp", "pipeline": {
            "stages": 2, "schedule": schedule, "virtual_stages": 2, "micro_batches": 4}})
        layout = check_layout(cfg, vocab_size=512, world_size=2, bf16_supported=False)
        assert (layout.pp, layout.dp, layout.accum) == (2, 1, 4)


def _brute_force(costs: list[float], parts: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_partition_minimises_the_slowest_chunk():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
        bounds = partition_by_cost(costs, parts)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == parts + 1
        assert all(a < b for a, b in itertools.pairwise(bounds)), bounds       # every chunk non-empty
        slowest = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        assert slowest == pytest.approx(_brute_force(costs, parts))


def test_partition_by_cost_is_not_by_count():
    # A cheap embedding, four equal layers and a head as dear as two layers: 3 + 3 blocks would put
    # 2 layers + head (4.0) on one side; by cost the head's side takes one layer fewer.
    costs = [0.1, 1.0, 1.0, 1.0, 1.0, 2.0]
    assert partition_by_cost(costs, 2) == [0, 4, 6]
    with pytest.raises(ValueError):
        partition_by_cost(costs, 7)


def test_placement_loop_and_v():
    assert [stage_to_rank(s, p=2, placement="loop") for s in range(4)] == [0, 1, 0, 1]
    assert [stage_to_rank(s, p=2, placement="v") for s in range(4)] == [0, 1, 1, 0]
    assert [stage_to_rank(s, p=3, placement="v") for s in range(6)] == [0, 1, 2, 2, 1, 0]


def test_formulas():
    assert bubble_formula("1f1b", p=2, v=1, m=8) == pytest.approx(1 / 8)
    assert bubble_formula("interleaved-1f1b", p=4, v=2, m=8) == pytest.approx(3 / 16)
    equal = ChunkTimes(f=1.0, i=1.0, w=1.0, b=2.0)
    # ZB-V: the paper's 0 at T_F = T_B = T_W, plus the (p-1) t_F warm-up ramp of a synchronous step
    assert bubble_formula("zero-bubble", p=2, v=2, m=4, t=equal) == pytest.approx(1.0 / (4 * 2 * 3.0))
    slow_w = ChunkTimes(f=1.0, i=2.0, w=0.5, b=2.5)
    assert bubble_formula("zero-bubble", p=2, v=2, m=4, t=slow_w) == pytest.approx((1.0 + (1.0 + 2.0 - 1.0)) / (4 * 2 * 3.5))
    # DualPipeV at p = 2 (PP = 4 stages): (4/2 - 1)(F&B + B - 3W) / (m v (F + B)), F&B = F + B on the CPU
    assert bubble_formula("dualpipev", p=2, v=2, m=4, t=equal) == pytest.approx((3.0 + 2.0 - 3.0) / (4 * 2 * 3.0))
    assert bubble_formula("dualpipev", p=2, v=2, m=4, t=ChunkTimes(f=0.1, i=0.1, w=1.0, b=1.1)) == 0.0   # floor 0


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (2, 3, 6)])
def test_interleaved_action_list_with_equal_times_gives_its_formula(p, v, m):
    order = torch_order("interleaved-1f1b", p=p, v=v, m=m)
    durations = {(s, k): 1.0 for s in range(p * v) for k in ("F", "B")}
    sim = simulate_bubble(order, durations, n_stages=p * v)
    assert max(sim.values()) == pytest.approx(bubble_formula("interleaved-1f1b", p=p, v=v, m=m))


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_zbv_action_list_with_equal_f_i_w_gives_the_synchronous_formula(p, m):
    """torch's ZB-V idles exactly the warm-up ramp, (p-1) forwards per rank, when F, I and W take equal time."""
    durations = {(s, k): 1.0 for s in range(2 * p) for k in ("F", "I", "W")}
    sim = simulate_bubble(torch_order("zero-bubble", p=p, v=2, m=m), durations, n_stages=2 * p)
    expected = bubble_formula("zero-bubble", p=p, v=2, m=m, t=ChunkTimes(f=1.0, i=1.0, w=1.0, b=2.0))
    assert expected == pytest.approx((p - 1) / (3 * m * 2))
    assert sim == pytest.approx(dict.fromkeys(range(p), expected))


def test_zbv_action_list_with_equal_f_i_w_is_near_zero_and_below_interleaved():
    durations = {(s, k): 1.0 for s in range(4) for k in ("F", "I", "W")}
    zbv = simulate_bubble(torch_order("zero-bubble", p=2, v=2, m=8), durations, n_stages=4)
    full = {(s, k): (2.0 if k == "B" else 1.0) for s in range(4) for k in ("F", "B")}
    inter = simulate_bubble(torch_order("interleaved-1f1b", p=2, v=2, m=8), full, n_stages=4)
    assert sum(zbv.values()) / 2 < sum(inter.values()) / 2
    assert max(zbv.values()) < 0.1


def test_bubble_report_from_clocks():
    stats = [{"schedule_s": 1.5, "compute_s": 1.0, "stages": {"0:F": [0.2, 4], "0:I": [0.2, 4], "0:W": [0.1, 4],
                                                              "3:F": [0.2, 4], "3:I": [0.2, 4], "3:W": [0.1, 4]}},
             {"schedule_s": 1.5, "compute_s": 1.25, "stages": {"1:F": [0.25, 4], "1:I": [0.25, 4], "1:W": [0.125, 4],
                                                               "2:F": [0.25, 4], "2:I": [0.25, 4], "2:W": [0.125, 4]}}]
    rep = bubble_report("zero-bubble", stats, p=2, v=2, m=4)
    assert rep["bubble_per_rank"] == pytest.approx([0.5, 0.2])
    assert rep["bubble"] == pytest.approx(0.35) and rep["bubble_of_step"] == pytest.approx((0.5 / 1.5 + 0.25 / 1.5) / 2)
    assert rep["t_f"] == pytest.approx(0.9 / 16) and rep["t_b"] == pytest.approx((0.9 + 0.45) / 16)
    ds = deepspeed_bubble_report([0.2, 0.5], p=2, m=4)
    assert ds["bubble_per_rank"] == pytest.approx([0.25, 1.0]) and ds["bubble_formula"] == pytest.approx(0.25)


def test_stage_clock_idle_fraction_is_of_the_schedule_time():
    clock = StageClock()
    clock.add(0, "F", 0.3)
    clock.add(0, "B", 0.3)
    clock.finish(schedule_s=1.0)
    assert clock.idle_fraction(5.0) == pytest.approx(0.4)
    assert clock.last["stages"] == {"0:B": [0.3, 1], "0:F": [0.3, 1]} and clock.current == {}


def test_chunk_times_leave_out_stage_0s_unsplit_backward():
    from lmforge.components.training.bubble import chunk_times

    # Stage 0's I is empty and its W a whole backward (torch's first stage); stage 1 splits 2 + 1.
    stats = [{"schedule_s": 1.0, "compute_s": 0.0, "stages": {"0:F": [4.0, 4], "0:I": [0.0, 4], "0:W": [12.0, 4],
                                                              "1:F": [4.0, 4], "1:I": [8.0, 4], "1:W": [4.0, 4],
                                                              "2:F": [2.0, 2], "2:B": [6.0, 2]}}]
    t = chunk_times(stats, m=4)
    assert (t.f, t.i, t.w) == (1.0, 2.0, 1.0)
    assert t.b == pytest.approx((6.0 + 8.0 + 16.0) / 10)   # B, I and W of every stage over its 10 backwards


def test_dualpipev_sends_a_forwards_output_when_the_forward_ends():
    """torch lowers an OVERLAP_F_B pair with its sends after the whole pair; send_after_each_half flattens the pairs
    (the order of compute unchanged), so each remote forward's SEND_F comes right after that forward."""
    from torch.distributed.pipelining.schedules import _add_send_recv

    from lmforge.components.training.schedules import send_after_each_half

    order = torch_order("dualpipev", p=2, v=2, m=8)

    class Lowered:
        pipeline_order = order

        def _prepare_schedule_with_comms(self, actions):
            self.flat = actions

    lowered = Lowered()
    send_after_each_half(lowered)

    def compute(actions):
        return [str(a) for a in actions if a is not None and a.is_compute_op]
    for rank, actions in order.items():
        pairs_flattened = [str(s) for a in actions if a is not None for s in (a.sub_actions or (a,))]
        assert compute(lowered.flat[rank]) == pairs_flattened

    def late_sends(actions):
        """How many remote forwards run some other compute between the forward and the send of its output."""
        with_comms = _add_send_recv({r: list(a) for r, a in actions.items()}, num_stages=4,
                                    stage_to_rank=lambda s: stage_to_rank(s, p=2, placement="v"))
        late = 0
        for acts in with_comms.values():
            executed = [s for a in acts for s in (a.sub_actions or (a,))]   # as the runtime runs a pair: in turn
            for i, a in enumerate(executed):
                if a.computation_type.value == "SEND_F":
                    f = next(j for j, b in enumerate(executed) if b.computation_type.value == "F"
                             and (b.stage_index, b.microbatch_index) == (a.stage_index, a.microbatch_index))
                    late += any(b.is_compute_op for b in executed[f + 1:i])
        return late

    assert late_sends(order) > 0 and late_sends(lowered.flat) == 0
