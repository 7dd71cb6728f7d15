"""What every parameter-server strategy shares: flat weights, a worker's gradient, messages, and what is logged.

    ctx = Ctx.build(req, model, windows, tokenizer_len=len(tok))   # in ps/rank.py, after the gloo group is up
    loss = ctx.local_grad(step)          # this worker's gradient for `step` into ctx.flat.grad; the mean loss
    ctx.send(ctx.flat.grad, 0)           # gloo send, counted in ctx.stats.bytes
    ctx.log(done, loss)                  # rank 0: one event per logged step, the same shape rank.py emits

The model's parameters are views into one flat fp32 buffer (`FlatParams`), and their gradients views into a
second one, so a message is one tensor and the server's optimizer steps one parameter. Worker w is rank w;
rank 0 is also the server. The data a worker reads is the data-parallel slice of components/training/batches.py
with dp_rank = w and dp_size = workers, so every strategy sees the same tokens at the same step.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lmforge.components.training.protocol import RankRequest

HEADER = 8  # float64: step, version, loss, rss bytes, tokens done, staleness, spare, spare


class FlatParams:
    """The model's parameters and gradients as views into two flat buffers (in `buffer` when given: shared memory)."""

    def __init__(self, model: torch.nn.Module, buffer: torch.Tensor | None = None, *, copy_in: bool = True) -> None:
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        self.data = torch.empty(n, dtype=torch.float32) if buffer is None else buffer
        assert self.data.numel() == n and self.data.dtype == torch.float32, (self.data.shape, n)
        self.grad = torch.zeros(n, dtype=torch.float32)
        offset = 0
        for p in params:
            k = p.numel()
            if copy_in:
                self.data[offset:offset + k].copy_(p.data.reshape(-1))
            p.data = self.data[offset:offset + k].view_as(p)
            p.grad = self.grad[offset:offset + k].view_as(p)  # autograd accumulates into it in place
            offset += k
        self.params = params

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def check_grads(self) -> None:
        """Every gradient still lives in the flat buffer (an optimizer's zero_grad(set_to_none) would detach them)."""
        lo, hi = self.grad.data_ptr(), self.grad.data_ptr() + self.grad.numel() * 4
        assert all(p.grad is not None and lo <= p.grad.data_ptr() < hi for p in self.params), "a gradient left the buffer"


class Stats:
    """Staleness histogram, bytes sent and updates dropped; thread-safe (async-sgd's server thread adds to it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hist: collections.Counter[int] = collections.Counter()
        self.bytes_sent = 0
        self.dropped = 0

    def staleness(self, s: int) -> None:
        with self.lock:
            self.hist[int(s)] += 1

    def sent(self, nbytes: int) -> None:
        with self.lock:
            self.bytes_sent += nbytes

    def summary(self) -> dict[str, Any]:
        with self.lock:
            count = sum(self.hist.values())
            mean = sum(k * v for k, v in self.hist.items()) / count if count else 0.0
            return {"staleness_hist": {str(k): v for k, v in sorted(self.hist.items())}, "staleness_mean": mean,
                    "staleness_max": max(self.hist, default=0), "dropped": self.dropped, "bytes_sent": self.bytes_sent}


@dataclass
class Peers:
    """Rank 0's view of every worker: the latest header each sent (step, loss, rss, tokens done)."""

    world: int
    last: dict[int, list[float]] = field(default_factory=dict)

    def update(self, worker: int, header: list[float]) -> None:
        self.last[worker] = header

    def losses(self) -> list[float]:
        return [h[2] for h in self.last.values()]

    def tokens(self) -> float:
        return sum(h[4] for h in self.last.values())

    def rss(self, worker: int) -> int:
        return int(self.last.get(worker, [0.0] * HEADER)[3])


@dataclass
class Ctx:
    req: RankRequest
    model: Any
    flat: FlatParams
    windows: Any
    rank: int
    world: int
    token_flops: float
    peak: float
    emit: Any                     # protocol.emit_event(run_dir, event)
    stats: Stats = field(default_factory=Stats)
    lr: float = 0.0
    steps_done: int = 0
    t0: float = field(default_factory=time.perf_counter)
    window: tuple[float, float] = (0.0, 0.0)   # (time, tokens) at the last log
    comm_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        from lmforge.components.training.protocol import straggler_delay

        self.peers = Peers(self.world)
        self.window = (self.t0, 0.0)
        self.last_loss = float("nan")
        self.delay = straggler_delay(self.rank)  # > 0 only when a benchmark slows this rank on purpose

    @property
    def cfg(self) -> Any:
        return self.req.training

    @property
    def tokens_per_worker_step(self) -> int:
        return self.req.layout.micro * self.req.layout.accum * self.cfg.seq_len

    # -- the worker's own computation --------------------------------------------------------------
    def local_grad(self, step: int) -> float:
        """This worker's gradient for `step` in flat.grad (accumulated over micro-batches, scaled by 1/accum as
        DeepSpeed's engine scales it); returns the mean micro-batch loss."""
        from lmforge.components.training.pipeline_model import lm_loss

        lay = self.req.layout
        self.flat.grad.zero_()
        total = 0.0
        mbs = self.windows.micro_batches(step, dp_rank=self.rank, dp_size=self.world, micro=lay.micro, accum=lay.accum)
        for x, y in mbs:
            loss = lm_loss(self.model(input_ids=x, use_cache=False).logits, y)
            (loss / len(mbs)).backward()
            total += float(loss.detach())
        if step == 0:
            self.flat.check_grads()
        if self.delay:
            time.sleep(self.delay)
        self.steps_done += 1
        return total / len(mbs)

    def local_optimizer(self, weights: torch.Tensor | None = None) -> tuple[Any, Any]:
        """AdamW and DeepSpeed's WarmupCosineLR with the run's settings (the generated config's), over `weights`
        (default this worker's own flat weights) as one parameter whose gradient is flat.grad."""
        from deepspeed.runtime.lr_schedules import WarmupCosineLR

        ds = self.req.ds_config
        p = ds["optimizer"]["params"]
        param = torch.nn.Parameter(self.flat.data if weights is None else weights, requires_grad=False)
        opt = torch.optim.AdamW([param], lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"], weight_decay=p["weight_decay"])
        sched = WarmupCosineLR(opt, **ds["scheduler"]["params"])
        return opt, sched

    def clip_and_step(self, opt: Any, sched: Any, grad: torch.Tensor | None = None) -> float:
        """One optimizer step with `grad` (default flat.grad), clipped to the run's norm; returns the norm."""
        param = opt.param_groups[0]["params"][0]
        param.grad = self.flat.grad if grad is None else grad
        clip = self.cfg.grad_clip
        norm = float(torch.nn.utils.clip_grad_norm_([param], clip)) if clip > 0 else float(param.grad.norm())
        self.lr = float(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        param.grad = None
        return norm

    # -- messages (gloo: CPU tensors) ---------------------------------------------------------------
    def header(self, *, step: int, loss: float, version: int = 0, staleness: int = 0) -> torch.Tensor:
        from lmforge.components.training.memory import host_rss_bytes

        return torch.tensor([step, version, loss, host_rss_bytes(), self.steps_done * self.tokens_per_worker_step,
                             staleness, 0, 0], dtype=torch.float64)

    def send(self, t: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        dist.send(t.contiguous(), dst)
        self.stats.sent(t.numel() * t.element_size())

    def recv(self, into: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        dist.recv(into, src)
        if self.rank == 0:  # every message goes through the server: what it receives is what a worker sent
            self.stats.sent(into.numel() * into.element_size())

    def send_header(self, h: torch.Tensor, dst: int) -> None:
        self.send(h, dst)

    def recv_header(self, src: int) -> list[float]:
        h = torch.empty(HEADER, dtype=torch.float64)
        self.recv(h, src)
        return h.tolist()

    # -- what rank 0 logs -------------------------------------------------------------------------------
    def memory(self, *, server_extra: int, worker_optimizer: bool) -> list[dict[str, Any]]:
        """Per-rank model-state bytes (fp32 weights, gradient, Adam's two moments where the rank steps) and RSS."""
        from lmforge.components.training.memory import host_rss_bytes

        n = self.flat.nbytes
        rows = []
        for r in range(self.world):
            opt = 2 * n if (r == 0 or worker_optimizer) else 0
            params = n + (server_extra if r == 0 else 0)
            rss = host_rss_bytes() if r == 0 else self.peers.rss(r)
            rows.append({"params": params, "grads": n, "optimizer": opt, "total": params + n + opt, "rss": rss,
                         "device_peak": 0, "idle_fraction": 0.0})
        return rows

    def log(self, done: int, loss: float, *, losses: list[float] | None = None, tokens: float | None = None,
            server_extra: int = 0, worker_optimizer: bool = False, force: bool = False) -> None:
        """Rank 0: one event after `done` steps, with every worker's latest loss and tokens."""
        from lmforge.components.training.perf import mfu

        cfg = self.cfg
        if self.rank != 0 or not (force or done % cfg.log_every == 0 or done == cfg.max_steps or done == 1):
            return
        every = losses if losses is not None else [loss, *self.peers.losses()]
        tokens_done = tokens if tokens is not None else self.steps_done * self.tokens_per_worker_step + self.peers.tokens()
        now = time.perf_counter()
        t_last, tok_last = self.window
        tps = max(0.0, tokens_done - tok_last) / max(now - t_last, 1e-9)
        self.window = (now, tokens_done)
        summary = self.stats.summary()
        ps = {"strategy": cfg.parallel.strategy, "workers": self.world, "elapsed_s": now - self.t0,
              "tokens": tokens_done, "bytes_sent_per_step": summary["bytes_sent"] / max(done, 1), **summary}
        self.last_loss = sum(every) / len(every)
        self.emit(self.req.run_dir, {
            "step": done, "loss": sum(every) / len(every), "lr": self.lr, "tokens_per_s": tps,
            "step_s": (now - self.t0) / max(done, 1), "mfu": mfu(tokens_per_s=tps, flops_per_token=self.token_flops,
                                                                 peak_flops=self.peak),
            "peak_flops": self.peak, "flops_per_token": self.token_flops,
            "memory": self.memory(server_extra=server_extra, worker_optimizer=worker_optimizer),
            "attempt": self.req.attempt, "max_steps": cfg.max_steps, "ps": ps})
