"""A parameter server on rank 0 over gloo send/recv: synchronous (ps-sync) and asynchronous (async-sgd) SGD.

    master = run_ps_sync(ctx)      # every rank; rank 0 returns the master weights to export
    master = run_async_sgd(ctx)

Rank 0 holds the master weights and the optimizer (AdamW, the run's schedule) and is also worker 0, which
computes on its own copy of the weights; workers 1.. send gradients and receive weights.

ps-sync: each step the server waits for every worker's gradient, averages them, steps once and sends the
new weights to every worker: one update per global batch, staleness 0, and the step waits for the slowest.

async-sgd (Downpour-style, Dean et al. 2012): a thread on rank 0 serves the remote workers while the
main thread is worker 0. Each gradient is applied as it arrives, then the worker gets the current
weights back. Staleness = server version (updates applied so far) - the version the worker computed
on. A gradient staler than `async_sgd.max_staleness` is DROPPED, not applied (and counted): the worker
just gets fresh weights. The schedule advances once per `workers` updates, so lr follows the same
curve over the same tokens as ps-sync.
"""

from __future__ import annotations

import threading

import torch

from lmforge.components.training.ps.common import HEADER, Ctx


def run_ps_sync(ctx: Ctx) -> torch.Tensor | None:
    import torch.distributed as dist

    cfg = ctx.cfg
    server = ctx.rank == 0
    opt = sched = None
    master = ctx.flat.data  # worker 0 computes on the master itself: the server waits for it anyway
    if server:
        opt, sched = ctx.local_optimizer()
    other = torch.empty_like(ctx.flat.grad)
    for step in range(cfg.max_steps):
        loss = ctx.local_grad(step)
        done = step + 1
        if server:
            total = ctx.flat.grad.clone()
            losses = [loss]
            for w in range(1, ctx.world):
                h = ctx.recv_header(w)
                ctx.peers.update(w, h)
                losses.append(h[2])
                ctx.recv(other, w)
                total += other
                ctx.stats.staleness(0)
            ctx.stats.staleness(0)
            total /= ctx.world
            ctx.clip_and_step(opt, sched, grad=total)
            for w in range(1, ctx.world):
                ctx.send(master, w)
            ctx.log(done, loss, losses=losses, server_extra=0)
        else:
            ctx.send_header(ctx.header(step=done, loss=loss), 0)
            ctx.send(ctx.flat.grad, 0)
            ctx.recv(ctx.flat.data, 0)
    dist.barrier()
    return master if server else None


class AsyncServer:
    """Rank 0's master weights and optimizer; push() applies one worker's gradient (or drops it), under a lock."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.master = ctx.flat.data.clone()
        self.opt, self.sched = ctx.local_optimizer(self.master)
        self.version = 0
        self.lock = threading.Lock()
        self.max_staleness = ctx.cfg.parallel.async_sgd.max_staleness

    def push(self, grad: torch.Tensor, computed_on: int) -> int:
        """Apply `grad` (computed on weights of version `computed_on`) unless it is too stale; the staleness."""
        with self.lock:
            staleness = self.version - computed_on
            self.ctx.stats.staleness(staleness)
            if staleness > self.max_staleness:
                with self.ctx.stats.lock:
                    self.ctx.stats.dropped += 1
                return staleness
            lr_sched = self.sched if (self.version + 1) % self.ctx.world == 0 else _NoStep()
            self.ctx.clip_and_step(self.opt, lr_sched, grad=grad)
            self.version += 1
            return staleness

    def pull(self, into: torch.Tensor) -> int:
        with self.lock:
            into.copy_(self.master)
            return self.version


class _NoStep:
    def step(self) -> None:
        pass


def _serve(server: AsyncServer, worker: int, errors: list[BaseException]) -> None:
    """Rank 0's thread for one remote worker: receive a gradient, apply it, send the weights back; until done."""
    ctx = server.ctx
    grad = torch.empty_like(ctx.flat.grad)
    weights = torch.empty_like(ctx.flat.data)
    try:
        while True:
            h = ctx.recv_header(worker)
            if h[0] < 0:  # the worker has finished
                ctx.peers.update(worker, [-h[0], *h[1:]])
                return
            ctx.peers.update(worker, h)
            ctx.recv(grad, worker)
            server.push(grad, int(h[1]))
            version = server.pull(weights)
            reply = torch.zeros(HEADER, dtype=torch.float64)
            reply[1] = version
            ctx.send_header(reply, worker)
            ctx.send(weights, worker)
    except BaseException as e:  # re-raised by the main thread
        errors.append(e)


def run_async_sgd(ctx: Ctx) -> torch.Tensor | None:
    import torch.distributed as dist

    cfg = ctx.cfg
    if ctx.rank == 0:
        server = AsyncServer(ctx)
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_serve, args=(server, w, errors), name=f"ps-serve-{w}", daemon=True)
                   for w in range(1, ctx.world)]
        for t in threads:
            t.start()
        version = server.pull(ctx.flat.data)
        for step in range(cfg.max_steps):
            loss = ctx.local_grad(step)
            server.push(ctx.flat.grad, version)
            version = server.pull(ctx.flat.data)
            if errors:
                raise errors[0]
            if step + 1 < cfg.max_steps:  # the last event waits for every worker's last step, below
                ctx.log(step + 1, loss, server_extra=ctx.flat.nbytes)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        ctx.log(cfg.max_steps, loss, server_extra=ctx.flat.nbytes, force=True)  # with every worker's last step
        dist.barrier()
        return server.master
    version = 0
    reply = torch.empty(HEADER, dtype=torch.float64)
    for step in range(cfg.max_steps):
        loss = ctx.local_grad(step)
        ctx.send_header(ctx.header(step=step + 1, loss=loss, version=version), 0)
        ctx.send(ctx.flat.grad, 0)
        ctx.recv(reply, 0)
        version = int(reply[1])
        ctx.recv(ctx.flat.data, 0)
    h = ctx.header(step=cfg.max_steps, loss=loss, version=version)
    h[0] = -cfg.max_steps
    ctx.send_header(h, 0)
    dist.barrier()
    return None
