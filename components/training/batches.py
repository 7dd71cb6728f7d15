"""Deterministic training batches: a pure function of (seed, step, data-parallel rank).

    windows = TokenWindows.open(ws.training_shards(version), seq_len=128, seed=0)
    for x, y in windows.micro_batches(step, dp_rank=0, dp_size=2, micro=8, accum=2): ...

The flat train token array is cut into windows of seq_len + 1 tokens (inputs and shifted
targets). Each epoch visits the windows in a permutation seeded by (seed, epoch). Global
batch `step` is windows [step*G, (step+1)*G) of that endless order, G = micro x accum x
dp_size, and rank r takes its contiguous slice. So the data position is the step alone:
resuming needs only the step, and the global batch is the same for any split of it over
ranks, which is what makes DDP and ZeRO losses comparable step for step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmforge.components.data.shards import open_shard, read_index
from lmforge.components.errors import UserError


def epoch_order(n: int, *, seed: int, start: int, count: int) -> np.ndarray:
    """Items at positions [start, start + count) of the endless order that visits n items once per epoch,
    each epoch in the permutation seeded by (seed, epoch)."""
    out = np.empty(count, dtype=np.int64)
    pos, filled = start, 0
    while filled < count:
        epoch, offset = divmod(pos, n)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        take = min(n - offset, count - filled)
        out[filled:filled + take] = perm[offset:offset + take]
        filled += take
        pos += take
    return out


@dataclass(frozen=True)
class TokenWindows:
    tokens: np.ndarray
    seq_len: int
    seed: int

    @classmethod
    def open(cls, shard_dir: Path, *, seq_len: int, seed: int, split: str = "train") -> "TokenWindows":
        index = read_index(shard_dir)
        if split not in index["splits"]:
            raise UserError("shards", shard_dir, f"has no {split!r} split", "Re-run the data stage: lmforge run data")
        expected = index["splits"][split]["tokens"]
        path = Path(shard_dir) / f"{split}.bin"
        size = path.stat().st_size if path.is_file() else 0
        if size != expected * np.dtype(index["dtype"]).itemsize:
            raise UserError("shards", path, f"holds {size} bytes but its index says {expected} tokens (truncated?)",
                            "Re-run the data stage: lmforge run data")
        tokens = open_shard(shard_dir, split)
        windows = cls(tokens, seq_len, seed)
        if windows.n_windows < 1:
            raise UserError("training.seq_len", seq_len, f"is longer than the {split} split ({len(tokens)} tokens)",
                            "Lower training.seq_len or use more data")
        return windows

    @property
    def n_windows(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def window_ids(self, start: int, count: int) -> np.ndarray:
        """Window ids at positions [start, start + count) of the endless epoch-by-epoch order."""
        return epoch_order(self.n_windows, seed=self.seed, start=start, count=count)

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([np.asarray(self.tokens[i * self.seq_len:i * self.seq_len + self.seq_len + 1], dtype=np.int64)
                         for i in ids])
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def micro_batches(self, step: int, *, dp_rank: int, dp_size: int, micro: int, accum: int
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's `accum` micro-batches of `micro` windows for optimizer step `step`."""
        assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        per_rank = micro * accum
        ids = self.window_ids(step * per_rank * dp_size + dp_rank * per_rank, per_rank)
        return [self.batch(ids[i * micro:(i + 1) * micro]) for i in range(accum)]
