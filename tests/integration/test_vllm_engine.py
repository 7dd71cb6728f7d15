"""[deploy] engine = "vllm" through a real Triton server: the instance starts vLLM's server from .venv-vllm and
streams its tokens through lmforge's stopping rule (components/serving/vllm_engine.py).

Skipped where .venv-vllm is not built (`make vllm`; ~2 GB, a few minutes): vLLM pins its own torch and
transformers. vLLM takes a minute or two to start on 2 cores, so the module shares one server.
"""

from __future__ import annotations

import os
import queue as queuelib
import time

import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving.requestlog import RequestLog
from lmforge.components.serving.task import DEMO
from lmforge.deploy import client, repository, server
from tests.conftest import build_tiny_model


def vllm_missing() -> str | None:
    try:
        repository.vllm_python()
    except UserError as e:
        return str(e)
    return None


pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(vllm_missing() is not None, reason=f"no vLLM venv: {vllm_missing()}")]

PROMPTS = ["def join(a, *p):", "def encode(s, errors='strict'):", "class Queue:", "def fnmatch(name, pat):",
           "def b64decode(s, altchars=None):", "def dumps(obj, *, indent=None):", "def wrap(text, width=70):",
           "def copyfile(src, dst):"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    model = build_tiny_model(root / "model", hidden=256, layers=2, seed=0)   # head_dim 64: vLLM's CPU kernels take it
    cfg = DeployConfig(model_name="tinyvllm", engine="vllm", http_port=0, grpc_port=0, metrics_port=0,
                       max_new_tokens=16, max_new_tokens_limit=200, max_prompt_tokens=64, max_requests_per_step=16,
                       kv_cache_tokens=8192, readiness_timeout_s=600)
    repo, groups = root / "repo", set()
    repository.build_version(repo, cfg, version=1, model_dir=model)
    repository.write_config(repo, cfg, versions=[1], request_log=root / "requests")
    info = server.start_server(repo, cfg, log_path=root / "server.log")
    try:
        server.wait_ready(info, timeout=600)
        client.wait_versions(info.url, cfg.model_name, [1], revision=repository.config_revision(repo, cfg.model_name),
                             timeout=600)
        groups.update(os.getpgid(pid) for pid in vllm_servers(repo))   # the server, its engine core and workers
        assert groups, "the instance should have started vLLM's server"
        yield root, model, cfg, info
    finally:
        server.stop_server(info)
        assert not server.is_running(info)
        deadline = time.monotonic() + 60   # the instance's finalize stops vLLM's whole process group
        while (left := in_groups(groups)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"vLLM's processes outlived the Triton model: {left}"


def vllm_servers(repo) -> list[int]:
    """Pids of vLLM servers running a model folder under `repo`."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in cmd and any(str(repo) in a for a in cmd):
            found.append(p.info["pid"])
    return found


def in_groups(groups: set[int]) -> list[str]:
    """The processes still in any of these process groups, as "pid name"."""
    import psutil

    left = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if os.getpgid(p.info["pid"]) in groups:
                left.append(f"{p.info['pid']} {p.info['name']}")
        except ProcessLookupError:
            continue
    return left


def solo(model_dir, prompts: list[str], limits: list[int]):
    from lmforge.components.serving import generation, modelload

    model, tok = modelload.load_model(model_dir), modelload.load_tokenizer(model_dir)
    return [generation.generate(model, tok, [DEMO.encode(tok, p)], max_new_tokens=n, stop_strings=DEMO.stop_strings)[0]
            for p, n in zip(prompts, limits)]


def test_vllm_streams_each_request_token_equal_to_the_transformers_path(served):
    """16 concurrent streams of mixed lengths through Triton and vLLM: several pieces each, and each answer token for
    token what lmforge's own generation gives for that prompt alone (greedy, fp32)."""
    root, model, cfg, info = served
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    limits = [4 + (i * 7) % 29 for i in range(16)]
    requests = [client.grpc_inputs(p, params=client.Params(max_tokens=n), stream=True) for p, n in zip(prompts, limits)]
    texts: list[list[str]] = [[] for _ in prompts]
    finals: dict[int, object] = {}
    for i, response in client.stream_requests(info.grpc_url, requests, model=cfg.model_name, timeout=300):
        if (text := client.response_text(response)) is not None:
            texts[i].append(text)
        if response.as_numpy("output_tokens") is not None:
            finals[i] = response
    assert sorted(finals) == list(range(16))
    for i, want in enumerate(solo(model, prompts, limits)):
        ids = tuple(int(t) for t in finals[i].as_numpy("token_ids")[0].decode().split())
        assert ids == want.token_ids and "".join(texts[i]) == want.text, i
    assert max(len(t) for t in texts) > 3   # streamed: the longer answers came in several responses
    assert vllm_servers(root / "repo"), "the answers must come from vLLM's server, started by the instance"
    statuses = [r["status"] for r in RequestLog(root / "requests").read(model=cfg.model_name)[0]]
    assert statuses.count("ok") >= 16


def test_a_cancelled_vllm_stream_is_logged_cancelled_and_the_next_request_is_answered(served):
    import tritonclient.grpc as grpcclient

    root, model, cfg, info = served
    log = RequestLog(root / "requests")
    before = len(log.read(model=cfg.model_name)[0])
    got: queuelib.Queue = queuelib.Queue()
    c = grpcclient.InferenceServerClient(info.grpc_url)
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    c.async_stream_infer(cfg.model_name, client.grpc_inputs(PROMPTS[0], params=client.Params(max_tokens=190),
                                                            stream=True))
    result, error = got.get(timeout=120)       # the first piece has arrived: the request is decoding
    assert error is None and client.response_text(result) is not None
    c.stop_stream(cancel_requests=True)
    c.close()
    deadline = time.monotonic() + 30
    while not (rows := log.read(model=cfg.model_name)[0][before:]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [r["status"] for r in rows] == ["cancelled"], rows
    assert client.generate(info.url, [PROMPTS[1]], model=cfg.model_name)[0].output_tokens >= 1
