"""Blocking gRPC streaming clients on threads, for the benchmarks that load one Triton server with a few clients
(bench_onnx_serve.py; bench_engine.py takes PROMPTS and the demo model): bench_serve.py's load generator is the
asyncio one in loadgen.py.

    send = triton_sender(info.grpc_url, "lmforge")         # send(prompt, max_tokens) -> (tokens, ttft s, total s)
    point = run_point(send, concurrency=8, requests=64)     # loadgen.point_stats, errors; closed loop on threads
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import serve_models
from benchmarks.loadgen import PROMPTS, Done, point_stats, workload

__all__ = ["PROMPTS", "build_model", "run_point", "triton_sender"]

SyncSend = Callable[[str, int], tuple[int, float, float]]


def build_model(out: Path) -> Path:
    """The demo-shaped random Llama (serve_models.build("demo"))."""
    return serve_models.build("demo", out)


def triton_sender(url: str, model: str) -> SyncSend:
    """One greedy streamed request over gRPC (lmforge.deploy.client); (output tokens, s to the first text, s to end)."""
    from lmforge.deploy import client

    def send(prompt: str, max_tokens: int) -> tuple[int, float, float]:
        params = client.Params(max_tokens=max_tokens)
        start, first, tokens = time.perf_counter(), None, 0
        for _, response in client.stream_requests(url, [client.grpc_inputs(prompt, stream=True, params=params)],
                                                  model=model, timeout=600):
            if first is None and client.response_text(response):
                first = time.perf_counter()
            if (details := client.response_details(response)) is not None:
                tokens = int(details["output_tokens"])
        end = time.perf_counter()
        return tokens, (first or end) - start, end - start
    return send


def run_point(send: SyncSend, concurrency: int, requests: int) -> dict[str, Any]:
    """`concurrency` client threads share max(requests, 2 x concurrency) mixed-length requests (closed loop)."""
    work = iter(workload("mixed", max(requests, 2 * concurrency)))
    lock = threading.Lock()
    done: list[Done] = []
    errors: list[str] = []

    def client_loop() -> None:
        while True:
            with lock:
                item = next(work, None)
            if item is None:
                return
            try:
                result = Done(*send(*item))
            except Exception as e:  # counted and shown: a refused or failed request is a finding
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                continue
            with lock:
                done.append(result)
    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"concurrency": concurrency, "errors": len(errors), "error_sample": errors[:3],
            **point_stats(done, time.perf_counter() - start)}
