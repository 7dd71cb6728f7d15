"""Latency of generation: time to first token, time per output token, tokens per second.

    t = RowTiming(ttft_s=0.05, total_s=0.41, tokens=12)
    summarize([t, ...], wall_s=1.3)   # {"ttft_ms", "tpot_ms", "tokens_per_s", "generated_tokens"}

TTFT is the time from a request's batch starting to its first token (prefill plus one
step). TPOT is the time between its later tokens: (total - ttft) / (tokens - 1), over
requests that produced at least two tokens. Tokens/s is throughput: all generated
tokens over the wall time of all batches, so batching shows up in it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RowTiming:
    ttft_s: float
    total_s: float
    tokens: int

    @property
    def tpot_s(self) -> float | None:
        return (self.total_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


def summarize(timings: Sequence[RowTiming], *, wall_s: float) -> dict[str, float]:
    if not timings:
        return {"ttft_ms": math.nan, "tpot_ms": math.nan, "tokens_per_s": math.nan, "generated_tokens": 0.0}
    tpots = [t.tpot_s for t in timings if t.tpot_s is not None]
    tokens = sum(t.tokens for t in timings)
    return {
        "ttft_ms": 1000.0 * sum(t.ttft_s for t in timings) / len(timings),
        "tpot_ms": 1000.0 * sum(tpots) / len(tpots) if tpots else math.nan,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else math.nan,
        "generated_tokens": float(tokens),
    }
