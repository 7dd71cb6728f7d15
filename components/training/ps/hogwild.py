"""Hogwild (Niu et al. 2011; pytorch/examples mnist_hogwild): every worker steps the same weights in shared memory, no locks.

    weights = run_hogwild(ctx_factory)     # every rank; rank 0 returns the shared weights to export

The ranks are local processes started by the deepspeed launcher (not torch.multiprocessing.spawn), so the
weights live in a file under /dev/shm that every rank maps with torch.from_file(shared=True): the same
pages, as torch.multiprocessing's shared tensors would be. Each worker computes its gradient on whatever
the weights are as it reads them and applies its own AdamW step to them in place, while the others do
the same. A second shared table holds a version counter (updates applied, incremented without a lock,
so two racing increments can count once) and each worker's latest step, loss, RSS, tokens and staleness
histogram, which rank 0 logs. Staleness = the counter after the worker's step - the counter when it
began: the updates of other workers that landed while it computed. No bytes cross a network; each
update writes the whole weight vector into shared memory (reported apart). Local processes only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmforge.components.training.ps.common import Ctx

BUCKETS = 33          # staleness 0..31, and 32 for "32 or more"
ROW = 8 + BUCKETS     # step, loss, rss, tokens, spare x4, then the histogram


def shm_paths(port: str) -> tuple[Path, Path]:
    base = f"lmforge_hogwild_{os.getuid()}_{port}"
    return Path("/dev/shm") / f"{base}.weights", Path("/dev/shm") / f"{base}.table"


def _mapped(path: Path, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=n, dtype=dtype)


def run_hogwild(make_ctx: Callable[[torch.Tensor | None], Ctx], n_params: int, world: int, rank: int) -> torch.Tensor | None:
    """`make_ctx(buffer)` builds the rank's context with its parameters as views into `buffer` (the shared weights)."""
    import torch.distributed as dist

    weights_path, table_path = shm_paths(os.environ.get("MASTER_PORT", "0"))
    if rank == 0:
        for path, nbytes in ((weights_path, n_params * 4), (table_path, (1 + world * ROW) * 8)):
            with open(path, "wb") as f:
                f.truncate(nbytes)
    dist.barrier()
    try:
        weights = _mapped(weights_path, n_params, torch.float32)
        table = _mapped(table_path, 1 + world * ROW, torch.float64)
        ctx = make_ctx(weights if rank == 0 else None)
        if rank == 0:
            table.zero_()
        dist.barrier()
        if rank != 0:  # the same seed built the same weights; every rank now computes on the shared ones
            _rebind(ctx, weights)
        opt, sched = ctx.local_optimizer(weights)
        dist.barrier()  # every worker starts together
        ctx.t0 = time.perf_counter()
        ctx.window = (ctx.t0, 0.0)
        loss = _train(ctx, opt, sched, table)
        dist.barrier()
        if rank == 0:  # the last event once every worker has finished its last step
            _log(ctx, table, ctx.cfg.max_steps, loss, force=True)
        return weights.clone() if rank == 0 else None
    finally:
        if rank == 0:  # every rank mapped the files before training began; a mapping outlives the name
            weights_path.unlink(missing_ok=True)
            table_path.unlink(missing_ok=True)


def _rebind(ctx: Ctx, weights: torch.Tensor) -> None:
    from lmforge.components.training.ps.common import FlatParams

    ctx.flat = FlatParams(ctx.model, weights, copy_in=False)


def _train(ctx: Ctx, opt: Any, sched: Any, table: torch.Tensor) -> float:
    cfg, rank = ctx.cfg, ctx.rank
    row = table[1 + rank * ROW:1 + (rank + 1) * ROW]
    hist = torch.zeros(BUCKETS, dtype=torch.float64)
    version = table[0:1]
    for step in range(cfg.max_steps):
        began = float(version[0])
        loss = ctx.local_grad(step)
        ctx.clip_and_step(opt, sched)         # AdamW writes straight into the shared weights
        staleness = int(float(version[0]) - began)
        version += 1                           # not atomic: Hogwild's own race, on the counter too
        ctx.stats.staleness(staleness)
        hist[min(staleness, BUCKETS - 1)] += 1
        from lmforge.components.training.memory import host_rss_bytes

        row[:4] = torch.tensor([step + 1, loss, host_rss_bytes(), ctx.steps_done * ctx.tokens_per_worker_step],
                               dtype=torch.float64)
        row[8:] = hist
        if rank == 0 and step + 1 < cfg.max_steps:
            _log(ctx, table, step + 1, loss)
    return loss


def _log(ctx: Ctx, table: torch.Tensor, done: int, loss: float, *, force: bool = False) -> None:
    """Rank 0's event from the shared table: every worker's latest loss and tokens, the merged histogram."""
    rows = [table[1 + r * ROW:1 + (r + 1) * ROW].tolist() for r in range(ctx.world)]
    for r, values in enumerate(rows[1:], start=1):
        ctx.peers.update(r, [values[0], 0.0, values[1], values[2], values[3], 0.0, 0.0, 0.0])
    merged = [sum(values[8 + b] for values in rows) for b in range(BUCKETS)]
    with ctx.stats.lock:
        ctx.stats.hist.clear()
        ctx.stats.hist.update({b: int(c) for b, c in enumerate(merged) if c})
    losses = [loss] + [values[1] for values in rows[1:] if values[0] > 0]
    ctx.log(done, loss, losses=losses, worker_optimizer=True, force=force)
