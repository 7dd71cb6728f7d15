"""The parameter-server strategies' own loops (run_easgd, run_hogwild, run_async_sgd) on real processes joined by a
real gloo group, with a model small enough that what each rank did can be read back from the weights.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/integration/test_ps_loops.py

Each test starts its ranks with multiprocessing (spawn), as the deepspeed launcher would start ps/rank.py, and
each rank saves what it ended with (its weights, what the loop returned, its stats, rank 0's events) for the
test to check. The model is a bigram table, logits = table[token], so a worker's gradient touches only the
rows of the tokens it reads; rank r reads only its own tokens (`RankTokens`, a stand-in for TokenWindows,
which test_train_ps.py runs for real). A rank is slowed on purpose with protocol.STRAGGLER_ENV, the knob
benchmarks/bench_ps.py uses. tests/integration/test_train_ps.py runs the same loops through the launcher.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

VOCAB = 4
SEQ = 8
TOKENS = ([0, 1], [2, 3], [1, 0])   # rank r's windows repeat TOKENS[r]: ranks 0 and 1 touch disjoint rows
SLOW = 0.2                          # seconds the slowed rank sleeps each step: many of a fast rank's steps


class Table(torch.nn.Module):
    """A bigram model, logits = table[input_ids], called as ps/common.py's Ctx calls a causal LM."""

    def __init__(self, init: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(init.clone())

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> Any:
        return SimpleNamespace(logits=self.table[input_ids])


class RankTokens:
    """Worker r's micro-batches: every window is TOKENS[r] repeated, so its gradient reaches only those rows."""

    def micro_batches(self, step: int, *, dp_rank: int, dp_size: int, micro: int, accum: int
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids = torch.tensor(TOKENS[dp_rank] * (SEQ + 1))[:SEQ + 1]
        return [(ids[:-1].expand(micro, SEQ), ids[1:].expand(micro, SEQ))] * accum


def training(strategy: str, world: int, **over: Any):
    from lmforge.components.sections.training import TrainingConfig

    return TrainingConfig.model_validate({
        "model": {"preset": "tiny"}, "micro_batch_size": 1, "seq_len": SEQ, "num_ranks": world, "precision": "fp32",
        "weight_decay": 0.0, "grad_clip": 0.0, "warmup_steps": 1, "log_every": 1, **over,
        "parallel": {"strategy": strategy, **over.get("parallel", {})}})


def _rank(rank: int, world: int, port: int, out: str, strategy: str, over: dict, init: list[float],
          straggle: str | None) -> None:
    """One rank: join the gloo group, build a Ctx over the table, run the strategy's loop, save what it ended with."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # hogwild names its /dev/shm files by it
    if straggle:
        from lmforge.components.training.protocol import STRAGGLER_ENV

        os.environ[STRAGGLER_ENV] = straggle
    import torch.distributed as dist

    from lmforge.components.training.layout import check_layout
    from lmforge.components.training.protocol import RankHardware, RankRequest
    from lmforge.components.training.ps.common import Ctx, FlatParams
    from lmforge.components.training.strategies import deepspeed_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=dt.timedelta(seconds=180))
    cfg = training(strategy, world, **over)
    layout = check_layout(cfg, vocab_size=512, world_size=world)
    hw = RankHardware(device="cpu", device_name="test cpu", gpus=(), precision="fp32", precision_reason="asked for",
                      peak_flops_per_device=1e11, peak_source="measured: test", compile=False)
    req = RankRequest(training=cfg, layout=layout, hardware=hw, ds_config=deepspeed_config(cfg, layout), run_dir=Path(out),
                      shards=Path(out), tokenizer=Path(out), resume=False, meta={}, attempt=0)
    model = Table(torch.tensor(init).reshape(VOCAB, VOCAB))
    events: list[dict] = []
    made: list[Ctx] = []

    def make_ctx(buffer: torch.Tensor | None = None) -> Ctx:
        made.append(Ctx(req=req, model=model, flat=FlatParams(model, buffer), windows=RankTokens(), rank=rank, world=world,
                        token_flops=1.0, peak=1e15, emit=lambda run_dir, event: events.append(event)))
        return made[-1]

    if strategy == "hogwild":
        from lmforge.components.training.ps.hogwild import run_hogwild

        returned = run_hogwild(make_ctx, VOCAB * VOCAB, world, rank)
    else:
        from lmforge.components.training.ps.easgd import run_easgd
        from lmforge.components.training.ps.sync import run_async_sgd

        returned = {"easgd": run_easgd, "async-sgd": run_async_sgd}[strategy](make_ctx())
    ctx = made[0]
    torch.save({"weights": ctx.flat.data.clone(), "returned": returned, "stats": ctx.stats.summary(), "events": events,
                "tokens_per_step": ctx.tokens_per_worker_step}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run_ranks(tmp_path: Path, strategy: str, inits: list[torch.Tensor], *, straggle: str | None = None,
              **over: Any) -> list[dict]:
    """Start len(inits) ranks (rank r's table starts at inits[r]); every rank's saved result, in rank order."""
    from lmforge.components.runtime.ports import free_port

    spawn = multiprocessing.get_context("spawn")
    port, world = free_port(), len(inits)
    procs = [spawn.Process(target=_rank, args=(r, world, port, str(tmp_path), strategy, over, inits[r].reshape(-1).tolist(),
                                               straggle), name=f"{strategy}-rank{r}") for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=400)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world, f"{strategy}: rank exit codes {[p.exitcode for p in procs]}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def test_easgd_rounds_on_three_processes_follow_the_worker_and_center_updates(tmp_path):
    """run_easgd's rounds, with the local steps at lr 0 (the warmup's first two steps), so that only the rounds move
    the weights: worker x_i <- x_i - alpha (x_i - c), center c <- c + alpha sum_i (x_i - c), both with the values from
    before the round, alpha = 1/8, a round after each of 2 steps, the center starting at rank 0's weights."""
    offset = torch.arange(VOCAB * VOCAB, dtype=torch.float32) / 4     # the same on every rank: the rounds are affine
    start = (1.0, 3.0, 7.0)
    ranks = run_ranks(tmp_path, "easgd", [offset + s for s in start], max_steps=2, warmup_steps=2, lr=1e-9,
                      parallel={"easgd": {"alpha": 0.125, "tau": 1}})
    # By hand, per element less the offset. Round 1, center 1: differences 0, 2, 6 (sum 8), so the center goes to
    # 1 + 8/8 = 2 and the workers to 1, 3 - 2/8 = 2.75, 7 - 6/8 = 6.25. Round 2, center 2: differences -1, 0.75, 4.25
    # (sum 4), so the center goes to 2 + 4/8 = 2.5 and the workers to 1 + 1/8, 2.75 - 0.75/8, 6.25 - 4.25/8.
    workers = (1.125, 2.65625, 5.71875)
    center = 2.5
    for r, expected in enumerate(workers):
        assert torch.allclose(ranks[r]["weights"], offset + expected, atol=1e-6), (r, ranks[r]["weights"][:3])
    assert torch.allclose(ranks[0]["returned"], offset + center, atol=1e-6), ranks[0]["returned"][:3]
    assert ranks[1]["returned"] is None and ranks[2]["returned"] is None   # the center lives on rank 0 alone
    assert sum(workers) + center == sum(start) + start[0]                # the sum is kept, as the elastic force is symmetric


def test_hogwild_ranks_step_one_shared_set_of_weights(tmp_path):
    """Rank 0 reads only tokens 0 and 1 and rank 1 only 2 and 3, so rows 2 and 3 of the table move only by rank 1's
    steps, rows 0 and 1 only by rank 0's. Both sets of rows moved in the weights rank 0 returns (and exports), and
    rank 1 ends seeing the very same values: one set of weights, written by both. Rank 1 sleeps SLOW s each step, so
    rank 0's steps land while rank 1 computes: its staleness is above 0, which a rank training alone never shows."""
    steps = 10
    ranks = run_ranks(tmp_path, "hogwild", [torch.zeros(VOCAB, VOCAB)] * 2, straggle=f"1:{SLOW}", max_steps=steps, lr=0.05)
    shared = ranks[0]["returned"].reshape(VOCAB, VOCAB)
    assert shared[:2].abs().sum() > 0, "rank 0's own rows did not move"
    assert shared[2:].abs().sum() > 0, "rank 1's updates never reached the weights rank 0 returns: not shared"
    assert torch.equal(ranks[1]["weights"], ranks[0]["returned"]), "rank 1 does not see rank 0's rows: not shared"
    assert ranks[1]["returned"] is None
    # Rank 1's staleness (its own count): rank 0's updates that landed between reading the counter and stepping.
    slow = ranks[1]["stats"]["staleness_hist"]
    assert sum(slow.values()) == steps and max(int(k) for k in slow) > 0, slow
    # Rank 0 logs both ranks from the shared table: every step of each, and rank 1's histogram merged into its own.
    last = ranks[0]["events"][-1]["ps"]
    assert last["tokens"] == 2 * steps * ranks[0]["tokens_per_step"]
    assert sum(last["staleness_hist"].values()) == 2 * steps and last["staleness_max"] > 0, last["staleness_hist"]


def test_async_sgd_with_a_slow_worker_sees_stale_gradients_and_drops_those_past_max_staleness(tmp_path):
    """Rank 1 sleeps SLOW s after each gradient, while rank 0 (worker 0 and the server) pushes its own: rank 1's first
    gradient arrives computed on weights several server versions old, past max_staleness = 1, and is dropped."""
    steps = 8
    ranks = run_ranks(tmp_path, "async-sgd", [torch.zeros(VOCAB, VOCAB)] * 2, straggle=f"1:{SLOW}", max_steps=steps,
                      lr=0.05, parallel={"async_sgd": {"max_staleness": 1}})
    stats = ranks[0]["stats"]            # the server's count: every push of both workers
    hist = {int(k): n for k, n in stats["staleness_hist"].items()}
    assert sum(hist.values()) == 2 * steps, hist
    assert stats["staleness_max"] > 1 and stats["dropped"] > 0, stats
    assert stats["dropped"] == sum(n for k, n in hist.items() if k > 1), stats  # exactly those past max_staleness
    assert ranks[0]["events"][-1]["ps"]["dropped"] == stats["dropped"]
