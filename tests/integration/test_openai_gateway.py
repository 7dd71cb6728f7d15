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


def rows_after(log: RequestLog, start: int, n: int, timeout_s: float = 20, *, model: str = "tinychat") -> list[dict]:
    """`model`'s log rows from index `start` on, once there are at least `n` of them (or the timeout passes)."""
    deadline = time.monotonic() + timeout_s
    while len(rows := log.read(model=model)[0][start:]) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    return rows


def test_a_dropped_stream_is_cancelled_in_triton(served):
    """A client that goes away after the first piece: the gateway cancels the gRPC call, the model drops the
    request (its log says `cancelled`) long before the 200 tokens it asked for."""
    log = RequestLog(served.root / "requests")
    before = len(log.read(model="tinychat")[0])
    whole = served.client("tinychat").chat.completions.create(model="tinychat", messages=MESSAGES, **LONG)
    assert whole.choices[0].finish_reason == "length", "this seed's answer should run to max_tokens"
    # The model logs a request just after its final response is out: wait for this one's row before the next.
    assert [row["status"] for row in rows_after(log, before, 1)] == ["ok"]
    body = {"model": "tinychat", "messages": MESSAGES, "stream": True, **LONG}
    with httpx.stream("POST", served.gateways["tinychat"].base_url + "/chat/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    rows = rows_after(log, before + 1, 1)
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


# Function signatures for the harness test: each context is the tokenizer's eos, a signature and the docstring
# opening, as the served `tiny` (the docstring preset) renders a prompt, so both sides read the same tokens.
SIGNATURES = ("def add(a, b):", "def join(a, *p):", "def split(p):", "def read(path):", "def main():",
              "def sort(xs, key=None):", "def parse(text):", "def close(self):", "def size(self):", "def run(cmd):")
UNTIL = ["\n", '"""']   # the docstring close: where the served preset stops too


def greedy_answers(model_dir: Path, contexts: list[str], max_new: int) -> list[str]:
    """What the model folder greedily answers to each context (fp32), cut at UNTIL as the harness cuts it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    answers = []
    for context in contexts:
        ids = torch.tensor([tok(context, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        for stop in UNTIL:
            text = text.split(stop)[0]
        answers.append(text)
    return answers


def test_a_harness_task_scores_the_same_on_the_folder_and_through_the_gateway(served, tiny_model_dir, tmp_path):
    """A generate_until task of lm-evaluation-harness run by benchmarks.on_folder (the harness's HF model on the
    folder) and by benchmarks.on_endpoint (its local-completions model through this gateway): greedy fp32 on both
    sides, so the same answers and the same exact_match. Half the targets are the model's own greedy answers."""
    from transformers import AutoTokenizer

    from lmforge.components.evaluation import benchmarks
    from lmforge.components.sections.evaluation import BenchmarkConfig
    from lmforge.components.task import Task

    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token
    assert Task.load(tiny_model_dir).kind == "docstring"   # what the server renders `tiny`'s prompts with
    contexts = [eos + Task("docstring").plain(sig) for sig in SIGNATURES]
    answers = greedy_answers(tiny_model_dir, contexts, max_new=16)
    assert all(answers), answers   # each a few tokens: an exact match is not the empty string matching itself
    targets = [a if i % 2 == 0 else f"{a} not this" for i, a in enumerate(answers)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in zip(contexts, targets)))
    folder = tmp_path / "tasks"
    folder.mkdir()
    spec = {"task": "lmforge_gateway_parity", "output_type": "generate_until", "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
            "doc_to_text": "{{context}}", "doc_to_target": "{{target}}",
            "generation_kwargs": {"until": UNTIL, "max_gen_toks": 16, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    (folder / "parity.yaml").write_text(json.dumps(spec))   # JSON is YAML
    cfg = BenchmarkConfig(tasks=["lmforge_gateway_parity"], include_path=str(folder))
    local = benchmarks.on_folder(tiny_model_dir, cfg).metrics
    log = RequestLog(served.root / "requests")
    before = len(log.read(model="tiny")[0])
    remote = benchmarks.on_endpoint(served.gateways["tiny"].base_url, "tiny", cfg).metrics
    served_rows = rows_after(log, before, len(contexts), model="tiny")
    assert [row["status"] for row in served_rows] == ["ok"] * len(contexts)   # every answer came from the server
    key = "bench.lmforge_gateway_parity.exact_match"
    assert local[key] == pytest.approx(0.5), (local, answers)   # the harness answers as greedy_answers does
    assert remote[key] == pytest.approx(local[key], abs=1e-9), (remote, local)
    assert remote[key + "_stderr"] == pytest.approx(local[key + "_stderr"], abs=1e-9)


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
