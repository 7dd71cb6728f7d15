"""The short training loop that recovery fine-tunes, distillation and LoRA share.

    tuner = Finetuner(FinetuneConfig(), shard_dir=ws.training_shards(v), seed=0)
    losses = tuner.run(model, steps=20)                                  # causal-LM CE
    losses = tuner.run(student, steps=50, loss_fn=distill_loss(teacher, T=2.0, alpha=0.5))
    losses = tuner.run(model, steps=30, data_fraction=0.25)             # a leading slice of the data

Batches come from the training stage's loader (components.training.data.TokenWindows),
a function of (seed, step), so a run is reproducible. The loop itself is plain PyTorch
on one process: the compression fine-tunes are tens of steps on a model that is already
trained, where launching DeepSpeed ranks would cost more than the steps themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.components.errors import UserError
from lmforge.components.sections.compression import FinetuneConfig
from lmforge.components.training.data import TokenWindows

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; `y` is `x` shifted by one."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


class Finetuner:
    def __init__(self, cfg: FinetuneConfig, *, shard_dir: Path, seed: int = 0, split: str = "train") -> None:
        self.cfg, self.seed = cfg, seed
        self.windows = TokenWindows.open(Path(shard_dir), seq_len=cfg.seq_len, seed=seed, split=split)

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
        opt = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        old_threads = torch.get_num_threads()
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        model.train()
        losses = []
        try:
            for step in range(steps):
                x, y = self.batch(step, data_fraction=data_fraction)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16):
                    loss = loss_fn(model, x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                losses.append(float(loss.detach()))
        finally:
            model.eval()
            torch.set_num_threads(old_threads)
        if not all(np.isfinite(losses)):
            raise UserError("compression.finetune.lr", self.cfg.lr, f"made the loss diverge ({losses[-1]})",
                            "Lower compression.finetune.lr")
        return losses
