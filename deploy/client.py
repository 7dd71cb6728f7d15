"""Talk to the served model with tritonclient, over HTTP or gRPC.

    gens = generate("127.0.0.1:8000", ["def foo(x):"])                            # HTTP
    gens = generate("127.0.0.1:8001", ["def foo(x):"], protocol="grpc", version=3)
    gens[0].summary, gens[0].latency_ms
    load_model("127.0.0.1:8000", "lmforge", timeout=180)                            # explicit model control
    ready_versions("127.0.0.1:8000", "lmforge")                                     # {3: True}

A refused request raises RequestFailed with the server's message (for example
"PROMPT[0] is empty; ..."); the CLI prints it on one line. Model-control calls (load,
unload, the repository index) carry the server's admin key (deploy/control.py); Triton
refuses them without it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from lmforge.deploy import control

Protocol = Literal["http", "grpc"]
OUTPUTS = ("SUMMARY", "COMPLETION", "TOKEN_IDS", "OUTPUT_TOKENS", "MEAN_LOGPROB", "FIRST_TOKEN_MS", "DECODE_MS")


class RequestFailed(RuntimeError):
    """The server refused or failed a request; the message is the server's."""


@dataclass(frozen=True)
class Generation:
    summary: str
    completion: str
    token_ids: tuple[int, ...]
    output_tokens: int
    mean_logprob: float
    first_token_ms: float  # server side: from the start of the batch's generation to its first token
    decode_ms: float       # server side: from the first token to the end of the batch's generation
    latency_ms: float      # client side: the whole request

    def as_result(self) -> dict[str, Any]:
        """The form deploy.processing.is_well_formed checks."""
        return {"summary": self.summary, "completion": self.completion, "output_tokens": self.output_tokens,
                "mean_logprob": self.mean_logprob}


def _module(protocol: Protocol) -> Any:
    if protocol == "http":
        import tritonclient.http as mod
    elif protocol == "grpc":
        import tritonclient.grpc as mod
    else:
        raise ValueError(f"protocol must be http or grpc, not {protocol!r}")
    return mod


def make_client(url: str, protocol: Protocol = "http", *, timeout: float = 120.0) -> Any:
    mod = _module(protocol)
    if protocol == "http":
        return mod.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout)
    return mod.InferenceServerClient(url)


def build_inputs(prompts: list[str | bytes], protocol: Protocol = "http", *,
                 max_new_tokens: int | None = None) -> list[Any]:
    mod = _module(protocol)

    def bytes_input(name: str, values: list[str | bytes]) -> Any:
        arr = np.array([[v.encode("utf-8") if isinstance(v, str) else v] for v in values], dtype=np.object_)
        inp = mod.InferInput(name, list(arr.shape), "BYTES")
        inp.set_data_from_numpy(arr)
        return inp

    inputs = [bytes_input("PROMPT", prompts)]
    if max_new_tokens is not None:
        arr = np.full((len(prompts), 1), max_new_tokens, dtype=np.int32)
        inp = mod.InferInput("MAX_NEW_TOKENS", list(arr.shape), "INT32")
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


def parse_result(result: Any, latency_ms: float) -> list[Generation]:
    cols = {name: result.as_numpy(name) for name in OUTPUTS}
    gens = []
    for i in range(cols["SUMMARY"].shape[0]):
        def text(name: str) -> str:
            v = cols[name][i][0]
            return v.decode("utf-8") if isinstance(v, bytes) else str(v)
        gens.append(Generation(summary=text("SUMMARY"), completion=text("COMPLETION"),
                               token_ids=tuple(int(t) for t in text("TOKEN_IDS").split()),
                               output_tokens=int(cols["OUTPUT_TOKENS"][i][0]),
                               mean_logprob=float(cols["MEAN_LOGPROB"][i][0]),
                               first_token_ms=float(cols["FIRST_TOKEN_MS"][i][0]),
                               decode_ms=float(cols["DECODE_MS"][i][0]), latency_ms=latency_ms))
    return gens


def infer(client: Any, model: str, inputs: list[Any], *, version: int | None = None) -> Any:
    """One request; RequestFailed carries the server's message when it is refused."""
    from tritonclient.utils import InferenceServerException

    try:
        return client.infer(model, inputs, model_version=str(version or ""))
    except InferenceServerException as e:
        raise RequestFailed(e.message() or str(e)) from None


def generate(url: str, prompts: list[str | bytes], *, protocol: Protocol = "http", model: str = "lmforge",
             version: int | None = None, max_new_tokens: int | None = None,
             timeout: float = 120.0) -> list[Generation]:
    """Generate a summary for each prompt (one request carrying all of them)."""
    client = make_client(url, protocol, timeout=timeout)
    try:
        start = time.perf_counter()
        result = infer(client, model, build_inputs(prompts, protocol, max_new_tokens=max_new_tokens),
                       version=version)
        return parse_result(result, (time.perf_counter() - start) * 1e3)
    finally:
        client.close()


# --- model control (HTTP) --------------------------------------------------------

def load_model(url: str, model: str, *, timeout: float) -> None:
    """Ask the server to (re)load `model` from its repository, as config.pbtxt now says; RequestFailed if it fails."""
    from tritonclient.utils import InferenceServerException

    client = make_client(url, "http", timeout=timeout)
    try:
        client.load_model(model, headers=control.headers(url))
    except InferenceServerException as e:
        raise RequestFailed(e.message() or str(e)) from None
    finally:
        client.close()


def unload_model(url: str, model: str, *, timeout: float = 60.0) -> None:
    """Ask the server to unload every version of `model`; RequestFailed if it refuses."""
    from tritonclient.utils import InferenceServerException

    client = make_client(url, "http", timeout=timeout)
    try:
        client.unload_model(model, headers=control.headers(url))
    except InferenceServerException as e:
        raise RequestFailed(e.message() or str(e)) from None
    finally:
        client.close()


def ready_versions(url: str, model: str) -> dict[int, bool]:
    """{version: ready} for every version of `model` the server knows of."""
    client = make_client(url, "http", timeout=10.0)
    try:
        index = client.get_model_repository_index(headers=control.headers(url))
    finally:
        client.close()
    return {int(m["version"]): m.get("state") == "READY" for m in index
            if m.get("name") == model and m.get("version")}


def wait_settled(url: str, model: str, *, timeout: float) -> dict[int, str]:
    """Wait until no version of `model` is LOADING or UNLOADING (Triton unloads in the background); {version: state}."""
    deadline = time.monotonic() + timeout
    while True:
        client = make_client(url, "http", timeout=10.0)
        try:
            states = {int(m["version"]): m.get("state", "") for m in client.get_model_repository_index(
                headers=control.headers(url))
                      if m.get("name") == model and m.get("version")}
        finally:
            client.close()
        if not any(s in ("LOADING", "UNLOADING") for s in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.25)


def batch_sizes(url: str, model: str, version: int | None = None) -> dict[int, int]:
    """{batch size: executions} from the server's statistics: shows what the dynamic batcher formed."""
    client = make_client(url, "http", timeout=10.0)
    try:
        stats = client.get_inference_statistics(model, str(version or ""))
    finally:
        client.close()
    out: dict[int, int] = {}
    for s in stats.get("model_stats", []):
        for b in s.get("batch_stats", []):
            out[int(b["batch_size"])] = out.get(int(b["batch_size"]), 0) + int(b["compute_infer"]["count"])
    return out
