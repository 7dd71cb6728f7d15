"""The parameter-server family without launching: EASGD's round by hand, the async server's drop rule, the
flat buffers, the section's refusals, the checks before launch and the rank entry the launcher picks."""

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
from lmforge.components.training.ps.easgd import elastic_round
from lmforge.components.training.strategies import deepspeed_config


def training(**over) -> TrainingConfig:
    return TrainingConfig.model_validate({"model": {"preset": "tiny"}, "micro_batch_size": 2, "max_steps": 10,
                                          "warmup_steps": 2, "num_ranks": 2, "precision": "fp32", **over})


def test_one_easgd_round_follows_the_two_update_equations_by_hand():
    x0, x1, center = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0]), torch.tensor([0.0, 1.0])
    (n0, n1), new_center = elastic_round([x0, x1], center, alpha=0.25)
    # x_i <- x_i - alpha (x_i - c):  x0 - 0.25 [1, 1],  x1 - 0.25 [3, -2]
    assert n0.tolist() == [0.75, 1.75] and n1.tolist() == [2.25, -0.5]
    # c <- c + alpha sum_i (x_i - c):  [0, 1] + 0.25 ([1, 1] + [3, -2])
    assert new_center.tolist() == [1.0, 0.75]
    assert x0.tolist() == [1.0, 2.0] and center.tolist() == [0.0, 1.0]  # the round works on copies
    assert torch.equal(n0 + n1 + new_center, x0 + x1 + center)          # the elastic force is symmetric: sum kept


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
