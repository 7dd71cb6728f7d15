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

This module answers; what a request may hold and how errors look is deploy/openai_protocol.py, the model over
gRPC deploy/openai_triton.py, and /metrics deploy/openai_metrics.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from lmforge.deploy.openai_metrics import Metered, Metrics
from lmforge.deploy.openai_protocol import ApiError, ChatRequest, CompletionRequest, field_error, http_error, read_body
from lmforge.deploy.openai_triton import Reply, Triton

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
