"""An OpenAI-compatible HTTP API in front of the served Triton model: a small gateway process (deploy/gateway.py).

    app = create_app("127.0.0.1:8001", "lmforge", ws.triton / "repo")     # FastAPI; Triton over gRPC (aio)
    python -m lmforge.deploy.openai_api --triton-grpc 127.0.0.1:8001 --model lmforge --repo <repo> --port 9000

    GET  /v1/models             the served model, in OpenAI's list shape
    POST /v1/completions        prompt (a string, or a list of one), max_tokens, temperature, top_p, seed, stop,
                                stream, stream_options.include_usage, logprobs (0..5) and echo as OpenAI's legacy
                                completions take them (max_tokens = 0 with echo); n = 1 only; top_k and ignore_eos as
                                extensions (vLLM's)
    POST /v1/chat/completions   messages, rendered by the model's chat template: only for a version whose task kind
                                (meta.json lmforge.task.kind) is "chat"
    GET  /metrics               Prometheus text: requests by endpoint and status, errors, TTFT and TPOT histograms,
                                prompt and generated tokens, requests running (Metrics; vLLM's names, `lmforge:`)
    GET  /health                200 while the process answers, with the id it was started with (gateway.py's probe)

Each request is one request of the model's vLLM-style contract (components/serving/triton_model.py): text_input
(a chat's messages as a JSON list), stream, sampling_parameters JSON; a setting left out takes the served model's default (greedy,
deploy.max_new_tokens). `logprobs: k` asks the model for each generated token's log-prob and its top k
alternatives (sampling_parameters.logprobs); `echo` with `logprobs` asks for the prompt's too (prompt_logprobs),
answered in OpenAI's shape (choices[0].logprobs: tokens, token_logprobs, top_logprobs, text_offset). `stream: true`
answers with server-sent events (OpenAI chunk objects, then `data: [DONE]`); a stream with logprobs or echo is
refused. A client that goes away cancels its Triton request (the gRPC call is cancelled).

Every error, a 404 for an unknown route, a 405 and a body that is not UTF-8 JSON included, has OpenAI's body,
{"error": {"message", "type", "param", "code"}}: a bad field 400 (the model's INVALID_ARG message passed through),
an unknown model 404, a busy model 503 with Retry-After, a failed generation 500. Triton's gRPC stream carries an
error's message but not its code, so the code is read from the model's own wording (triton_error).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

SETTINGS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")   # sampling_parameters keys
RETRY_AFTER_S = 1
MAX_LOGPROBS = 5    # OpenAI's legacy completions take logprobs 0..5
ROUTES = {"/v1/models": "GET", "/v1/completions": "POST", "/v1/chat/completions": "POST", "/metrics": "GET",
          "/health": "GET"}
GENERATING = ("/v1/completions", "/v1/chat/completions")
LOGPROB_PARAMS = {"logprobs": "logprobs", "prompt_logprobs": "echo"}   # the model's keys: the request's fields


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = dict(headers or {})
        if status == 503:
            self.headers["Retry-After"] = str(RETRY_AFTER_S)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def triton_error(message: str, *, prompt_param: str = "prompt") -> ApiError:
    """The model's error as an ApiError: busy or its engine failed (UNAVAILABLE) 503, failed generation (INTERNAL) 500,
    else a bad request (INVALID_ARG) 400 whose param is the setting the message starts with (text_input: the prompt
    or messages)."""
    if " is busy: " in message:
        return ApiError(503, message, code="model_busy", kind="server_error")
    if " is not ready: " in message:
        return ApiError(503, message, code="model_not_ready", kind="server_error")
    if message.startswith("generation failed"):
        return ApiError(500, message, code="generation_failed", kind="server_error")
    m = re.match(r"(?:sampling_parameters\.)?(\w+)", message)
    name = m.group(1) if m else None
    param = name if name in SETTINGS else prompt_param if name == "text_input" else LOGPROB_PARAMS.get(name or "")
    return ApiError(400, message, param=param, code="invalid_value")


def http_error(request: Request, exc: HTTPException) -> ApiError:
    """Starlette's own errors (an unknown route, a method a route does not take) as OpenAI's."""
    where = f"{request.method} {request.url.path}"
    served = ", ".join(f"{method} {path}" for path, method in ROUTES.items())
    if exc.status_code == 404:
        return ApiError(404, f"no route {where}; this gateway serves {served}", code="unknown_url")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow") or ROUTES.get(request.url.path, "")
        return ApiError(405, f"{request.url.path} does not take {request.method}; send {allowed}",
                        code="method_not_allowed", headers=dict(exc.headers or {}))
    kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return ApiError(exc.status_code, f"{where}: {exc.detail}", kind=kind, headers=dict(exc.headers or {}))


def field_error(errors: list[Any]) -> ApiError:
    """pydantic's (or FastAPI's) validation errors as OpenAI's 400, naming the first field that is wrong (param: its
    top-level field)."""
    err = errors[0] if errors else {"type": "json_invalid", "loc": (), "msg": "no body"}
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid" or not loc:
        return ApiError(400, f"the request body is not a valid JSON object ({err.get('msg')})", code="invalid_json")
    return ApiError(400, f"{'.'.join(loc)}: {err.get('msg')}", param=loc[0], code="invalid_value")


# --- requests -------------------------------------------------------------------------

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchema(BaseModel):
    name: str = "response"
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def structured(self) -> dict[str, Any] | None:
        """The model's structured_outputs constraint (vLLM's names), or None for text."""
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ApiError(400, "response_format.type is json_schema but response_format.json_schema is missing; "
                                    "send {\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                               param="response_format", code="invalid_value")
            return {"json": self.json_schema.schema_}
        return {"json": {"type": "object"}} if self.type == "json_object" else None


class Settings(Strict):
    """What both endpoints take; a field left out is the served model's default."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="not OpenAI's: an extension, as vLLM's server has it")
    ignore_eos: bool | None = Field(None, description="not OpenAI's: vLLM's extension, generate to max_tokens past "
                                                      "an end token (benchmarks' fixed output lengths)")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None   # accepted, unused
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = Field(None, description="not OpenAI's: vLLM's extension (json, regex, "
                                                                        "choice or grammar)")

    def sampling_parameters(self) -> dict[str, Any]:
        values = {k: getattr(self, k) for k in SETTINGS}
        if isinstance(values["stop"], str):
            values["stop"] = [values["stop"]]
        values["structured_outputs"] = self.constraint()
        return {k: v for k, v in values.items() if v is not None}

    def constraint(self) -> dict[str, Any] | None:
        """OpenAI's response_format or vLLM's structured_outputs, as the model's structured_outputs (the model says
        which engine can follow it); both at once is a 400."""
        fmt = self.response_format.structured() if self.response_format is not None else None
        if fmt is not None and self.structured_outputs is not None:
            raise ApiError(400, "response_format and structured_outputs both constrain the output; send one",
                           param="structured_outputs", code="invalid_value")
        return fmt if fmt is not None else self.structured_outputs

    def check(self) -> None:
        """What the fields' types cannot say; ApiError naming the field."""

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Settings):
    prompt: str | list[str] = Field(description="one prompt (a list holds exactly one)")
    echo: bool = Field(False, description="the prompt before the completion in `text` (and, with logprobs, its "
                                          "tokens' log-probs before the completion's)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="each token's log-prob and the `logprobs` most likely alternatives")

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ApiError(400, f"prompt holds {len(self.prompt)} prompts; send one a request", param="prompt")
        return self.prompt[0]

    def check(self) -> None:
        for name in ("logprobs", "echo"):
            if self.stream and getattr(self, name) not in (None, False):
                raise ApiError(400, f"{name} is not streamed by this gateway; send stream = false with {name}",
                               param=name, code="invalid_value")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens is 0, which only echo = true allows (the prompt's log-probs alone); "
                                "ask for at least 1 token, or set echo = true", param="max_tokens", code="invalid_value")

    def sampling_parameters(self) -> dict[str, Any]:
        """The settings, with the model's `logprobs` and (echo) `prompt_logprobs`: the model takes max_tokens = 0
        only with prompt_logprobs, so echo with no token to generate asks for them (k = 0) anyway."""
        out = super().sampling_parameters()
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            out["prompt_logprobs"] = self.logprobs or 0
        return out


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: str
    content: str | list[TextPart]
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatRequest(Settings):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None   # OpenAI's newer name for max_tokens

    def text(self) -> str:
        return json.dumps([m.as_dict() for m in self.messages], ensure_ascii=False)

    def sampling_parameters(self) -> dict[str, Any]:
        out = super().sampling_parameters()
        if self.max_completion_tokens is not None:
            out.setdefault("max_tokens", self.max_completion_tokens)
        return out


Body = TypeVar("Body", bound=Settings)


async def read_body(request: Request, model: type[Body]) -> Body:
    """The request's body as `model`: JSON (Content-Type application/json, or none), UTF-8, an object whose fields
    validate; else an ApiError 400 saying which of these it is not."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise ApiError(400, f"the request's Content-Type is {media}; send the body as JSON with Content-Type: "
                            "application/json", code="invalid_content_type")
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte {e.start} is {raw[e.start:e.start + 1]!r}); "
                            "send JSON encoded as UTF-8", code="invalid_encoding") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e.msg}: line {e.lineno} column {e.colno})",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body is a JSON {type(data).__name__}; send a JSON object of the request's "
                            "fields", code="invalid_json")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        raise field_error(e.errors()) from None
    body.check()
    return body


# --- Triton ----------------------------------------------------------------------------

@dataclass
class Reply:
    """One Triton response: its new text, and on the final one the counts, finish reason, timings and log-probs."""

    text: str
    final: dict[str, Any] | None = None


@dataclass
class Triton:
    """The served model over gRPC (tritonclient.grpc.aio, one channel, made in the server's event loop)."""

    url: str
    model: str
    _client: Any = field(default=None, repr=False)

    def client(self) -> Any:
        if self._client is None:
            import tritonclient.grpc.aio as grpcaio

            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def generate(self, text: str, settings: dict[str, Any], *, stream: bool,
                       prompt_param: str = "prompt") -> AsyncIterator[Reply]:
        """The request's responses until its final one; ApiError when the model refuses or fails it. Closing this
        generator early (the HTTP client went away) cancels the gRPC call, and with it the Triton request."""
        request = {"model_name": self.model, "inputs": triton_inputs(text, settings, stream=stream),
                   "request_id": uuid.uuid4().hex}

        async def one() -> AsyncIterator[dict[str, Any]]:
            yield request
        call = self.client().stream_infer(one())
        done = False
        try:
            async for result, error in call:
                if error is not None:
                    done = True
                    raise triton_error(error.message(), prompt_param=prompt_param)
                reply = to_reply(result)
                done = reply.final is not None
                yield reply
                if done:
                    return
            done = True
            raise ApiError(500, "the model's response stream ended without a final response", kind="server_error")
        finally:
            if not done:
                call.cancel()


def triton_inputs(text: str, settings: dict[str, Any], *, stream: bool) -> list[Any]:
    """text_input, stream, return_finish_reason and (when any setting is given) sampling_parameters."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    values = [("text_input", np.array([text.encode("utf-8")], dtype=np.object_), "BYTES"),
              ("stream", np.array([stream]), "BOOL"), ("return_finish_reason", np.array([True]), "BOOL")]
    if settings:
        values.append(("sampling_parameters", np.array([json.dumps(settings).encode()], dtype=np.object_), "BYTES"))
    inputs = []
    for name, arr, dtype in values:
        inputs.append(grpcclient.InferInput(name, list(arr.shape), dtype))
        inputs[-1].set_data_from_numpy(arr)
    return inputs


LOGPROB_OUTPUTS = ("logprobs", "prompt_logprobs")   # BYTES, JSON: one entry per token (components/serving/triton_model.py)


def to_reply(result: Any) -> Reply:
    """A tritonclient InferResult as a Reply; the final response is the one with output_tokens. Its log-prob outputs
    (when asked for) are parsed from their JSON."""
    def value(name: str) -> Any:
        arr = result.as_numpy(name)
        if arr is None:
            return None
        v = arr.reshape(-1)[0]
        return v.decode("utf-8") if isinstance(v, bytes) else v.item()
    text = value("text_output") or ""
    if value("output_tokens") is None:
        return Reply(text)
    final = {"finish_reason": value("finish_reason") or "stop", "prompt_tokens": int(value("prompt_tokens")),
             "output_tokens": int(value("output_tokens"))}
    for name in ("first_token_ms", "decode_ms"):
        final[name] = None if value(name) is None else float(value(name))
    for name in LOGPROB_OUTPUTS:
        raw = value(name)
        final[name] = None if raw is None else json.loads(raw)
    return Reply(text, final)


# --- log-probabilities -------------------------------------------------------------------

def first_token(prompt: str, entries: list[dict[str, Any] | None]) -> str:
    """The text of the prompt's first token, which the model reports as null (nothing comes before it to predict
    it): the part of the prompt before the other tokens' text, or "" for a start token (eos) that the model reads
    before the prompt."""
    rest = "".join(e["token"] for e in entries[1:] if e)
    return prompt[: len(prompt) - len(rest)] if prompt.endswith(rest) else ""


def openai_logprobs(entries: list[dict[str, Any] | None], *, offset: int, first: str = "") -> dict[str, list[Any]]:
    """The model's per-token entries ({"id", "token", "logprob", "top": [[token, logprob], ...]}; null for the
    prompt's first token) in OpenAI's legacy shape, text_offset counting from `offset`. A top_logprobs entry holds the
    alternatives and the chosen token, as OpenAI's always does (so up to logprobs + 1 of them)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        token = first if e is None else e["token"]
        top = None if e is None else {t: float(lp) for t, lp in e["top"]}
        if e is not None:
            top.setdefault(token, float(e["logprob"]))
        out["tokens"].append(token)
        out["token_logprobs"].append(None if e is None else float(e["logprob"]))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def completion_logprobs(body: CompletionRequest, final: dict[str, Any]) -> dict[str, list[Any]] | None:
    """choices[0].logprobs of a completion: the generated tokens' (text_offset from the prompt's end, as OpenAI counts
    in prompt + completion), after the prompt's with echo (from 0); None when the request asked for none."""
    if body.logprobs is None:
        return None
    wanted = ["logprobs", *(["prompt_logprobs"] if body.echo else [])]
    missing = [name for name in wanted if final.get(name) is None]
    if missing:
        raise ApiError(500, f"the served model returned no {' or '.join(missing)} output: it predates log-probs; "
                            "roll out a version built by this lmforge", code="no_logprobs", kind="server_error")
    prompt = body.text()
    out = openai_logprobs(final["logprobs"], offset=len(prompt))
    if not body.echo:
        return out
    entries = final["prompt_logprobs"]
    head = openai_logprobs(entries, offset=0, first=first_token(prompt, entries))
    return {k: head[k] + out[k] for k in out}


# --- metrics ----------------------------------------------------------------------------

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


# --- responses ----------------------------------------------------------------------------

def usage(final: dict[str, Any]) -> dict[str, int]:
    p, c = final["prompt_tokens"], final["output_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def choice(chat: bool, text: str | None, finish_reason: str | None, *, first: bool = False,
           stream: bool = True) -> dict[str, Any]:
    """One choice of a completion or chat object; a stream's chat chunk carries a delta (the first one the role)."""
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    if not stream:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}
    delta = {"role": "assistant", "content": ""} if first else {"content": text} if text else {}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def final_choice(body: CompletionRequest | ChatRequest, reply: Reply) -> dict[str, Any]:
    """The one choice of a whole (not streamed) answer: a completion's text after the prompt with echo, and its
    log-probs when asked for."""
    assert reply.final is not None
    reason = reply.final["finish_reason"]
    if not isinstance(body, CompletionRequest):
        return choice(True, reply.text, reason, stream=False)
    text = (body.text() if body.echo else "") + reply.text
    return {"index": 0, "text": text, "logprobs": completion_logprobs(body, reply.final), "finish_reason": reason}


@dataclass(frozen=True)
class Answer:
    """What one request's answers share: its id, kind, model and creation time, and where its metrics go (from its
    arrival: `started`)."""

    model: str
    chat: bool
    metrics: Metrics
    path: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)

    def obj(self, choices: list[dict[str, Any]], *, stream: bool, **extra: Any) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def finished(self, final: dict[str, Any]) -> None:
        self.metrics.finished(final, self.started)


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


TEXT_MARK = "\x00lmforge-text\x00"   # stands for a chunk's text while its event's bytes are laid out


class TextEvents:
    """The server-sent event of a streamed answer's text chunk, laid out once per request: each token's event is the
    bytes around the text and the text's own JSON string, the bytes `sse(answer.obj(...))` would give, without a
    dict and a whole-object encode per token."""

    def __init__(self, answer: Answer, extra: dict[str, Any]) -> None:
        whole = sse(answer.obj([choice(answer.chat, TEXT_MARK, None)], stream=True, **extra))
        self.head, self.tail = whole.split(json.dumps(TEXT_MARK, ensure_ascii=False).encode())

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.tail


async def complete(replies: AsyncIterator[Reply], answer: Answer, body: CompletionRequest | ChatRequest) -> dict[str, Any]:
    """A non-streamed answer: the final response's text, finish reason, usage (and log-probs when asked for)."""
    async with contextlib.aclosing(replies):
        async for reply in replies:
            if reply.final is not None:
                answer.finished(reply.final)
                return answer.obj([final_choice(body, reply)], stream=False, usage=usage(reply.final))
    raise ApiError(500, "the model ended without a final response", kind="server_error")


async def stream_events(first: Reply, replies: AsyncIterator[Reply], answer: Answer,
                        include_usage: bool) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed answer; an error after the first event ends it with an error event."""
    extra = {"usage": None} if include_usage else {}
    text_event = TextEvents(answer, extra)
    async with contextlib.aclosing(replies):
        if answer.chat:
            yield sse(answer.obj([choice(True, None, None, first=True)], stream=True, **extra))
        reply = first
        try:
            while True:
                if reply.text:
                    yield text_event(reply.text)
                if reply.final is not None:
                    break
                reply = await anext(replies)
        except ApiError as e:
            answer.metrics.failed(answer.path, e)
            yield sse(e.body())
            return
    answer.finished(reply.final)
    yield sse(answer.obj([choice(answer.chat, None, reply.final["finish_reason"])], stream=True, **extra))
    if include_usage:
        yield sse(answer.obj([], stream=True, usage=usage(reply.final)))
    yield sse("[DONE]")


# --- the app ------------------------------------------------------------------------------

def task_kind(repo: Path, model: str) -> str | None:
    """The task kind the served (newest) version records in its meta.json; None when it records none."""
    from lmforge.deploy.repository import served_versions, version_dir

    versions = served_versions(repo, model)
    meta = version_dir(repo, model, versions[-1]) / "meta.json" if versions else None
    if meta is None or not meta.is_file():
        return None
    return ((json.loads(meta.read_text()).get("lmforge") or {}).get("task") or {}).get("kind")


async def respond(request: Request, body: CompletionRequest | ChatRequest, *, chat: bool) -> Any:
    """One request through Triton: the answer as one object, or (stream) as server-sent events."""
    state = request.app.state
    answer = Answer(state.model, chat, state.metrics, request.url.path)
    if body.model != state.model:
        raise ApiError(404, f"The model `{body.model}` does not exist; this gateway serves `{state.model}`",
                       param="model", code="model_not_found")
    if chat and (kind := task_kind(state.repo, state.model)) != "chat":
        raise ApiError(400, f"model `{state.model}` has no chat template/task (its task kind is "
                            f"{kind or 'not recorded'}); send a prompt to /v1/completions instead", param="messages",
                       code="not_a_chat_model")
    replies = state.triton.generate(body.text(), body.sampling_parameters(), stream=body.stream,
                                    prompt_param="messages" if chat else "prompt")
    if not body.stream:
        return await complete(replies, answer, body)
    try:
        first = await anext(replies)   # a refused request is answered with its status, before any event
    except BaseException:
        await replies.aclose()
        raise
    return StreamingResponse(stream_events(first, replies, answer, body.include_usage), media_type="text/event-stream")


def error_response(request: Request, error: ApiError) -> JSONResponse:
    """An error answered: counted in the metrics, sent in OpenAI's shape."""
    request.app.state.metrics.failed(request.url.path, error)
    return error.response()


def unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug's 500, in OpenAI's shape too (the server still logs its traceback)."""
    return error_response(request, ApiError(500, f"the gateway failed: {type(exc).__name__}: {exc}",
                                            code="internal_error", kind="server_error"))


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: lmforge's own, a body FastAPI refuses, Starlette's 404 and 405, a bug's 500."""
    app.add_exception_handler(ApiError, error_response)
    app.add_exception_handler(RequestValidationError, lambda r, e: error_response(r, field_error(list(e.errors()))))
    app.add_exception_handler(HTTPException, lambda r, e: error_response(r, http_error(r, e)))
    app.add_exception_handler(Exception, unexpected)


def create_app(triton_grpc_url: str, model: str, repo: Path, *, instance: str = "") -> FastAPI:
    """The gateway for Triton model `model` (served from `repo`) at `triton_grpc_url`; `instance` is what /health
    answers with (deploy/gateway.py's readiness probe tells its own process from another on the port by it)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await app.state.triton.close()

    app = FastAPI(title="lmforge OpenAI-compatible API", lifespan=lifespan)
    app.state.model, app.state.repo, app.state.created = model, Path(repo), int(time.time())
    app.state.triton, app.state.metrics = Triton(triton_grpc_url, model), Metrics(model)
    add_error_handlers(app)
    app.add_middleware(Metered, metrics=app.state.metrics)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": app.state.created,
                                            "owned_by": "lmforge"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await respond(request, await read_body(request, CompletionRequest), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await respond(request, await read_body(request, ChatRequest), chat=True)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(app.state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "instance": instance}
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m lmforge.deploy.openai_api", description=__doc__.splitlines()[0])
    p.add_argument("--triton-grpc", required=True, help="host:port of Triton's gRPC endpoint")
    p.add_argument("--model", required=True, help="the Triton model's name")
    p.add_argument("--repo", required=True, type=Path, help="the Triton model repository (for the task kind)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--instance", default="", help="an id /health answers with (deploy/gateway.py's readiness probe)")
    args = p.parse_args(argv)
    uvicorn.run(create_app(args.triton_grpc, args.model, args.repo, instance=args.instance), host=args.host,
                port=args.port, log_level="info", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
