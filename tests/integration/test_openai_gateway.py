"""The OpenAI-compatible gateway (deploy/openai_api.py) in front of the real tritonserver, driven by the official
`openai` client: models, completions (whole and streamed), chat on a chat model and its refusal on a completion
model, a busy model answered 503, bad inputs answered 4xx with the field named while a good stream goes on, a
dropped stream cancelled in Triton, and the gateway's lifecycle with the deployment (ensure_server, `lmforge
status`, stop).

One server for the module, serving two tiny models: `tiny` (no task recorded: the docstring preset, no chat) and
`tinychat` (a chat template and a recorded chat task; 12 layers, so that its 200 tokens take a couple of seconds:
long enough to be cancelled, or to be busy, while a test watches); one gateway process for each. The lifecycle
test stops the server through service.stop, so it stays last.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lmforge.components.requestlog import RequestLog
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.workspace import Workspace
from lmforge.deploy import client, gateway, repository, server
from lmforge.deploy import service as deploy_service
from tests.conftest import build_tiny_model

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
# The chat template of tests/integration/test_any_task.py: turns end with the tokenizer's eos.
CHAT = ("{% for m in messages %}<bos>{{ m.role }}\n{{ m.content }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant\n{% endif %}")
PROMPT = "def join(a, *p):"
PLANTED = ("LMFORGE_TEST_STORE_URL", "postgresql://user:s3cr3t-pw@db.example/x")
LONG = {"max_tokens": 200}   # greedy: the engine streams a greedy row's pieces (a sampled one comes whole)
MESSAGES = [{"role": "system", "content": "You run the house."}, {"role": "user", "content": "Please open the door."}]


@dataclass
class Served:
    root: Path
    repo: Path
    info: server.ServerInfo
    cfgs: dict[str, DeployConfig]
    gateways: dict[str, gateway.GatewayInfo]

    def client(self, model: str = "tiny") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateways[model].base_url, api_key="unused", max_retries=0, timeout=60)


def chat_model(src: Path, out: Path) -> Path:
    """The tiny model with a chat template in its tokenizer and a chat task in its lmforge.json."""
    from transformers import AutoTokenizer

    shutil.copytree(src, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = CHAT
    tok.save_pretrained(out)
    (out / "lmforge.json").write_text(json.dumps({"task": {"kind": "chat", "stop": []}}))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("openai")
    repo = root / "repo"
    limits = dict(http_port=0, grpc_port=0, metrics_port=0, max_new_tokens=8, max_new_tokens_limit=200,
                  max_prompt_chars=1000, max_prompt_tokens=48, readiness_timeout_s=120)
    cfgs = {name: DeployConfig(model_name=name, **limits) for name in ("tiny", "tinychat")}
    cfgs["tinychat"] = cfgs["tinychat"].model_copy(update={"max_queue": 1})   # a second request at once is refused
    # seed 2: its greedy chat answer is whole characters ("AAAA..."), streamed as decoded; seed 0's is partial
    # UTF-8 bytes, held back to the end, so a client would see no piece before the answer is done.
    slow = build_tiny_model(root / "slow", hidden=384, layers=12, seed=2)
    folders = {"tiny": tiny_model_dir, "tinychat": chat_model(slow, root / "chat")}
    for name, cfg in cfgs.items():   # config.pbtxt before the server starts: it loads what the repository holds
        repository.build_version(repo, cfg, version=1, model_dir=folders[name])
        repository.write_config(repo, cfg, versions=[1], request_log=root / "requests")
    info = server.start_server(repo, cfgs["tiny"], log_path=root / "server.log")
    gateways: dict[str, gateway.GatewayInfo] = {}
    try:
        server.wait_ready(info, timeout=120)
        for name, cfg in cfgs.items():
            client.wait_versions(info.url, name, [1], revision=repository.config_revision(repo, name), timeout=120)
            gateways[name] = gateway.start_gateway(repo, cfg, triton_grpc=info.grpc_url,
                                                   log_path=root / f"gateway-{name}.log", wait=60)
        yield Served(root, repo, info, cfgs, gateways)
    finally:
        for gw in gateways.values():
            gateway.stop_gateway(gw)
        server.stop_server(info)
        assert not server.is_running(info)


def sse_lines(base_url: str, path: str, body: dict) -> list[str]:
    """The `data:` payloads of a streamed answer, as sent."""
    with httpx.stream("POST", base_url + path, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def test_models_and_a_completion(served):
    c = served.client()
    assert [m.id for m in c.models.list().data] == ["tiny"]
    out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason in ("stop", "length") and isinstance(out.choices[0].text, str)
    assert 1 <= out.usage.completion_tokens <= 6 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert c.completions.create(model="tiny", prompt=[PROMPT], max_tokens=6).choices[0].text == out.choices[0].text


def test_a_streamed_completion_is_the_whole_one_in_pieces(served):
    c = served.client()
    whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    events = sse_lines(served.gateways["tiny"].base_url, "/completions",
                       {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "stream": True,
                        "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == whole.usage.completion_tokens


def test_chat_on_a_completion_model_is_refused_with_the_reason(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(model="tiny", messages=MESSAGES)
    error = e.value.response.json()["error"]
    assert error["param"] == "messages" and "no chat template/task" in error["message"]
    assert "/v1/completions" in error["message"]


def test_chat_on_a_chat_model(served):
    c = served.client("tinychat")
    out = c.chat.completions.create(model="tinychat", messages=MESSAGES, max_tokens=12)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")
    chunks = list(c.chat.completions.create(model="tinychat", messages=MESSAGES, max_tokens=12, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_a_busy_model_is_503_with_retry_after(served):
    base = served.gateways["tinychat"].base_url
    body = {"model": "tinychat", "messages": MESSAGES, "stream": True, **LONG}
    with httpx.stream("POST", base + "/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))   # the first request is in flight
        busy = httpx.post(base + "/chat/completions", json={**body, "stream": False}, timeout=30)
        assert [line for line in lines if line][-1] == "data: [DONE]"   # read to the end: nothing is cancelled here
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
    assert " is busy: " in busy.json()["error"]["message"] and busy.json()["error"]["type"] == "server_error"


def test_a_dropped_stream_is_cancelled_in_triton(served):
    """A client that goes away after the first piece: the gateway cancels the gRPC call, the model drops the
    request (its log says `cancelled`) long before the 200 tokens it asked for."""
    whole = served.client("tinychat").chat.completions.create(model="tinychat", messages=MESSAGES, **LONG)
    assert whole.choices[0].finish_reason == "length", "this seed's answer should run to max_tokens"
    log = RequestLog(served.root / "requests")
    before = len(log.read(model="tinychat")[0])
    body = {"model": "tinychat", "messages": MESSAGES, "stream": True, **LONG}
    with httpx.stream("POST", served.gateways["tinychat"].base_url + "/chat/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        rows = log.read(model="tinychat")[0][before:]
        if rows:
            break
        time.sleep(0.2)
    assert [row["status"] for row in rows] == ["cancelled"], rows
    assert rows[0]["output_tokens"] < 200


def test_bad_inputs_are_4xx_naming_the_field_while_a_good_stream_completes(served):
    base = served.gateways["tiny"].base_url
    events: list[str] = []
    good = threading.Thread(target=lambda: events.extend(
        sse_lines(base, "/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 150, "stream": True})))
    good.start()
    c = served.client()
    bad = [({"n": 2}, openai.BadRequestError, "n"), ({"max_tokens": -1}, openai.BadRequestError, "max_tokens"),
           ({"temperature": "hot"}, openai.BadRequestError, "temperature"),
           ({"model": "nope"}, openai.NotFoundError, "model")]
    for fields, error, param in bad:
        with pytest.raises(error) as e:
            c.completions.create(**{"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **fields})
        body = e.value.response.json()["error"]
        assert body["param"] == param and param in body["message"], body
    r = httpx.post(base + "/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    good.join(timeout=60)
    assert not good.is_alive() and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_gateway_starts_and_stops_with_the_deployment(served, tmp_path):
    """ensure_server reuses the running server and starts the gateway; status names it; stop stops both. Last."""
    ws = Workspace(tmp_path / "ws").ensure()
    ws.triton.mkdir(parents=True, exist_ok=True)
    cfg = served.cfgs["tiny"]
    server.write_state(ws, served.info, model=cfg.model_name, version=1)
    os.environ[PLANTED[0]] = PLANTED[1]   # a credential in the caller's environment must not reach the gateway
    try:
        info = deploy_service.ensure_server(ws, cfg)
    finally:
        del os.environ[PLANTED[0]]
    assert info == served.info
    gw = gateway.from_state(server.read_state(ws))
    assert gw is not None and gateway.is_running(gw)
    assert PLANTED[1] not in Path(f"/proc/{gw.pid}/environ").read_text(errors="replace")
    from lmforge.cli.status import deployment_rows

    assert deployment_rows(ws)[0]["openai"] == gw.base_url == f"http://{cfg.host}:{gw.port}/v1"
    assert deploy_service.ensure_gateway(ws, cfg, info) == gw   # running: reused
    assert httpx.get(gw.base_url + "/models", timeout=10).json()["data"][0]["id"] == "tiny"
    result = deploy_service.stop(ws)
    assert result["stopped"] and result["openai_stopped"]
    assert not gateway.is_running(gw) and not server.is_running(served.info)
    assert deployment_rows(ws)[0]["openai"] is None
