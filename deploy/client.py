"""Talk to the served model with tritonclient (HTTP or gRPC) or Triton's generate endpoint.

    gens = generate("127.0.0.1:8000", ["Once upon a time"])                         # HTTP, greedy
    gens = generate("127.0.0.1:8001", ["Hi"], protocol="grpc", version=3,
                    params=Params(max_tokens=16, temperature=0.7, seed=3, stop=("\n",)))
    gens[0].text, gens[0].output_tokens, gens[0].latency_ms
    out = generate_endpoint("127.0.0.1:8000", "lmforge", {"text_input": "Hi", "max_tokens": 16})   # {"text_output": ...}
    ready_versions("127.0.0.1:8000", "lmforge")                                     # {3: True}
    wait_versions("127.0.0.1:8000", "lmforge", [2, 3], revision=rev, timeout=180)   # after write_config

The served model speaks Triton's LLM convention (deploy/model.py): `text_input` in, `text_output`
out, with optional `max_tokens`, `temperature`, `top_p`, `top_k`, `seed` and `stop`. A refused
request raises RequestFailed with the server's message (for example "max_tokens[0] is -1; ...");
the CLI prints it on one line. Nothing here asks the server to load or unload a model: it runs
with `--model-control-mode=poll` (deploy/server.py), which refuses those requests from anyone,
and picks up what lmforge writes into the model repository by itself. `wait_versions` waits,
within a bound, until the server serves the config.pbtxt lmforge wrote (its `lmforge_revision`
parameter) with exactly the versions it names ready, or says why a version failed to load.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Protocol = Literal["http", "grpc"]
REVISION_PARAMETER = "lmforge_revision"  # config.pbtxt parameter deploy/repository.py writes


class RequestFailed(RuntimeError):
    """The server refused or failed a request; the message is the server's."""


@dataclass(frozen=True)
class Params:
    """A request's optional inputs; None leaves an input out (the server's default: greedy, no extra stop)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The generate endpoint's fields."""
        out = {k: v for k, v in self.__dict__.items() if v is not None and k != "stop"}
        return {**out, **({"stop": list(self.stop)} if self.stop else {})}


@dataclass(frozen=True)
class Generation:
    text: str               # text_output: the completion, cut before the first stop string
    token_ids: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int
    mean_logprob: float
    first_token_ms: float  # server side: from the start of the batch's generation to its first token
    decode_ms: float       # server side: from the first token to the end of the batch's generation
    latency_ms: float      # client side: the whole request

    def as_result(self) -> dict[str, Any]:
        """The form deploy.processing.is_well_formed checks."""
        return {"text_output": self.text, "output_tokens": self.output_tokens, "mean_logprob": self.mean_logprob}


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


def build_inputs(prompts: list[str | bytes], protocol: Protocol = "http", *, params: Params = Params()) -> list[Any]:
    """text_input and the optional inputs `params` sets, one row per prompt."""
    mod = _module(protocol)
    n = len(prompts)

    def tensor(name: str, arr: np.ndarray, dtype: str) -> Any:
        inp = mod.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        return inp

    encoded = [[v.encode("utf-8") if isinstance(v, str) else v] for v in prompts]
    inputs = [tensor("text_input", np.array(encoded, dtype=np.object_), "BYTES")]
    for name, dtype, np_type in (("max_tokens", "INT32", np.int32), ("temperature", "FP32", np.float32),
                                 ("top_p", "FP32", np.float32), ("top_k", "INT32", np.int32),
                                 ("seed", "INT64", np.int64)):
        value = getattr(params, name)
        if value is not None:
            inputs.append(tensor(name, np.full((n, 1), value, dtype=np_type), dtype))
    if params.stop:
        stops = np.array([[s.encode("utf-8") for s in params.stop]] * n, dtype=np.object_)
        inputs.append(tensor("stop", stops, "BYTES"))
    return inputs


def parse_result(result: Any, latency_ms: float) -> list[Generation]:
    cols = {name: result.as_numpy(name) for name in ("text_output", "token_ids", "prompt_tokens", "output_tokens",
                                                     "mean_logprob", "first_token_ms", "decode_ms")}
    gens = []
    for i in range(cols["text_output"].shape[0]):
        def text(name: str, i: int = i) -> str:  # bound now: the helper is called within this iteration only
            v = cols[name][i][0]
            return v.decode("utf-8") if isinstance(v, bytes) else str(v)
        gens.append(Generation(text=text("text_output"), token_ids=tuple(int(t) for t in text("token_ids").split()),
                               prompt_tokens=int(cols["prompt_tokens"][i][0]),
                               output_tokens=int(cols["output_tokens"][i][0]),
                               mean_logprob=float(cols["mean_logprob"][i][0]),
                               first_token_ms=float(cols["first_token_ms"][i][0]),
                               decode_ms=float(cols["decode_ms"][i][0]), latency_ms=latency_ms))
    return gens


def infer(client: Any, model: str, inputs: list[Any], *, version: int | None = None) -> Any:
    """One request; RequestFailed carries the server's message when it is refused."""
    from tritonclient.utils import InferenceServerException

    try:
        return client.infer(model, inputs, model_version=str(version or ""))
    except InferenceServerException as e:
        raise RequestFailed(e.message() or str(e)) from None


def generate(url: str, prompts: list[str | bytes], *, protocol: Protocol = "http", model: str = "lmforge",
             version: int | None = None, params: Params = Params(), timeout: float = 120.0) -> list[Generation]:
    """Generate a completion for each prompt (one request carrying all of them)."""
    client = make_client(url, protocol, timeout=timeout)
    try:
        start = time.perf_counter()
        result = infer(client, model, build_inputs(prompts, protocol, params=params), version=version)
        return parse_result(result, (time.perf_counter() - start) * 1e3)
    finally:
        client.close()


def generate_endpoint(url: str, model: str, body: dict[str, Any], *, version: int | None = None,
                      timeout: float = 120.0) -> dict[str, Any]:
    """POST body to Triton's generate extension (`/v2/models/<model>[/versions/<v>]/generate`), JSON in and out;
    RequestFailed with the server's error and HTTP status when it refuses."""
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/generate"
    req = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode("utf-8"),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")
        try:
            detail = json.loads(detail).get("error", detail)
        except json.JSONDecodeError:
            pass
        raise RequestFailed(f"HTTP {e.code}: {detail}") from None


# --- what the server serves (HTTP) --------------------------------------------------

def ready_versions(url: str, model: str) -> dict[int, bool]:
    """{version: ready} for every version of `model` the server knows of."""
    return {v: state == "READY" for v, (state, _) in _index(url, model).items() if v}


def served_revision(url: str, model: str) -> str | None:
    """The `lmforge_revision` of the config the server serves `model` with; None when it serves none."""
    from tritonclient.utils import InferenceServerException

    client = make_client(url, "http", timeout=10.0)
    try:
        config = client.get_model_config(model)
    except InferenceServerException:  # not loaded (yet), or unknown
        return None
    finally:
        client.close()
    return (config.get("parameters", {}).get(REVISION_PARAMETER) or {}).get("string_value")


def wait_versions(url: str, model: str, versions: list[int], *, revision: str | None,
                  timeout: float) -> dict[int, str]:
    """Wait until the server has picked up config.pbtxt `revision`, exactly `versions` are ready and nothing else is
    still loading or unloading; {version: state}.

    Triton polls the repository and loads the new config in the background; the versions
    serving until then keep serving (a failed load leaves them as they were). RequestFailed
    when a version fails to load (with Triton's reason), or when `timeout` s pass first.
    """
    want = set(versions)
    before = _index(url, model)
    seen_loading: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        index = _index(url, model)
        states = {v: state for v, (state, _) in index.items() if v}
        seen_loading |= {v for v, (state, _) in index.items() if state == "LOADING"}
        applied = revision is None or served_revision(url, model) == revision
        ready = {v for v, state in states.items() if state == "READY"}
        # UNLOADING too: until a dropped version's stub has exited, strict readiness says the server is not ready.
        if applied and ready == want and not any(s in ("LOADING", "UNLOADING") for s in states.values()):
            return states
        for v, (state, reason) in index.items():
            # A failure counts only once it is this load's: seen loading since the call, or not what it was before.
            if ((v in want or (v == 0 and want)) and state == "UNAVAILABLE" and reason and reason != "unloaded"
                    and (v in seen_loading or before.get(v) != (state, reason))):
                which = f"version {v}" if v else "the model"
                raise RequestFailed(f"failed to load {model!r} {which}: {reason.splitlines()[0][:300]}")
        if time.monotonic() > deadline:
            raise RequestFailed(f"{model!r} did not serve versions {sorted(want)} within {timeout:.0f} s "
                                f"(config {'picked up' if applied else 'not picked up yet'}; states {states})")
        time.sleep(0.25)


def _index(url: str, model: str) -> dict[int, tuple[str, str]]:
    """{version: (state, reason)} from the repository index; version 0 stands for the model as a whole."""
    client = make_client(url, "http", timeout=10.0)
    try:
        index = client.get_model_repository_index()
    finally:
        client.close()
    return {int(m.get("version") or 0): (m.get("state", ""), m.get("reason", "")) for m in index
            if m.get("name") == model}


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
