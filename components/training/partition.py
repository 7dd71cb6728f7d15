"""Cut a pipeline's block sequence into chunks by measured cost, and place the chunks on ranks.

    costs = measure_block_costs(blocks, input_ids, labels)   # seconds of forward + backward per block (rank 0)
    bounds = partition_by_cost(costs, parts=4)                # [0, b1, b2, b3, n]: the slowest chunk as fast as it can be
    stage_to_rank(3, p=2, placement="v")                      # 0: a V puts stages r and 2p-1-r on rank r
    print(describe_partition(bounds, costs, names, p=2, placement="v"))

DeepSpeed's PipelineModule partitions by parameter or layer count (its `profile` method raises
NotImplementedError), so the torch schedules (schedules.py) partition here instead.
"""

from __future__ import annotations

import time
from typing import Any


def partition_by_cost(costs: list[float], parts: int) -> list[int]:
    """Boundaries [0, b1, ..., n] splitting `costs` into `parts` non-empty contiguous chunks with the smallest
    possible slowest chunk (exact: dynamic programming over split points). Ties go to the earliest boundaries."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} blocks into {parts} non-empty chunks")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest slowest chunk splitting the first i blocks into k chunks; cut[k][i] its last boundary.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cand = max(best[k - 1][j], prefix[i] - prefix[j])
                if cand < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = cand, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def measure_block_costs(blocks: list[Any], input_ids: Any, labels: Any, *, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward of each block on one micro-batch (median of `repeats` after a warm-up).

    Each block runs on the previous block's (detached) output, so a block's time is its own; the
    last block's backward starts from the LM loss, as in training. Gradients made here are dropped.
    """
    import torch

    from lmforge.components.training.pipeline_model import lm_loss

    def sync() -> None:
        if input_ids.device.type == "cuda":
            torch.cuda.synchronize(input_ids.device)

    samples: list[list[float]] = [[] for _ in blocks]
    for rep in range(repeats + 1):
        x = input_ids
        for i, block in enumerate(blocks):
            inp = x.detach().requires_grad_(x.is_floating_point())
            sync()
            t0 = time.perf_counter()
            out = block(inp)
            loss = lm_loss(out, labels) if i == len(blocks) - 1 else out.float().pow(2).mean()
            loss.backward()
            sync()
            if rep:
                samples[i].append(time.perf_counter() - t0)
            x = out
    for block in blocks:
        for p in block.parameters():
            p.grad = None
    return [sorted(s)[len(s) // 2] for s in samples]


def stage_to_rank(stage: int, *, p: int, placement: str) -> int:
    """The pipeline rank holding `stage`: a loop (s mod p) or a V (s < p: s; else 2p - 1 - s)."""
    if placement == "loop":
        return stage % p
    return stage if stage < p else 2 * p - 1 - stage


def describe_partition(bounds: list[int], costs: list[float], names: list[str], *, p: int, placement: str) -> str:
    """One line per chunk: its stage, rank, blocks and measured cost."""
    lines = []
    for s in range(len(bounds) - 1):
        lo, hi = bounds[s], bounds[s + 1]
        cost = sum(costs[lo:hi])
        lines.append(f"stage {s} (rank {stage_to_rank(s, p=p, placement=placement)}): blocks {lo}-{hi - 1} "
                     f"[{', '.join(names[lo:hi])}] {cost * 1e3:.2f} ms")
    return "\n".join(lines)
