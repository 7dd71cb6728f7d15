"""The parameter-server family without launching: EASGD's two updates by hand (the functions run_easgd calls), the
async server's drop rule, the flat buffers, the section's refusals, the checks before launch and the rank entry the
launcher picks. tests/integration/test_ps_loops.py runs the strategies' loops on real processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from lmforge.components.errors import UserError
from lmforge.components.sections.training import TrainingConfig
from lmforge.components.training.layout import check_layout
from lmforge.components.training.protocol import RankHardware, RankRequest
from lmforge.components.training.ps.checks import check_ps_job
from lmforge.components.training.ps.easgd import move_center, pull_towards
from lmforge.components.training.strategies import deepspeed_config


def training(**over) -> TrainingConfig:
    return TrainingConfig.model_validate({"model": {"preset": "tiny"}, "micro_batch_size": 2, "max_steps": 10,
                                          "warmup_steps": 2, "num_ranks": 2, "precision": "fp32", **over})


# EASGD in the paper's terms: worker W_i <- W_i - eta (dW_i + rho (W_i - W~)), center W~ <- W~ + eta sum_i rho (W_i - W~).
# lmforge's alpha is eta x rho (the gradient term eta dW_i is the worker's own AdamW step between rounds). eta = 1/2 and
# rho = 1/4 give alpha = 1/8, exact in binary, so every expected value below is exact.
ETA, RHO = 0.5, 0.25
CENTER = [1.0, 0.0]
WORKERS = [[1.0, 2.0], [3.0, -1.0], [7.0, 0.5]]


def test_easgd_worker_update_pulls_each_worker_by_eta_rho_towards_the_old_center():
    center = torch.tensor(CENTER)
    pulled = [pull_towards(torch.tensor(x), center, ETA * RHO).tolist() for x in WORKERS]
    # W_i - 1/8 (W_i - W~):  [1, 2] - 1/8 [0, 2],  [3, -1] - 1/8 [2, -1],  [7, 0.5] - 1/8 [6, 0.5]
    assert pulled == [[1.0, 1.75], [2.75, -0.875], [6.25, 0.4375]]
    assert center.tolist() == CENTER  # the center is read, not moved


def test_easgd_center_update_adds_eta_rho_times_the_sum_of_every_workers_difference():
    center = torch.tensor(CENTER)
    old = move_center(center, [torch.tensor(x) for x in WORKERS], ETA * RHO)
    # W~ + 1/8 ([0, 2] + [2, -1] + [6, 0.5]) = [1, 0] + 1/8 [8, 1.5]
    assert center.tolist() == [2.0, 0.1875]
    assert old.tolist() == CENTER and old.data_ptr() != center.data_ptr()  # the workers are pulled towards this copy


def test_easgd_center_update_takes_every_worker_through_one_reused_buffer():
    """rank 0 receives every worker into the same tensor: each must be summed before the next overwrites it."""
    buffer = torch.empty(2)

    def received():
        for x in WORKERS:
            buffer.copy_(torch.tensor(x))
            yield buffer

    center = torch.tensor(CENTER)
    move_center(center, received(), ETA * RHO)
    assert center.tolist() == [2.0, 0.1875]


def test_one_easgd_round_keeps_the_sum_of_the_center_and_the_workers():
    center = torch.tensor(CENTER)
    workers = [torch.tensor(x) for x in WORKERS]
    before = center + sum(workers)
    old = move_center(center, workers, ETA * RHO)
    for x in workers:
        pull_towards(x, old, ETA * RHO)
    assert torch.equal(center + sum(workers), before)  # the elastic force is symmetric


def request(tmp_path: Path, cfg: TrainingConfig) -> RankRequest:
    layout = check_layout(cfg, vocab_size=512, world_size=2)
    hw = RankHardware(device="cpu", device_name="test cpu", gpus=(), precision="fp32", precision_reason="asked for",
                      peak_flops_per_device=1e11, peak_source="measured: test", compile=False)
    return RankRequest(training=cfg, layout=layout, hardware=hw, ds_config=deepspeed_config(cfg, layout), run_dir=tmp_path,
                       shards=tmp_path, tokenizer=tmp_path, resume=False, meta={}, attempt=0)


def small_ctx(tmp_path: Path, cfg: TrainingConfig):
    from lmforge.components.training.ps.common import Ctx, FlatParams

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    return Ctx(req=request(tmp_path, cfg), model=model, flat=FlatParams(model), windows=None, rank=0, world=2,
               token_flops=1.0, peak=1.0, emit=None)


def test_the_parameters_and_their_gradients_live_in_the_flat_buffers(tmp_path):
    ctx = small_ctx(tmp_path, training(parallel={"strategy": "ps-sync"}))
    flat, model = ctx.flat, ctx.model
    assert flat.data.numel() == 3 * 2 + 2 + 2 + 1
    model(torch.ones(4, 3)).sum().backward()
    flat.check_grads()
    assert torch.equal(flat.grad, torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    flat.data.zero_()
    assert all(float(p.detach().abs().sum()) == 0 for p in model.parameters())  # a message into the buffer is the model


def test_async_server_drops_exactly_the_gradients_staler_than_max_staleness(tmp_path):
    from lmforge.components.training.ps.sync import AsyncServer

    ctx = small_ctx(tmp_path, training(parallel={"strategy": "async-sgd", "async_sgd": {"max_staleness": 1}}))
    server = AsyncServer(ctx)
    grad = torch.ones_like(ctx.flat.grad)
    assert [server.push(grad, 0), server.push(grad, 0), server.push(grad, 0)] == [0, 1, 2]
    assert server.version == 2 and ctx.stats.dropped == 1        # the third, 2 updates stale, was not applied
    before = server.master.clone()
    assert [server.push(grad, v) for v in (2, 3, 4, 5)] == [0, 0, 0, 0]  # DeepSpeed's warmup gives lr 0 at first
    assert not torch.equal(server.master, before)
    weights = torch.empty_like(server.master)
    assert server.pull(weights) == 6 and torch.equal(weights, server.master)
    assert ctx.stats.summary()["staleness_hist"] == {"0": 5, "1": 1, "2": 1}


@pytest.mark.parametrize("over, words", [
    ({"parallel": {"strategy": "ps-sync", "offload_optimizer": True}}, "runs beside DeepSpeed"),
    ({"parallel": {"strategy": "hogwild", "pipeline": {"stages": 2}}}, "pipeline.stages > 1"),
    ({"parallel": {"strategy": "easgd", "tensor": {"autotp_size": 2}}}, "tensor.autotp_size > 1"),
    ({"parallel": {"strategy": "async-sgd"}, "model": {"preset": "tiny", "moe": {"num_experts": 2}}}, "num_experts"),
    ({"parallel": {"strategy": "ps-sync"}, "precision": "bf16"}, "precision = \"bf16\""),
    ({"parallel": {"strategy": "easgd", "easgd": {"alpha": 1.5}}}, "alpha"),
    ({"parallel": {"strategy": "easgd", "easgd": {"tau": 0}}}, "tau"),
    ({"parallel": {"strategy": "async-sgd", "async_sgd": {"max_staleness": -1}}}, "max_staleness"),
])
def test_the_section_refuses_what_the_family_cannot_run(over, words):
    with pytest.raises(ValidationError, match=words.replace("(", r"\(")):
        training(**over)


def test_the_strategies_are_accepted_and_run_with_zero_stage_zero():
    for s in ("ps-sync", "async-sgd", "hogwild", "easgd"):
        cfg = training(parallel={"strategy": s})
        assert cfg.parallel.parameter_server and cfg.parallel.zero_stage == 0
    assert not training(parallel={"strategy": "zero2"}).parallel.parameter_server


@pytest.mark.parametrize("over, world, kw, what, words", [
    ({"parallel": {"strategy": "ps-sync"}, "num_ranks": 1}, 1, {}, "training.num_ranks", "too few"),
    ({"parallel": {"strategy": "async-sgd"}}, 2, {"resume": True}, "--resume", "not yet"),
    ({"parallel": {"strategy": "easgd", "easgd": {"alpha": 0.6}}}, 2, {}, "training.parallel.easgd.alpha", "> 1"),
    ({"parallel": {"strategy": "hogwild"}}, 2, {"device": "cuda"}, "training.parallel.strategy", "CPU ranks"),
])
def test_checks_before_launch_name_the_key_and_the_fix(over, world, kw, what, words):
    cfg = training(**over)
    layout = check_layout(cfg, vocab_size=512, world_size=world)
    with pytest.raises(UserError) as e:
        check_ps_job(cfg, layout, **{"device": "cpu", "resume": False, **kw})
    assert e.value.what == what and words in e.value.problem and e.value.fix


def test_the_launcher_starts_the_family_from_its_own_rank_entry(tmp_path):
    from lmforge.components.training.launcher import rank_module

    assert rank_module(request(tmp_path, training(parallel={"strategy": "hogwild"}))) == "lmforge.components.training.ps.rank"
    assert rank_module(request(tmp_path, training(parallel={"strategy": "ddp"}))) == "lmforge.components.training.rank"
