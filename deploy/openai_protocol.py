"""What the OpenAI-compatible gateway (deploy/openai_api.py) takes and how it refuses: its routes, OpenAI's error
shape, and the bodies of /v1/completions and /v1/chat/completions.

    body = await read_body(request, CompletionRequest)    # or ApiError 400, naming what is wrong and the fix
    body.text(), body.sampling_parameters()               # the model's text_input and sampling_parameters
    raise triton_error(message)                           # the model's refusal as OpenAI's 400, 500 or 503

Every error has OpenAI's body, {"error": {"message", "type", "param", "code"}}. Triton's gRPC stream carries an
error's message but not its code, so the code is read from the model's own wording (triton_error).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
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

