"""The OpenAI gateway's Prometheus metrics (GET /metrics): vLLM's names and buckets with lmforge's prefix, and the
HTTP side, counted by an ASGI middleware.

    metrics = Metrics("lmforge")
    app.add_middleware(Metered, metrics=metrics)      # requests by endpoint and status, requests running
    metrics.finished(final, started)                  # a request's tokens, TTFT, TPOT and latency
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from lmforge.deploy.openai_protocol import GENERATING, ROUTES, ApiError

# vLLM's buckets, so that dashboards built for vLLM read these alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    """The gateway's Prometheus metrics, in a registry of its own (one per app). vLLM's names with lmforge's prefix
    (`vllm:time_to_first_token_seconds` is `lmforge:time_to_first_token_seconds` here), labelled with model_name as
    vLLM's are, plus the HTTP side: requests by endpoint and status, errors by endpoint, status and OpenAI code."""

    def __init__(self, model: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.model, self.registry = model, CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.http = Counter("lmforge:http_requests", "HTTP requests answered, by endpoint and status",
                            ["endpoint", "status"], registry=r)
        self.errors = Counter("lmforge:request_errors", "errors answered (a status >= 400, or an error event that "
                              "ends a stream), by endpoint, status and OpenAI error code", ["endpoint", "status", "code"],
                              registry=r)
        self.running = Gauge("lmforge:num_requests_running", "completion and chat requests in flight at the gateway",
                             m, registry=r)
        self.ttft = Histogram("lmforge:time_to_first_token_seconds", "from the request's arrival at the gateway to "
                              "its first token", m, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("lmforge:time_per_output_token_seconds", "the model's decoding time per output token "
                              "after the first", m, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("lmforge:e2e_request_latency_seconds", "from the request's arrival at the gateway to its "
                             "final response", m, buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("lmforge:prompt_tokens", "prompt tokens of the requests answered", m, registry=r)
        self.generation_tokens = Counter("lmforge:generation_tokens", "tokens generated for the requests answered", m,
                                         registry=r)
        self.success = Counter("lmforge:request_success", "requests answered in full, by finish reason",
                               ["model_name", "finish_reason"], registry=r)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def finished(self, final: dict[str, Any], started: float) -> None:
        """A request's final response: its tokens, finish reason, latency, TTFT (the gateway's elapsed time less the
        model's decoding span) and TPOT (that span per token after the first)."""
        elapsed, out = time.perf_counter() - started, final["output_tokens"]
        decode_s = (final.get("decode_ms") or 0.0) / 1e3
        self.prompt_tokens.labels(self.model).inc(final["prompt_tokens"])
        self.generation_tokens.labels(self.model).inc(out)
        self.success.labels(self.model, final["finish_reason"]).inc()
        self.e2e.labels(self.model).observe(elapsed)
        if out >= 1:
            self.ttft.labels(self.model).observe(max(0.0, elapsed - decode_s))
        if out >= 2 and final.get("decode_ms") is not None:
            self.tpot.labels(self.model).observe(decode_s / (out - 1))

    def failed(self, path: str, error: ApiError) -> None:
        self.errors.labels(endpoint(path), str(error.status), error.code or error.kind).inc()


def endpoint(path: str) -> str:
    """The endpoint label of a path: a route of this gateway, or "other" (so an unknown path adds no series)."""
    return path if path in ROUTES else "other"


class Metered:
    """ASGI middleware: every HTTP request counted by endpoint and status once its answer is sent (a stream's at its
    end), and the completion and chat requests in flight."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500   # no response started: the server's error handler answers 500 outside this middleware

        async def sent(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        path = endpoint(scope["path"])
        running = self.metrics.running.labels(self.metrics.model)
        with running.track_inprogress() if path in GENERATING else contextlib.nullcontext():
            try:
                await self.app(scope, receive, sent)
            finally:
                self.metrics.http.labels(path, str(status)).inc()

