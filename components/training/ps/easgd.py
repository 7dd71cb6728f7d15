"""Elastic averaging SGD (Zhang, Choromanska, LeCun 2015, eq. 5-6, synchronous form): the two updates and the loop.

    pull_towards(x, old_center, alpha)                  # a worker's half of a round, in place
    old_center = move_center(center, workers, alpha)    # the server's half, in place; `workers` may be a generator
    run_easgd(ctx)                                      # every rank; rank 0 holds the center

Each worker trains its own weights x_i with its own AdamW. Every tau local steps every worker sends x_i to
rank 0, which updates the center with the old center x~ and sends that old center back:

    x_i <- x_i - alpha (x_i - x~)            (each worker, with the center before this round)
    x~  <- x~  + alpha sum_i (x_i - x~)      (the server, with the workers' weights before this round)

In the paper's terms (W_i <- W_i - eta (dW_i + rho (W_i - W~)), W~ <- W~ + eta sum_i rho (W_i - W~)),
alpha = eta rho, and the gradient term eta dW_i is the worker's own AdamW step, taken every step between
rounds. The sum x~ + sum_i x_i is unchanged by a round (the elastic force is symmetric). alpha x workers
<= 1 keeps the center from overshooting the workers' mean (checked before launch). The export is the
center. Staleness here is the local steps since the worker last met the center (0 .. tau - 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmforge.components.training.ps.common import Ctx


def pull_towards(x: torch.Tensor, center: torch.Tensor, alpha: float) -> torch.Tensor:
    """A worker's half of the round, in place: x <- x - alpha (x - center), with the center from before the round."""
    return x.sub_(x - center, alpha=alpha)


def move_center(center: torch.Tensor, workers: Iterable[torch.Tensor], alpha: float) -> torch.Tensor:
    """The server's half of the round, in place: center <- center + alpha sum_i (x_i - center); returns the old
    center (a copy), which every worker is then pulled towards.

    `workers` is consumed one tensor at a time, each before the next is asked for, so a generator may hand
    every worker's weights in the same receive buffer (rank 0 keeps one, not one per worker)."""
    old = center.clone()
    total = torch.zeros_like(center)
    for x in workers:
        total += x - old
    center.add_(total, alpha=alpha)
    return old


def run_easgd(ctx: "Ctx") -> torch.Tensor | None:
    """Train with elastic rounds every tau steps; rank 0 returns the center (the weights to export)."""
    import torch.distributed as dist

    cfg = ctx.cfg
    tau, alpha = cfg.parallel.easgd.tau, cfg.parallel.easgd.alpha
    opt, sched = ctx.local_optimizer()
    center = ctx.flat.data.clone() if ctx.rank == 0 else None
    others = torch.empty_like(ctx.flat.data)

    def every_worker() -> Iterator[torch.Tensor]:
        """Rank 0's own weights, then each remote worker's, received into `others` as move_center asks for them."""
        yield ctx.flat.data
        for w in range(1, ctx.world):
            ctx.peers.update(w, ctx.recv_header(w))
            ctx.recv(others, w)
            yield others

    since = 0
    for step in range(cfg.max_steps):
        ctx.stats.staleness(since)
        loss = ctx.local_grad(step)
        ctx.clip_and_step(opt, sched)
        done, since = step + 1, since + 1
        if done % tau == 0 or done == cfg.max_steps:
            header = ctx.header(step=done, loss=loss)
            if ctx.rank == 0:
                assert center is not None
                old = move_center(center, every_worker(), alpha)
                for w in range(1, ctx.world):
                    ctx.send_header(ctx.header(step=done, loss=loss), w)
                    ctx.send(old, w)
                pull_towards(ctx.flat.data, old, alpha)
            else:
                ctx.send_header(header, 0)
                ctx.send(ctx.flat.data, 0)
                ctx.recv_header(0)
                ctx.recv(others, 0)
                pull_towards(ctx.flat.data, others, alpha)
            since = 0
        # Tokens as every worker's `done` steps: they meet every tau steps, and a peer's count heard only at a round
        # would jump by tau steps' tokens within one log window.
        ctx.log(done, loss, tokens=done * ctx.world * ctx.tokens_per_worker_step)
    dist.barrier()
    return center
