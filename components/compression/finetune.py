"""The short training loop that recovery fine-tunes, distillation and LoRA share.

    tuner = Finetuner(FinetuneConfig(), shard_dir=ws.training_shards(v), seed=0)
    tuner.device, tuner.precision                                        # cuda/cpu; bf16/fp32 and why
    losses = tuner.run(model, steps=20)                                  # causal-LM CE
    losses = tuner.run(student, steps=50, loss_fn=distill_loss(teacher, T=2.0, alpha=0.5))
    losses = tuner.run(model, steps=30, data_fraction=0.25)             # a leading slice of the data

Batches come from the training stage's loader (components.training.batches.TokenWindows),
a function of (seed, step), so a run is reproducible. The loop itself is plain PyTorch
on one process: the compression fine-tunes are tens of steps on a model that is already
trained, where launching DeepSpeed ranks would cost more than the steps themselves.

It runs on the device components/runtime/accelerator.py picks (the GPU when there is one; the model
goes there for the run and comes back after), in the precision it resolves: `bf16` unset
means bf16 autocast only where bf16 is really faster. `threads` applies to CPU runs only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.components.errors import UserError
from lmforge.components.runtime.accelerator import autocast, choose_precision, on_device, pick_device, to_device
from lmforge.components.sections.compression import FinetuneConfig
from lmforge.components.training.batches import TokenWindows

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; `y` is `x` shifted by one."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


class Finetuner:
    def __init__(self, cfg: FinetuneConfig, *, shard_dir: Path, seed: int = 0, split: str = "train",
                 device: torch.device | str | None = None) -> None:
        self.cfg, self.seed = cfg, seed
        self.windows = TokenWindows.open(Path(shard_dir), seq_len=cfg.seq_len, seed=seed, split=split)
        self.device = torch.device(device) if device is not None else pick_device()
        self.precision = choose_precision("auto" if cfg.bf16 is None else "bf16" if cfg.bf16 else "fp32", self.device)

    def batch(self, step: int, *, data_fraction: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.windows
        if data_fraction < 1.0:
            n = max(int(len(windows.tokens) * data_fraction), self.cfg.seq_len + 1)
            windows = TokenWindows(windows.tokens[:n], self.cfg.seq_len, self.seed)
        b = self.cfg.batch_size
        return windows.batch(windows.window_ids(step * b, b))

    def run(self, model: nn.Module, *, steps: int, loss_fn: LossFn = lm_loss, data_fraction: float = 1.0,
            params: list[nn.Parameter] | None = None) -> list[float]:
        """Train `params` (default: every parameter that requires grad) for `steps`; return the losses."""
        if steps <= 0:
            return []
        params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
        assert params, "nothing to train"
        old_threads = torch.get_num_threads()
        if self.cfg.threads and self.device.type == "cpu":
            torch.set_num_threads(self.cfg.threads)
        model.train()
        losses: list[torch.Tensor] = []
        try:
            with on_device(model, self.device):
                # Built after the move: AdamW's states live beside the parameters (fused on CUDA).
                opt = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
                                        fused=self.device.type == "cuda")
                for step in range(steps):
                    x, y = (to_device(t, self.device) for t in self.batch(step, data_fraction=data_fraction))
                    with autocast(self.device, self.precision):
                        loss = loss_fn(model, x, y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                    opt.step()
                    losses.append(loss.detach().float())
                values = torch.stack(losses).tolist()  # one read from the device, after the loop
                del opt
        finally:
            model.eval()
            torch.set_num_threads(old_threads)
        if not all(np.isfinite(values)):
            raise UserError("compression.finetune.lr", self.cfg.lr, f"made the loss diverge ({values[-1]})",
                            "Lower compression.finetune.lr")
        return values
