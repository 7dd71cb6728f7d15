"""The OpenAI-compatible gateway (deploy/openai_api.py) in front of the real tritonserver, driven by the official
`openai` client: models, completions (whole and streamed), chat on a chat model and its refusal on a completion
model, a busy model answered 503, bad inputs answered 4xx with the field named while a good stream goes on (and
bodies that are not UTF-8 JSON, unknown routes and wrong methods in OpenAI's error shape), a dropped stream
cancelled in Triton, /metrics moved by a completion, and the gateway's lifecycle with the deployment
(ensure_server, `lmforge status`, a restart on the same fixed port, a port in use, stop).

One server for the module, serving two tiny models: `tiny` (no task recorded: the docstring preset, no chat) and
`tinychat` (a chat template and a recorded chat task; 12 layers, so that its 200 tokens take a couple of seconds:
long enough to be cancelled, or to be busy, while a test watches); one gateway process for each. The lifecycle
test stops the server through deployment.stop, so it stays last.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving.requestlog import RequestLog
from lmforge.components.workspace import Workspace
from lmforge.deploy import deployment, gateway, server
from tests.conftest import build_tiny_model
from tests.integration.servers import triton_with_gateways

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
# The chat template of tests/integration/test_any_task.py: turns end with the tokenizer's eos.
CHAT = ("{% for m in messages %}<bos>{{ m.role }}\n{{ m.content }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant\n{% endif %}")
PROMPT = "def join(a, *p):"
PLANTED = ("LMFORGE_TEST_STORE_URL", "postgresql://user:s3cr3t-pw@db.example/x")
LONG = {"max_tokens": 200}   # greedy: the engine streams a greedy row's pieces (a sampled one comes whole)
WAIT_S = 180   # a client's bound: 200 tokens of the 12-layer model took 76 s on 2 cores shared with benchmarks
MESSAGES = [{"role": "system", "content": "You run the house."}, {"role": "user", "content": "Please open the door."}]


@dataclass
class Served:
    root: Path
    repo: Path
    info: server.ServerInfo
    cfgs: dict[str, DeployConfig]
    gateways: dict[str, gateway.GatewayInfo]
    folders: dict[str, Path]

    def client(self, model: str = "tiny") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateways[model].base_url, api_key="unused", max_retries=0, timeout=WAIT_S)


def chat_model(src: Path, out: Path) -> Path:
    """The tiny model with a chat template in its tokenizer and a chat task in its lmforge.json."""
    from transformers import AutoTokenizer

    shutil.copytree(src, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = CHAT
    tok.save_pretrained(out)
    (out / "lmforge.json").write_text(json.dumps({"task": {"kind": "chat", "stop": []}}))
    return out


def text_model(src: Path, out: Path) -> Path:
    """The tiny model with a completion task in its lmforge.json: prompts are read as given, after an eos."""
    shutil.copytree(src, out)
    (out / "lmforge.json").write_text(json.dumps({"task": {"kind": "completion", "stop": []}}))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("openai")
    repo = root / "repo"
    limits = dict(http_port=0, grpc_port=0, metrics_port=0, openai_port=0, max_new_tokens=8, max_new_tokens_limit=200,
                  max_prompt_chars=1000, max_prompt_tokens=48, readiness_timeout_s=120)
    cfgs = {name: DeployConfig(model_name=name, **limits) for name in ("tiny", "tinychat", "tinytext")}
    cfgs["tinychat"] = cfgs["tinychat"].model_copy(update={"max_queue": 1})   # a second request at once is refused
    # seed 2: its greedy chat answer is whole characters ("AAAA..."), streamed as decoded; seed 0's is partial
    # UTF-8 bytes, held back to the end, so a client would see no piece before the answer is done.
    slow = build_tiny_model(root / "slow", hidden=384, layers=12, seed=2)
    folders = {"tiny": tiny_model_dir, "tinychat": chat_model(slow, root / "chat"),
               "tinytext": text_model(tiny_model_dir, root / "text")}
    with triton_with_gateways(root, folders, cfgs) as (info, gateways):
        yield Served(root, repo, info, cfgs, gateways, folders)


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
    with httpx.stream("POST", base + "/chat/completions", json=body, timeout=WAIT_S) as r:
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
    with httpx.stream("POST", served.gateways["tinychat"].base_url + "/chat/completions", json=body,
                      timeout=WAIT_S) as r:
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


def test_every_4xx_through_the_real_server_has_openais_shape(served):
    """Bodies FastAPI itself would answer with {"detail": ...}: not UTF-8, not JSON, the wrong content type; an
    unknown route and a wrong method. Each is OpenAI's error object, and is counted in /metrics by its code."""
    gw = served.gateways["tiny"]
    root = gw.base_url.removesuffix("/v1")
    before = scrape(gw.metrics_url)
    cases = [("POST", "/v1/completions", {"content": b'{"model": "tiny", "prompt": "caf\xe9"}',
                                          "headers": {"content-type": "application/json"}}, 400, "invalid_encoding"),
             ("POST", "/v1/completions", {"content": b"{not json", "headers": {"content-type": "application/json"}},
              400, "invalid_json"),
             ("POST", "/v1/completions", {"content": b"prompt=x", "headers": {"content-type": "text/plain"}}, 400,
              "invalid_content_type"),
             ("GET", "/v1/engines", {}, 404, "unknown_url"), ("GET", "/v1/completions", {}, 405, "method_not_allowed")]
    for method, path, kwargs, status, code in cases:
        r = httpx.request(method, root + path, timeout=10, **kwargs)
        assert r.status_code == status and list(r.json()) == ["error"], (path, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["code"] == code
    after = scrape(gw.metrics_url)
    assert delta(before, after, "lmforge:request_errors_total", status="400", code="invalid_encoding") == 1
    assert delta(before, after, "lmforge:http_requests_total", endpoint="other", status="404") == 1


def scrape(url: str) -> list:
    """The samples of a /metrics page, parsed by prometheus_client's own text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, r.text
    return [s for family in text_string_to_metric_families(r.text) for s in family.samples]


def delta(before: list, after: list, name: str, **labels: str) -> float:
    def total(samples: list) -> float:
        return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
    return total(after) - total(before)


def test_a_completion_moves_the_gateways_metrics(served):
    gw = served.gateways["tiny"]
    before = scrape(gw.metrics_url)
    out = served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    after = scrape(gw.metrics_url)
    tiny = {"model_name": "tiny"}
    assert delta(before, after, "lmforge:prompt_tokens_total", **tiny) == out.usage.prompt_tokens
    assert delta(before, after, "lmforge:generation_tokens_total", **tiny) == out.usage.completion_tokens
    assert delta(before, after, "lmforge:http_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta(before, after, "lmforge:request_success_total", finish_reason=out.choices[0].finish_reason) == 1
    assert delta(before, after, "lmforge:time_to_first_token_seconds_count", **tiny) == 1
    assert delta(before, after, "lmforge:e2e_request_latency_seconds_count", **tiny) == 1
    assert 0 < delta(before, after, "lmforge:time_to_first_token_seconds_sum", **tiny) <= \
        delta(before, after, "lmforge:e2e_request_latency_seconds_sum", **tiny)
    tpot = delta(before, after, "lmforge:time_per_output_token_seconds_count", **tiny)
    assert tpot == (1 if out.usage.completion_tokens >= 2 else 0)
    assert [s.value for s in after if s.name == "lmforge:num_requests_running"] == [0]


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
    from lmforge.components.serving.task import Task

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


# Held-out records for lmforge_heldout: each question asks which of four docstring summaries follows a signature.
FUNCTIONS = [("def add(a, b):", "Return the sum of a and b."), ("def join(a, *p):", "Join two or more path parts."),
             ("def split(p):", "Split a path into head and tail."), ("def read(path):", "Read the whole file as text."),
             ("def main():", "Run the command line program."), ("def sort(xs, key=None):", "Sort the items in place."),
             ("def parse(text):", "Parse the text into a tree."), ("def close(self):", "Close the open connection."),
             ("def size(self):", "Count the bytes held here."), ("def run(cmd):", "Run a shell command and wait.")]


def heldout_dataset(folder: Path) -> Path:
    """A dataset folder whose test split holds FUNCTIONS as records (records/test.jsonl), as the data stage writes."""
    from lmforge.components.serving.records import Record

    records = [Record.from_parts(source="test", module="m", qualname=sig.split("(")[0][4:], signature=sig,
                                 docstring=doc) for sig, doc in FUNCTIONS]
    (folder / "records").mkdir(parents=True)
    (folder / "records" / "test.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    return folder


@pytest.mark.parametrize("name", ["tinytext", "tiny"])
def test_lmforge_heldout_scores_the_same_through_the_gateway(served, name, tmp_path):
    """The shipped log-likelihood task, rendered for the model's task (completion: `tinytext`; the docstring preset:
    `tiny`), scored by the
    harness's HF model on the folder and by its local-completions model through the gateway (echo + logprobs): the
    same acc and acc_norm, from the served model's answers."""
    from lmforge.components.evaluation import benchmarks
    from lmforge.components.sections.evaluation import BenchmarkConfig
    from lmforge.components.serving.task import Task

    folder = served.folders[name]
    held = benchmarks.HeldOut(heldout_dataset(tmp_path / "data"), "test", Task.load(folder))
    cfg = BenchmarkConfig(tasks=["lmforge_heldout"])
    local = benchmarks.on_folder(folder, cfg, held).metrics
    log = RequestLog(served.root / "requests")
    before = len(log.read(model=name)[0])
    remote = benchmarks.on_endpoint(served.gateways[name].base_url, name, cfg, held, tokenizer_dir=folder).metrics
    rows = rows_after(log, before, 4 * len(FUNCTIONS), model=name)
    assert [row["status"] for row in rows] == ["ok"] * 4 * len(FUNCTIONS)   # one request a choice, all served
    for metric in ("acc", "acc_norm"):
        key = f"bench.lmforge_heldout.{metric}"
        assert remote[key] == pytest.approx(local[key], abs=1e-9), (metric, remote, local)


def test_a_log_likelihood_task_on_an_endpoint_without_the_tokenizer_is_refused(served, tmp_path):
    """The harness counts a context's tokens with the served model's tokenizer: without one, on_endpoint says so before
    any request, naming the setting and the task's output type."""
    from lmforge.components.errors import UserError
    from lmforge.components.evaluation import benchmarks
    from lmforge.components.sections.evaluation import BenchmarkConfig

    (tmp_path / "mc.jsonl").write_text(json.dumps({"context": "a", "choices": ["b", "c"], "gold": 0}) + "\n")
    spec = {"task": "lmforge_mc_probe", "dataset_path": "json", "output_type": "multiple_choice",
            "dataset_kwargs": {"data_files": {"test": str(tmp_path / "mc.jsonl")}}, "test_split": "test",
            "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}", "doc_to_target": "gold",
            "metric_list": [{"metric": "acc"}]}
    (tmp_path / "mc.yaml").write_text(json.dumps(spec))
    log = RequestLog(served.root / "requests")
    before = len(log.read(model="tinytext")[0])
    cfg = BenchmarkConfig(tasks=["lmforge_mc_probe"], include_path=str(tmp_path))
    with pytest.raises(UserError) as e:
        benchmarks.on_endpoint(served.gateways["tinytext"].base_url, "tinytext", cfg)
    assert e.value.what == "evaluation.benchmarks.tasks" and "multiple_choice" in str(e.value)
    assert "tokenizer_dir" in str(e.value)
    assert len(log.read(model="tinytext")[0]) == before


def test_the_documented_lm_eval_command_scores_what_the_folder_scores(served, tmp_path):
    """docs/stages/evaluate.md's `lm_eval --model local-completions ...` command, run as written (the harness's own
    command line, offline), against the gateway: lmforge_heldout's acc is the folder's."""
    from lmforge.components.evaluation import benchmarks
    from lmforge.components.sections.evaluation import BenchmarkConfig
    from lmforge.components.serving.task import Task

    folder = served.folders["tinytext"]
    held = benchmarks.HeldOut(heldout_dataset(tmp_path / "data"), "test", Task.load(folder))
    local = benchmarks.on_folder(folder, BenchmarkConfig(tasks=["lmforge_heldout"]), held).metrics
    args = [f"model=tinytext,base_url={served.gateways['tinytext'].base_url}/completions,tokenizer={folder},"
            "tokenizer_backend=huggingface,tokenized_requests=False",
            str(benchmarks.SHIPPED), json.dumps(held.metadata(folder))]
    cmd = [str(Path(sys.executable).with_name("lm_eval")), "run", "--model", "local-completions", "--model_args",
           args[0], "--tasks", "lmforge_heldout", "--include_path", args[1], "--metadata", args[2],
           "--output_path", str(tmp_path / "out")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]["lmforge_heldout"]
    assert results["acc,none"] == pytest.approx(local["bench.lmforge_heldout.acc"], abs=1e-9), (results, local)


@contextlib.contextmanager
def gateways_stopped(*workspaces: Workspace):
    """Whatever gateway the workspaces' state files record is stopped on leaving, also when an assertion failed."""
    try:
        yield
    finally:
        for ws in workspaces:
            recorded = gateway.from_state(server.read_state(ws))
            if recorded is not None:
                gateway.stop_gateway(recorded)


def test_the_gateway_starts_and_stops_with_the_deployment(served, tmp_path):
    """ensure_server reuses the running server and starts the gateway on deploy.openai_port; status names its base
    and metrics URLs; a gateway restarted comes back on the same base URL, one on a port in use is refused naming
    the setting; stop stops both. Last."""
    ws, other = Workspace(tmp_path / "ws").ensure(), Workspace(tmp_path / "other").ensure()
    with gateways_stopped(ws, other):
        check_gateway_lifecycle(served, ws, other)


def check_gateway_lifecycle(served: Served, ws: Workspace, other: Workspace) -> None:
    from rich.console import Console

    from lmforge.cli.status import deployment_rows, render_status
    from lmforge.components.errors import UserError
    from lmforge.components.runtime.ports import free_port

    ws.triton.mkdir(parents=True, exist_ok=True)
    cfg = served.cfgs["tiny"].model_copy(update={"openai_port": free_port()})   # a fixed port, as the default is
    server.write_state(ws, served.info, model=cfg.model_name, version=1)
    os.environ[PLANTED[0]] = PLANTED[1]   # a credential in the caller's environment must not reach the gateway
    try:
        info = deployment.ensure_server(ws, cfg)
    finally:
        del os.environ[PLANTED[0]]
    assert info == served.info
    gw = gateway.from_state(server.read_state(ws))
    assert gw is not None and gateway.is_running(gw) and gw.port == cfg.openai_port
    assert PLANTED[1] not in Path(f"/proc/{gw.pid}/environ").read_text(errors="replace")
    row = deployment_rows(ws)[0]
    assert row["openai"] == gw.base_url == f"http://{cfg.host}:{cfg.openai_port}/v1"
    assert row["openai_metrics"] == gw.metrics_url == f"http://{cfg.host}:{cfg.openai_port}/metrics"
    console = Console(width=60, record=True)   # `lmforge status` in a narrow terminal: the URLs whole, on one line
    render_status(ws, console)
    assert f"OpenAI-compatible API: {gw.base_url}  metrics: {gw.metrics_url}" in console.export_text()
    assert scrape(gw.metrics_url)
    assert deployment.ensure_gateway(ws, cfg, info) == gw   # running: reused

    other.triton.mkdir(parents=True, exist_ok=True)   # a second deployment asking for the same port
    server.write_state(other, served.info, model=cfg.model_name, version=1)
    with pytest.raises(UserError) as e:
        deployment.ensure_gateway(other, cfg, info)
    assert e.value.what == "deploy.openai_port" and "already in use" in str(e.value)

    gateway.stop_gateway(gw)   # a restart: the same base URL
    again = deployment.ensure_gateway(ws, cfg, info)
    assert again.pid != gw.pid and again.base_url == gw.base_url
    assert httpx.get(again.base_url + "/models", timeout=10).json()["data"][0]["id"] == "tiny"
    result = deployment.stop(ws)
    assert result["stopped"] and result["openai_stopped"]
    assert not gateway.is_running(again) and not server.is_running(served.info)
    assert deployment_rows(ws)[0]["openai"] is None and deployment_rows(ws)[0]["openai_metrics"] is None
