"""An OpenAI-compatible HTTP API in front of the served Triton model: a small gateway process (deploy/gateway.py).

    app = create_app("127.0.0.1:8001", "lmforge", ws.triton / "repo")     # FastAPI; Triton over gRPC (aio)
    python -m lmforge.deploy.openai_api --triton-grpc 127.0.0.1:8001 --model lmforge --repo <repo> --port 9000

    GET  /v1/models             the served model, in OpenAI's list shape
    POST /v1/completions        prompt (a string, or a list of one), max_tokens, temperature, top_p, seed, stop,
                                stream, stream_options.include_usage; n = 1 and echo = false only; top_k as an extension
    POST /v1/chat/completions   messages, rendered by the model's chat template: only for a version whose task kind
                                (meta.json lmforge.task.kind) is "chat"

Each request is one request of the model's vLLM-style contract (deploy/model.py): text_input (a chat's messages as
a JSON list), stream, sampling_parameters JSON; a setting left out takes the served model's default (greedy,
deploy.max_new_tokens). `stream: true` answers with server-sent events (OpenAI chunk objects, then `data: [DONE]`);
a client that goes away cancels its Triton request (the gRPC call is cancelled). Errors have OpenAI's body,
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
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

SETTINGS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")   # the model's sampling_parameters keys
RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def triton_error(message: str, *, prompt_param: str = "prompt") -> ApiError:
    """The model's error as an ApiError: busy (UNAVAILABLE) 503, failed generation (INTERNAL) 500, else a bad request
    (INVALID_ARG) 400 whose param is the setting the message starts with (text_input: the prompt or messages)."""
    if " is busy: " in message:
        return ApiError(503, message, code="model_busy", kind="server_error")
    if message.startswith("generation failed"):
        return ApiError(500, message, code="generation_failed", kind="server_error")
    m = re.match(r"(?:sampling_parameters\.)?(\w+)", message)
    name = m.group(1) if m else None
    param = name if name in SETTINGS else prompt_param if name == "text_input" else None
    return ApiError(400, message, param=param, code="invalid_value")


# --- requests -------------------------------------------------------------------------

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class Settings(Strict):
    """What both endpoints take; a field left out is the served model's default."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="not OpenAI's: an extension, as vLLM's server has it")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None   # accepted, unused

    def sampling_parameters(self) -> dict[str, Any]:
        values = {k: getattr(self, k) for k in SETTINGS}
        if isinstance(values["stop"], str):
            values["stop"] = [values["stop"]]
        return {k: v for k, v in values.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Settings):
    prompt: str | list[str] = Field(description="one prompt (a list holds exactly one)")
    echo: Literal[False] = False

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ApiError(400, f"prompt holds {len(self.prompt)} prompts; send one a request", param="prompt")
        return self.prompt[0]


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


# --- Triton ----------------------------------------------------------------------------

@dataclass
class Reply:
    """One Triton response: its new text, and on the final one the counts and finish reason."""

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


def to_reply(result: Any) -> Reply:
    """A tritonclient InferResult as a Reply; the final response is the one with output_tokens."""
    def value(name: str) -> Any:
        arr = result.as_numpy(name)
        if arr is None:
            return None
        v = arr.reshape(-1)[0]
        return v.decode("utf-8") if isinstance(v, bytes) else v.item()
    text = value("text_output") or ""
    if value("output_tokens") is None:
        return Reply(text)
    return Reply(text, {"finish_reason": value("finish_reason") or "stop", "prompt_tokens": int(value("prompt_tokens")),
                        "output_tokens": int(value("output_tokens"))})


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


@dataclass(frozen=True)
class Answer:
    """What one request's answers share: its id, kind, model and creation time."""

    model: str
    chat: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def obj(self, choices: list[dict[str, Any]], *, stream: bool, **extra: Any) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices, **extra}


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def complete(replies: AsyncIterator[Reply], answer: Answer) -> dict[str, Any]:
    """A non-streamed answer: the final response's text, finish reason and usage."""
    async with contextlib.aclosing(replies):
        async for reply in replies:
            if reply.final is not None:
                return answer.obj([choice(answer.chat, reply.text, reply.final["finish_reason"], stream=False)],
                                  stream=False, usage=usage(reply.final))
    raise ApiError(500, "the model ended without a final response", kind="server_error")


async def stream_events(first: Reply, replies: AsyncIterator[Reply], answer: Answer,
                        include_usage: bool) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed answer; an error after the first event ends it with an error event."""
    extra = {"usage": None} if include_usage else {}
    async with contextlib.aclosing(replies):
        if answer.chat:
            yield sse(answer.obj([choice(True, None, None, first=True)], stream=True, **extra))
        reply = first
        try:
            while True:
                if reply.text:
                    yield sse(answer.obj([choice(answer.chat, reply.text, None)], stream=True, **extra))
                if reply.final is not None:
                    break
                reply = await anext(replies)
        except ApiError as e:
            yield sse(e.body())
            return
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


def validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's 422 as OpenAI's 400, naming the first field that is wrong (param: its top-level field)."""
    err = exc.errors()[0] if exc.errors() else {"type": "json_invalid", "loc": (), "msg": "no body"}
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid" or not loc:
        return ApiError(400, f"the request body is not a valid JSON object ({err.get('msg')})", code="invalid_json")
    return ApiError(400, f"{'.'.join(loc)}: {err.get('msg')}", param=loc[0], code="invalid_value")


async def respond(request: Request, body: CompletionRequest | ChatRequest, *, chat: bool) -> Any:
    """One request through Triton: the answer as one object, or (stream) as server-sent events."""
    state = request.app.state
    if body.model != state.model:
        raise ApiError(404, f"The model `{body.model}` does not exist; this gateway serves `{state.model}`",
                       param="model", code="model_not_found")
    if chat and (kind := task_kind(state.repo, state.model)) != "chat":
        raise ApiError(400, f"model `{state.model}` has no chat template/task (its task kind is "
                            f"{kind or 'not recorded'}); send a prompt to /v1/completions instead", param="messages",
                       code="not_a_chat_model")
    replies = state.triton.generate(body.text(), body.sampling_parameters(), stream=body.stream,
                                    prompt_param="messages" if chat else "prompt")
    answer = Answer(state.model, chat)
    if not body.stream:
        return await complete(replies, answer)
    try:
        first = await anext(replies)   # a refused request is answered with its status, before any event
    except BaseException:
        await replies.aclose()
        raise
    return StreamingResponse(stream_events(first, replies, answer, body.include_usage), media_type="text/event-stream")


def create_app(triton_grpc_url: str, model: str, repo: Path) -> FastAPI:
    """The gateway for Triton model `model` (served from `repo`) at `triton_grpc_url`."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await app.state.triton.close()

    app = FastAPI(title="lmforge OpenAI-compatible API", lifespan=lifespan)
    app.state.model, app.state.repo, app.state.created = model, Path(repo), int(time.time())
    app.state.triton = Triton(triton_grpc_url, model)
    app.add_exception_handler(ApiError, lambda _, e: e.response())
    app.add_exception_handler(RequestValidationError, lambda _, e: validation_error(e).response())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": app.state.created,
                                            "owned_by": "lmforge"}]}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Any:
        return await respond(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest) -> Any:
        return await respond(request, body, chat=True)
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m lmforge.deploy.openai_api", description=__doc__.splitlines()[0])
    p.add_argument("--triton-grpc", required=True, help="host:port of Triton's gRPC endpoint")
    p.add_argument("--model", required=True, help="the Triton model's name")
    p.add_argument("--repo", required=True, type=Path, help="the Triton model repository (for the task kind)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    uvicorn.run(create_app(args.triton_grpc, args.model, args.repo), host=args.host, port=args.port,
                log_level="info", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
