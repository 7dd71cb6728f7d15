"""The served Triton model as the OpenAI gateway reaches it: one gRPC channel, a request's responses as Replies.

    triton = Triton("127.0.0.1:8001", "lmforge")
    async for reply in triton.generate(text, settings, stream=True):   # ApiError when the model refuses or fails it
        reply.text, reply.final    # the final one: counts, finish reason, timings, log-probs

The inputs are the model's vLLM-style contract (components/serving/triton_model.py): text_input, stream,
return_finish_reason, sampling_parameters JSON.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from lmforge.deploy.openai_protocol import ApiError, triton_error


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

