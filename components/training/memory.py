"""What a DeepSpeed engine holds on this rank: parameters, gradients, optimizer states.

    held = model_state_bytes(engine)     # {"params": .., "grads": .., "optimizer": .., "total": ..}
    rss = host_rss_bytes()
    peak = host_peak_rss_bytes()         # the process's high-water mark

Counted from the tensors themselves: the module's parameters (their ZeRO-3 partitions),
their gradients, and every tensor reachable from the ZeRO/bf16 optimizer wrapper and its
inner optimizer's state (fp32 master copies, Adam moments, flat gradient partitions).
Views into one flat buffer share a storage and count once.
"""

from __future__ import annotations

from typing import Any

import torch


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _walk(obj: Any, out: list[torch.Tensor], seen: set[int], depth: int = 0) -> None:
    if depth > 4 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, out, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, out, seen, depth + 1)


def _sum(tensors: list[torch.Tensor], counted: set[tuple[int, int]]) -> int:
    total = 0
    for t in tensors:
        if t.device.type == "meta" or t.numel() == 0:
            continue
        key = _storage_key(t)
        if key[0] == 0 or key in counted:
            continue
        counted.add(key)
        total += key[1]
    return total


def model_state_bytes(engine: Any) -> dict[str, int]:
    counted: set[tuple[int, int]] = set()
    params = list(engine.module.parameters())
    held = [getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p.data for p in params]
    n_params = _sum([t for t in held if t is not None], counted)
    n_grads = _sum([p.grad for p in params if p.grad is not None], counted)
    opt = engine.optimizer
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    if opt is not None:
        inner = getattr(opt, "optimizer", opt)
        _walk(getattr(inner, "state", {}), found, seen)
        for value in vars(opt).values():
            _walk(value, found, seen)
    n_opt = _sum(found, counted)
    return {"params": n_params, "grads": n_grads, "optimizer": n_opt, "total": n_params + n_grads + n_opt}


def host_rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def host_peak_rss_bytes() -> int:
    """This process's peak resident set (getrusage ru_maxrss, KiB on Linux)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def device_peak_bytes() -> int | None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return None
