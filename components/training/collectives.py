"""The collectives a rank hands tensors to, every tensor made on the engine's device (components/training/rank.py).

    comms = DeviceCollectives(engine.device, world=dist.get_world_size())
    per_rank = memory_rows(comms.gather_floats([float(v) for v in mine]))   # MEMORY_KEYS, one dict a rank
"""

from __future__ import annotations

from typing import Any

import torch


class DeviceCollectives:
    """Every tensor this rank hands to torch.distributed is made here, on the engine's device.

        comms = DeviceCollectives(engine.device, world=dist.get_world_size())
        loss = comms.mean(step_loss)                 # one all_reduce and one host read
        per_rank = comms.gather_floats([1.0, 2.0])   # [[1.0, 2.0], [..]] from every rank

    NCCL has no CPU backend ("No backend type associated with device type cpu"), so a CPU
    tensor in a collective only fails on a GPU machine; building them in one place keeps the
    rank loop from creating one by accident. `host` is the only device-to-host read.
    """

    def __init__(self, device: torch.device | str, *, world: int) -> None:
        self.device, self.world = torch.device(device), world

    def tensor(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64, device=self.device)

    def _check(self, t: torch.Tensor) -> torch.Tensor:
        assert t.device == self.device, f"collective on {t.device}, engine on {self.device}"
        return t

    def host(self, t: torch.Tensor) -> list[float]:
        return t.detach().cpu().tolist()

    def mean(self, value: torch.Tensor) -> float:
        """The mean over ranks of a scalar that lives on the device."""
        import torch.distributed as dist

        t = self._check(value.detach().to(self.device, torch.float64).reshape(1))
        dist.all_reduce(t)
        return self.host(t)[0] / self.world

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        import torch.distributed as dist

        mine = self._check(self.tensor(values))
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [self.host(t) for t in out]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Small picklable objects (the RNG states at a checkpoint). torch moves them through the
        current device under NCCL, which the rank set with torch.cuda.set_device before init."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


# rss_peak: the process's high-water mark (getrusage); nvme: bytes in this rank's NVMe swap files (components/training/nvme.py)
MEMORY_KEYS = ("params", "grads", "optimizer", "total", "rss", "device_peak", "idle_fraction", "rss_peak", "nvme")


def memory_rows(rows: list[list[float]]) -> list[dict[str, Any]]:
    """Per-rank memory figures from gathered float rows: byte counts back to ints."""
    return [{k: (v if k == "idle_fraction" else int(v)) for k, v in zip(MEMORY_KEYS, row, strict=True)} for row in rows]
