"""The serving benchmark's load generator: closed-loop streaming clients in one asyncio process, and its statistics.

    work = workload("fixed", 256)                         # (prompt, max_tokens) pairs: 64 tokens each, or 8..64 mixed
    async with aiohttp.ClientSession(...) as session:
        point = await closed_loop(openai_sender(session, base_url, "lmforge"), work, concurrency=32)
    point["tokens_per_s"], point["ttft_p99_ms"], point["gen_cpu_pct"]      # ... and errors, TPOT p50/p99
    summary = spread([p["tokens_per_s"] for p in repeats])                  # {"median", "min", "max", "n"}
    ratio = paired_ratio(served, baseline)                                  # the same, of repeat-paired quotients

One asyncio task per client: a client sends one streaming request, reads its events as they arrive and sends the
next when its stream ends (closed loop). Every sender answers `Done(tokens, ttft_s, total_s)`: output tokens (the
server's own count), the time from the send to the first piece of text, and to the end. TPOT is a request's time
after its first piece per token after the first.

Why this and not aiperf: aiperf 0.13.0 (NVIDIA's, on the registry) took ~85% of one of the 2 shared cores at c = 32
here (../shared/DESIGN.md §9), so its figures measured itself as much as the server. One event loop with aiohttp
(a C HTTP parser; one task per client, no thread per client) costs a few percent of a core at the same load, and
its cost is measured for every point: `gen_cpu_pct` is this process's CPU time (resource.getrusage: every thread,
gRPC's included) over the point's wall time. For the in-process engine, whose threads share this process,
`loop_cpu_pct` (the event loop thread's own CPU time) is the generator's part.
"""

from __future__ import annotations

import asyncio
import json
import resource
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

# Signatures in the style of the demo corpus (the docstring task's prompts).
PROMPTS = [
    "def dumps(obj, *, skipkeys=False, ensure_ascii=True, indent=None):",
    "def join(a, *p):",
    "def getsource(object):",
    "def create_connection(address, timeout=None, source_address=None):",
    "class OrderedDict(dict):",
    "def literal_eval(node_or_string):",
    "def urlsplit(url, scheme='', allow_fragments=True):",
    "def sha256(data=b''):",
    "def loads(s, *, cls=None, object_hook=None, parse_float=None):",
    "def splitext(p):",
    "def getmembers(object, predicate=None):",
    "def dedent(text):",
    "def deepcopy(x, memo=None, _nil=[]):",
    "def urlencode(query, doseq=False, safe='', encoding=None, errors=None):",
    "class Counter(dict):",
    "def b64encode(s, altchars=None):",
    "def gethostbyname(host):",
    "def fnmatch(name, pat):",
    "def dump(obj, fp, *, skipkeys=False, indent=None):",
    "def shuffle(self, x):",
]
FIXED_TOKENS = 64
WORKLOADS = ("fixed", "mixed")


@dataclass(frozen=True)
class Done:
    tokens: int      # output tokens, as the server counts them
    ttft_s: float    # send to the first piece of text
    total_s: float   # send to the end of the stream


Send = Callable[[str, int], Awaitable[Done]]


def workload(kind: str, n: int, fixed_tokens: int = FIXED_TOKENS) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs, the prompts in turn: `fixed_tokens` each, or (mixed) 8..64 in a fixed order."""
    if kind not in WORKLOADS:
        raise ValueError(f"workload {kind!r}: one of {WORKLOADS}")
    return [(PROMPTS[i % len(PROMPTS)], fixed_tokens if kind == "fixed" else 8 + (i * 37) % 57) for i in range(n)]


async def closed_loop(send: Send, work: list[tuple[str, int]], concurrency: int) -> dict[str, Any]:
    """`concurrency` clients share `work` (each takes the next request when its last one ends); throughput, latency
    percentiles, errors and the generator's CPU."""
    pending = iter(work)
    done: list[Done] = []
    errors: list[str] = []

    async def client() -> None:
        for prompt, max_tokens in pending:   # one event loop: next() is never raced
            try:
                done.append(await send(prompt, max_tokens))
            except Exception as e:  # counted and shown: a refused or failed request is a finding
                errors.append(f"{type(e).__name__}: {e}"[:200])

    cpu, loop_cpu, start = process_cpu_s(), time.thread_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {"concurrency": concurrency, "errors": len(errors), "error_sample": errors[:3], **point_stats(done, elapsed),
            "gen_cpu_pct": 100 * (process_cpu_s() - cpu) / elapsed,
            "loop_cpu_pct": 100 * (time.thread_time() - loop_cpu) / elapsed}


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def point_stats(done: list[Done], elapsed: float) -> dict[str, Any]:
    """Output tokens/s over the point's wall time; TTFT and TPOT p50/p99 in ms; the mean output length."""
    ttft = [d.ttft_s * 1e3 for d in done]
    tpot = [(d.total_s - d.ttft_s) / (d.tokens - 1) * 1e3 for d in done if d.tokens > 1]
    tokens = sum(d.tokens for d in done)
    return {"requests": len(done), "seconds": elapsed, "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "mean_tokens": tokens / len(done) if done else float("nan"),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99)}


def spread(values: list[float]) -> dict[str, float]:
    """Median and range of a measure over repeats."""
    vals = [v for v in values if v == v]
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": float(statistics.median(vals)), "min": min(vals), "max": max(vals), "n": len(vals)}


def paired_ratio(served: dict[int, float], baseline: dict[int, float]) -> dict[str, float]:
    """served / baseline of the same repeat (repeat -> value), summarised by `spread`: a load that drifts through a
    run moves both sides of a pair alike."""
    return spread([served[r] / baseline[r] for r in sorted(served) if r in baseline and baseline[r] > 0])


def fmt_spread(s: dict[str, float], digits: int = 0, suffix: str = "") -> str:
    if not s["n"]:
        return "-"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])}{suffix} ({f.format(s['min'])}–{f.format(s['max'])})"


# --- senders -----------------------------------------------------------------------------

def completion_body(model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    return {**body, "ignore_eos": True} if ignore_eos else body


def openai_sender(session: Any, base_url: str, model: str, *, ignore_eos: bool = True) -> Send:
    """POST {base_url}/completions with stream: true through an aiohttp session; the usage chunk gives the count."""
    url = base_url.rstrip("/") + "/completions"

    async def send(prompt: str, max_tokens: int) -> Done:
        start, first, tokens = time.perf_counter(), None, None
        async with session.post(url, json=completion_body(model, prompt, max_tokens, ignore_eos)) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:160]}")
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", chunk["error"]))
                if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        end = time.perf_counter()
        if tokens is None:
            raise RuntimeError("the stream ended without a usage chunk")
        return Done(tokens, (first or end) - start, end - start)
    return send


def grpc_sender(client: Any, model: str, *, ignore_eos: bool = True) -> Send:
    """Triton's gRPC stream (a tritonclient.grpc.aio client, one channel), the model's contract as the gateway
    sends it: the same inputs and response parsing (deploy/openai_triton.py), without HTTP and server-sent events."""
    from lmforge.deploy.openai_triton import to_reply, triton_inputs

    async def send(prompt: str, max_tokens: int) -> Done:
        settings = {"max_tokens": max_tokens, "temperature": 0, **({"ignore_eos": True} if ignore_eos else {})}
        request = {"model_name": model, "inputs": triton_inputs(prompt, settings, stream=True),
                   "request_id": uuid.uuid4().hex}

        async def one() -> Any:
            yield request
        start, first, done = time.perf_counter(), None, None
        async for result, error in client.stream_infer(one()):   # read to its end: the call closes cleanly
            if error is not None:
                raise RuntimeError(error.message())
            reply = to_reply(result)
            if first is None and reply.text:
                first = time.perf_counter()
            if reply.final is not None:
                end = time.perf_counter()
                done = Done(reply.final["output_tokens"], (first or end) - start, end - start)
        if done is None:
            raise RuntimeError("the stream ended without a final response")
        return done
    return send
