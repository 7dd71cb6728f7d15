"""Talk to the served model: Triton's generate endpoints (HTTP) or a gRPC stream (tritonclient).

    gens = generate("127.0.0.1:8000", ["Once upon a time"])                         # HTTP generate, greedy
    gens = generate("127.0.0.1:8001", ["Hi", "Ho"], protocol="grpc", version=3,
                    params=Params(max_tokens=16, temperature=0.7, seed=3, stop=("\n",)))   # one gRPC stream
    gens[0].text, gens[0].output_tokens, gens[0].latency_ms
    for piece in stream("127.0.0.1:8001", "Hi"): print(piece, end="")             # the answer as it is decoded
    out = generate_endpoint("127.0.0.1:8000", "lmforge", {"text_input": "Hi", "max_tokens": 16})   # {"text_output": ...}
    events = list(generate_stream_endpoint("127.0.0.1:8000", "lmforge", {"text_input": "Hi", "stream": True}))
    gen, pieces = stream_endpoint_generate("127.0.0.1:8000", "Hi")                  # the same, as one Generation
    ready_versions("127.0.0.1:8000", "lmforge")                                     # {3: True}
    wait_versions("127.0.0.1:8000", "lmforge", [2, 3], revision=rev, timeout=180)   # after write_config
    wait_unloaded("127.0.0.1:8000", "lmforge-candidate", repo / "lmforge-candidate", timeout=180)   # after its removal

The served model is decoupled and speaks vLLM's Triton contract (components/serving/triton_model.py): one prompt per
request, `text_input` in, `text_output` out, settings as `sampling_parameters` JSON or one input
each; streamed, each response holds the new text and the last is flagged final. Triton's HTTP
`infer` refuses decoupled models, so HTTP goes through the generate extension and gRPC through a
stream. A refused request raises RequestFailed with the server's message (for example
"max_tokens[0] is -1; ..."); the CLI prints it on one line. Nothing here asks the server to load or
unload a model: it runs with `--model-control-mode=poll` (deploy/server.py), which refuses those
requests from anyone, and picks up what lmforge writes into the model repository by itself.
`wait_versions` waits, within a bound, until the server serves the config.pbtxt lmforge wrote (the revision
in its instance group's name) with exactly the versions it names ready, or says why a version failed
to load.
"""

from __future__ import annotations

import json
import os
import queue
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Protocol = Literal["http", "grpc"]
REVISION_MARK = ".rev-"  # deploy/repository.py names a config's instance group <model>.rev-<revision>
DETAILS = ("token_ids", "prompt_tokens", "output_tokens", "mean_logprob", "first_token_ms", "decode_ms")


class RequestFailed(RuntimeError):
    """The server refused or failed a request; the message is the server's."""


@dataclass(frozen=True)
class Params:
    """A request's optional settings; None leaves one out (the server's default: greedy, no extra stop)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The settings as the generate endpoint's fields (and as vLLM's `sampling_parameters` keys)."""
        out = {k: v for k, v in self.__dict__.items() if v is not None and k != "stop"}
        return {**out, **({"stop": list(self.stop)} if self.stop else {})}


@dataclass(frozen=True)
class Generation:
    text: str               # text_output: the completion, cut before the first stop string
    token_ids: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int
    mean_logprob: float
    first_token_ms: float  # server side: from the request's arrival to its first token
    decode_ms: float       # server side: from the first token to the last
    latency_ms: float      # client side: the whole request

    def as_result(self) -> dict[str, Any]:
        """The form deploy.processing.is_well_formed checks."""
        return {"text_output": self.text, "output_tokens": self.output_tokens, "mean_logprob": self.mean_logprob}

    @classmethod
    def from_outputs(cls, text: str, outputs: dict[str, Any], latency_ms: float) -> "Generation":
        """From the final response's outputs ({name: value}, as JSON or from tensors) and the answer's whole text."""
        return cls(text=text, token_ids=tuple(int(t) for t in str(outputs["token_ids"]).split()),
                   prompt_tokens=int(outputs["prompt_tokens"]), output_tokens=int(outputs["output_tokens"]),
                   mean_logprob=float(outputs["mean_logprob"]), first_token_ms=float(outputs["first_token_ms"]),
                   decode_ms=float(outputs["decode_ms"]), latency_ms=latency_ms)


def grpc_inputs(prompt: str | bytes, *, params: Params = Params(), stream: bool = False,
                sampling_parameters: bool = True) -> list[Any]:
    """One request's tensors: text_input, stream, and the settings as vLLM's `sampling_parameters` JSON (or, with
    `sampling_parameters=False`, as TensorRT-LLM's individual inputs)."""
    import tritonclient.grpc as grpcclient

    def tensor(name: str, arr: np.ndarray, dtype: str) -> Any:
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        return inp

    text = prompt.encode("utf-8") if isinstance(prompt, str) else prompt
    inputs = [tensor("text_input", np.array([text], dtype=np.object_), "BYTES"),
              tensor("stream", np.array([stream]), "BOOL")]
    settings = params.as_json()
    if settings and sampling_parameters:
        inputs.append(tensor("sampling_parameters", np.array([json.dumps(settings).encode()], dtype=np.object_),
                             "BYTES"))
        return inputs
    for name, dtype, np_type in (("max_tokens", "INT32", np.int32), ("temperature", "FP32", np.float32),
                                 ("top_p", "FP32", np.float32), ("top_k", "INT32", np.int32),
                                 ("seed", "INT64", np.int64)):
        if (value := getattr(params, name)) is not None:
            inputs.append(tensor(name, np.array([value], dtype=np_type), dtype))
    if params.stop:
        inputs.append(tensor("stop", np.array([s.encode("utf-8") for s in params.stop], dtype=np.object_), "BYTES"))
    return inputs


def stream_requests(url: str, requests: list[list[Any]], *, model: str = "lmforge", version: int | None = None,
                    timeout: float = 120.0) -> Iterator[tuple[int, Any]]:
    """Send each request's tensors on one gRPC stream; yield (its index, tritonclient InferResult) as responses
    arrive, until every request has had its final response. A refused request raises RequestFailed: tritonclient's
    stream does not say which request an error answers, so send one request per stream to tell them apart."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: responses.put((result, error)), stream_timeout=timeout)
    try:
        for i, inputs in enumerate(requests):
            c.async_stream_infer(model, inputs, model_version=str(version or ""), request_id=str(i),
                                 enable_empty_final_response=True)
        pending = set(range(len(requests)))
        deadline = time.monotonic() + timeout
        while pending:
            try:
                result, error = responses.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RequestFailed(f"{len(pending)} of {len(requests)} requests had no final response within "
                                    f"{timeout:.0f} s") from None
            if error is not None:   # a refused request (tritonclient does not say which: one stream, one outcome)
                raise RequestFailed(error.message() or str(error))
            response = result.get_response()
            i = int(response.id)
            if response.parameters["triton_final_response"].bool_param:
                pending.discard(i)
            yield i, result
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()


def response_text(result: Any) -> str | None:
    """text_output of a gRPC response (None for an empty final response)."""
    arr = result.as_numpy("text_output")
    if arr is None:
        return None
    v = arr.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def response_details(result: Any) -> dict[str, Any] | None:
    """lmforge's outputs of a final gRPC response, or None when it carries none (an empty final response)."""
    if result.as_numpy("output_tokens") is None:
        return None
    out = {}
    for name in DETAILS:
        v = result.as_numpy(name).reshape(-1)[0]
        out[name] = v.decode("utf-8") if isinstance(v, bytes) else v.item()
    return out


def generate(url: str, prompts: list[str | bytes], *, protocol: Protocol = "http", model: str = "lmforge",
             version: int | None = None, params: Params = Params(), timeout: float = 120.0) -> list[Generation]:
    """A completion for each prompt, all in flight at once (the server batches them); RequestFailed when the server
    refuses one. HTTP: one generate-endpoint call per prompt; gRPC: one stream carrying every prompt."""
    if protocol == "http":
        def one(prompt: str | bytes) -> Generation:
            text = prompt.decode("utf-8") if isinstance(prompt, bytes) else prompt
            start = time.perf_counter()
            out = generate_endpoint(url, model, {"text_input": text, **params.as_json()}, version=version,
                                    timeout=timeout)
            return Generation.from_outputs(out["text_output"], out, (time.perf_counter() - start) * 1e3)
        with ThreadPoolExecutor(max_workers=min(len(prompts), 32) or 1) as pool:
            return list(pool.map(one, prompts))
    if protocol != "grpc":
        raise ValueError(f"protocol must be http or grpc, not {protocol!r}")
    return stream_generate(url, prompts, model=model, version=version, params=params, timeout=timeout)


def stream_generate(url: str, prompts: list[str | bytes], *, model: str = "lmforge", version: int | None = None,
                    params: Params = Params(), stream: bool = False, timeout: float = 120.0,
                    pieces: list[list[str]] | None = None) -> list[Generation]:
    """`generate` over one gRPC stream; with `stream`, each answer comes in pieces (appended to `pieces[i]` when
    given) and its text is their concatenation."""
    start = time.perf_counter()
    texts: list[list[str]] = [[] for _ in prompts]
    done: dict[int, Generation] = {}
    for i, response in stream_requests(url, [grpc_inputs(p, params=params, stream=stream) for p in prompts],
                                       model=model, version=version, timeout=timeout):
        if (text := response_text(response)) is not None:
            texts[i].append(text)
        if (details := response_details(response)) is not None:
            done[i] = Generation.from_outputs("".join(texts[i]), details, (time.perf_counter() - start) * 1e3)
    if pieces is not None:
        pieces.extend(texts)
    return [done[i] for i in range(len(prompts))]


def stream(url: str, prompt: str, *, model: str = "lmforge", version: int | None = None,
           params: Params = Params(), timeout: float = 120.0) -> Iterator[str]:
    """The answer to `prompt` piece by piece, as the server decodes it (gRPC, `stream: true`)."""
    for _, response in stream_requests(url, [grpc_inputs(prompt, params=params, stream=True)], model=model,
                                       version=version, timeout=timeout):
        if text := response_text(response):
            yield text


def _post(url: str, path: str, body: dict[str, Any], timeout: float) -> Any:
    req = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode("utf-8"),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")
        try:
            detail = json.loads(detail).get("error", detail)
        except json.JSONDecodeError:
            pass
        raise RequestFailed(f"HTTP {e.code}: {detail}") from None


def _model_path(model: str, version: int | None) -> str:
    return f"/v2/models/{model}" + (f"/versions/{version}" if version else "")


def generate_endpoint(url: str, model: str, body: dict[str, Any], *, version: int | None = None,
                      timeout: float = 120.0) -> dict[str, Any]:
    """POST body to Triton's generate extension (`/v2/models/<model>[/versions/<v>]/generate`), JSON in and out;
    RequestFailed with the server's error and HTTP status when it refuses."""
    with _post(url, _model_path(model, version) + "/generate", body, timeout) as resp:
        return json.loads(resp.read())


def generate_stream_endpoint(url: str, model: str, body: dict[str, Any], *, version: int | None = None,
                             timeout: float = 120.0) -> Iterator[dict[str, Any]]:
    """POST body to `.../generate_stream` and yield each server-sent event's JSON object as it arrives (an error
    event raises RequestFailed)."""
    with _post(url, _model_path(model, version) + "/generate_stream", body, timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:"):])
            if "error" in event:
                raise RequestFailed(f"HTTP {resp.status}: {event['error']}")
            yield event


def stream_endpoint_generate(url: str, prompt: str, *, model: str = "lmforge", version: int | None = None,
                             params: Params = Params(), timeout: float = 120.0) -> tuple[Generation, list[str]]:
    """One prompt through `.../generate_stream` with `stream: true`: its Generation (the pieces' concatenation, the
    final event's details) and the pieces as they came."""
    start = time.perf_counter()
    pieces, final = [], None
    for event in generate_stream_endpoint(url, model, {"text_input": prompt, "stream": True, **params.as_json()},
                                          version=version, timeout=timeout):
        if event.get("text_output"):
            pieces.append(event["text_output"])
        if "output_tokens" in event:
            final = event
    if final is None:
        raise RequestFailed("the stream ended without its final response")
    return Generation.from_outputs("".join(pieces), final, (time.perf_counter() - start) * 1e3), pieces


# --- what the server serves (HTTP) --------------------------------------------------

def make_client(url: str, *, timeout: float = 120.0) -> Any:
    """A tritonclient HTTP client (for health, the repository index, configs and statistics)."""
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout)


def ready_versions(url: str, model: str) -> dict[int, bool]:
    """{version: ready} for every version of `model` the server knows of."""
    return {v: state == "READY" for v, (state, _) in _index(url, model).items() if v}


def served_revision(url: str, model: str) -> str | None:
    """The revision of the config the server serves `model` with (in its instance group's name); None when it
    serves none."""
    from tritonclient.utils import InferenceServerException

    client = make_client(url, timeout=10.0)
    try:
        config = client.get_model_config(model)
    except InferenceServerException:  # not loaded (yet), or unknown
        return None
    finally:
        client.close()
    names = [group.get("name", "") for group in config.get("instance_group", [])]
    return next((name.rsplit(REVISION_MARK, 1)[1] for name in names if REVISION_MARK in name), None)


def wait_versions(url: str, model: str, versions: list[int], *, revision: str | None,
                  timeout: float, draining_ok: bool = False) -> dict[int, str]:
    """Wait until the server has picked up config.pbtxt `revision`, exactly `versions` are ready and nothing else is
    still loading or unloading; {version: state}.

    Triton polls the repository and loads the new config in the background; the versions
    serving until then keep serving (a failed load leaves them as they were). RequestFailed
    when a version fails to load (with Triton's reason), or when `timeout` s pass first. `draining_ok`: a dropped
    version still UNLOADING is fine (it takes no new request; Triton 2.51 can keep a version that refused malformed
    requests UNLOADING until the model is loaded again).
    """
    want = set(versions)
    before = _index(url, model)
    seen_loading: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        index = _index(url, model)
        states = {v: state for v, (state, _) in index.items() if v}
        seen_loading |= {v for v, (state, _) in index.items() if state == "LOADING"}
        # No version wanted (the model's folder was removed): done once the server serves no config for it and has
        # finished unloading it (the index no longer lists a removed model; readiness is false until it is unloaded).
        applied = (served_revision(url, model) is None and _server_ready(url)) if not want else \
            revision is None or served_revision(url, model) == revision
        ready = {v for v, state in states.items() if state == "READY"}
        # UNLOADING too: until a dropped version's stub has exited, strict readiness says the server is not ready.
        busy = ("LOADING",) if draining_ok else ("LOADING", "UNLOADING")
        if applied and ready == want and not any(s in busy for s in states.values()):
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


def wait_unloaded(url: str, model: str, model_dir: str | os.PathLike[str], *, timeout: float) -> None:
    """Wait until the server serves no version of `model`, whose folder `model_dir` lmforge has taken out of the
    repository, and no python-backend stub started from that folder runs on this host any more (the stub holds the
    model's memory until it exits); RequestFailed when `timeout` s pass first.

    Not the server's readiness: with strict readiness, a model that once failed to load keeps the server not ready
    until it restarts, whatever else loads or unloads; and the repository index drops a removed model at once, while
    it is still unloading. The stubs are found by their command line, which names the model.py they run."""
    prefix = os.path.join(os.path.realpath(model_dir), "")
    deadline = time.monotonic() + timeout
    while True:
        running = served_revision(url, model) is not None
        stubs = [] if running else _stubs_under(prefix)
        if not running and not stubs:
            return
        if time.monotonic() > deadline:
            raise RequestFailed(f"{model!r} was not unloaded within {timeout:.0f} s ("
                                + ("still served" if running else f"stub processes {stubs} still run") + ")")
        time.sleep(0.25)


def _stubs_under(prefix: str) -> list[int]:
    """Pids of python-backend stubs on this host whose model.py is under the folder `prefix`."""
    import psutil

    pids = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "python_backend_stub" in (proc.info["name"] or "") and len(cmd) > 1 and \
                os.path.realpath(cmd[1]).startswith(prefix):
            pids.append(proc.pid)
    return pids


def _server_ready(url: str) -> bool:
    client = make_client(url, timeout=10.0)
    try:
        return bool(client.is_server_ready())
    finally:
        client.close()


def _index(url: str, model: str) -> dict[int, tuple[str, str]]:
    """{version: (state, reason)} from the repository index; version 0 stands for the model as a whole."""
    client = make_client(url, timeout=10.0)
    try:
        index = client.get_model_repository_index()
    finally:
        client.close()
    return {int(m.get("version") or 0): (m.get("state", ""), m.get("reason", "")) for m in index
            if m.get("name") == model}
