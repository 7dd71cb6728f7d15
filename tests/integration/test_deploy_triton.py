"""The real tritonserver on loopback: serving, one generation path, no model control from clients (and no
secret in its command line or environment), the bad-input list (HTTP 400), the rollout gate and rollback.

One server for the module (started once, always stopped); the tests run in order and
each leaves version 1 or its successor serving. The last test breaks readiness on
purpose (a version that fails to load in Triton), so it stays last.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from lmforge.components.requestlog import RequestLog
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.task import DEMO
from lmforge.deploy import client, processing, repository, server
from lmforge.deploy.rollout import RolloutRefused, rollout
from tests.conftest import build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
# Signatures in the style of the demo corpus: the tiny model's folder records no task, so it serves the docstring preset.
SIGNATURES = ["def dumps(obj, *, skipkeys=False, ensure_ascii=True, indent=None):", "def join(a, *p):",
              "def getsource(object):", "def create_connection(address, timeout=None, source_address=None):",
              "class OrderedDict(dict):", "def literal_eval(node_or_string):",
              "def urlsplit(url, scheme='', allow_fragments=True):", "def sha256(data=b''):",
              "def loads(s, *, cls=None, object_hook=None, parse_float=None):", "def splitext(p):",
              "def getmembers(object, predicate=None):", "def dedent(text):", "def deepcopy(x, memo=None, _nil=[]):",
              "def urlencode(query, doseq=False, safe='', encoding=None, errors=None):", "class Counter(dict):",
              "def b64encode(s, altchars=None):", "def gethostbyname(host):", "def fnmatch(name, pat):",
              "def dump(obj, fp, *, skipkeys=False, indent=None):", "def shuffle(self, x):"]
PLANTED_SECRET = ("LMFORGE_TEST_API_TOKEN", "planted-secret-3f9a")
# Credentials inside the values of harmlessly named variables (a tracking URI, a DSN): no name-based filter catches them.
PLANTED_IN_VALUES = {"LMFORGE_TEST_STORE_URL": "postgresql://user:s3cr3t-pw@db.example/x",
                     "MY_APP_DSN": "mysql://app:dsn-pw-77c1@10.0.0.5/app"}
PLANTED = {PLANTED_SECRET[0]: PLANTED_SECRET[1], **PLANTED_IN_VALUES}


class Deployment:
    def __init__(self, root: Path, cfg: DeployConfig, info: server.ServerInfo) -> None:
        self.root, self.cfg, self.info = root, cfg, info
        self.repo, self.requests, self.journal = root / "repo", root / "requests", root / "rollouts.jsonl"
        self.promoted: list[int] = []

    def rollout(self, version: int, model_dir: Path | None, cfg: DeployConfig | None = None):
        cfg = cfg or self.cfg
        build = (lambda: repository.build_version(self.repo, cfg, version=version, model_dir=model_dir, stage=True)) \
            if model_dir is not None else None
        return rollout(self.info.url, self.repo, cfg, version=version, build=build, promote=self.promoted.append,
                       request_log=self.requests, journal=self.journal)

    def serving(self) -> list[int]:
        return repository.served_versions(self.repo, self.cfg.model_name)


def broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").write_bytes(b"\x00" * 64)  # not a safetensors file: loading must fail
    return dst


@pytest.fixture(scope="module")
def dep(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("triton")
    cfg = DeployConfig(http_port=0, grpc_port=0, metrics_port=0, max_new_tokens=6, max_batch_size=8,
                       preferred_batch_sizes=[8], max_queue_delay_us=200_000, validation_prompts=2,
                       readiness_timeout_s=240, max_prompt_chars=1000, max_prompt_tokens=64)
    os.environ.update(PLANTED)  # credentials in the caller's environment, by name or inside a value, must not reach it
    try:
        info = server.start_server(root / "repo", cfg, log_path=root / "server.log")
    finally:
        for name in PLANTED:
            del os.environ[name]
    try:
        server.wait_ready(info, timeout=60)
        d = Deployment(root, cfg, info)
        first = d.rollout(1, tiny_model_dir)
        assert first.ok and first.serving == [1] and d.promoted == [1]
        yield d
    finally:
        assert server.stop_server(info), "the server should still have been running"
        assert not server.is_running(info)


def test_serves_over_http_and_grpc_and_reports_ready(dep):
    with urllib.request.urlopen(f"http://{dep.info.url}/v2/health/ready", timeout=5) as r:
        assert r.status == 200
    (http,) = client.generate(dep.info.url, ["def foo(x):"])
    (grpc,) = client.generate(dep.info.grpc_url, ["def foo(x):"], protocol="grpc")
    assert processing.is_well_formed(http.as_result()) is None
    assert (http.text, http.output_tokens) == (grpc.text, grpc.output_tokens)  # greedy: same answer
    assert 1 <= http.output_tokens <= dep.cfg.max_new_tokens
    two = client.generate(dep.info.url, ["def a(x):", "class B:"], params=client.Params(max_tokens=3))
    assert len(two) == 2 and all(g.output_tokens <= 3 for g in two)
    rows, skipped = RequestLog(dep.requests).read()
    assert skipped == 0 and any(r["status"] == "ok" and r["prompt_chars"] == len("def foo(x):") for r in rows)


def test_triton_pyfunc_and_evaluation_give_the_same_tokens(dep, tiny_model_dir, tmp_path):
    """20 validation prompts: Triton (concurrent requests, dynamically batched), the MLflow pyfunc and evaluation."""
    import mlflow.pyfunc
    import tritonclient.http as httpclient

    from lmforge.components.evaluation.generation import generate as eval_generate
    from lmforge.components.registry.loading import load_causal_lm
    from lmforge.components.registry.store import save_pyfunc

    prompts = SIGNATURES
    new = 16
    c = httpclient.InferenceServerClient(dep.info.url, concurrency=8, network_timeout=120)
    pending = [c.async_infer(dep.cfg.model_name, client.build_inputs([p], params=client.Params(max_tokens=new)))
               for p in prompts]
    served = [client.parse_result(r.get_result(), 0.0)[0] for r in pending]
    c.close()

    pyfunc = mlflow.pyfunc.load_model(str(save_pyfunc(tiny_model_dir, tmp_path / "pyfunc")))
    ids = pyfunc.predict(prompts, params={"max_new_tokens": new, "output": "token_ids"})
    texts = pyfunc.predict(prompts, params={"max_new_tokens": new, "output": "text"})
    model, tok = load_causal_lm(tiny_model_dir)
    evaluated, _ = eval_generate(model, tok, prompts, DEMO, max_new_tokens=new, batch_size=8, max_prompt_tokens=64)

    for i, p in enumerate(prompts):
        assert served[i].token_ids == evaluated[i].token_ids, p
        assert tuple(int(t) for t in ids[i].split()) == evaluated[i].token_ids, p
        assert served[i].text == texts[i] == evaluated[i].text, p
        assert served[i].output_tokens == evaluated[i].tokens >= 1


def test_no_client_can_load_a_model_and_no_secret_is_visible_in_proc(dep):
    import psutil
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    for mod, url in ((httpclient, dep.info.url), (grpcclient, dep.info.grpc_url)):
        c = mod.InferenceServerClient(url)
        for call in (c.load_model, c.unload_model):
            with pytest.raises(InferenceServerException, match="not allowed if polling is enabled"):
                call(dep.cfg.model_name)
        c.close()
    req = urllib.request.Request(f"http://{dep.info.url}/v2/repository/models/{dep.cfg.model_name}/load",
                                 data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 503

    # What any local user reads in /proc: the server's and its model stubs' command lines and environments.
    procs = [dep.info.pid] + [p.pid for p in psutil.Process(dep.info.pid).children(recursive=True)]
    assert len(procs) >= 2, "the python backend's stub should be running"
    for pid in procs:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
        text = "\n".join(cmdline + environ)
        for needle in ("restricted", "admin-key", "admin_key", "s3cr3t-pw", "dsn-pw-77c1", *PLANTED, *PLANTED.values()):
            assert needle.lower() not in text.lower(), (pid, needle)
        # Nothing but the allowlist: no credential of the caller's, whatever its name or wherever in a value it is.
        # lmforge adds VIRTUAL_ENV; the python backend starts its stub through `bash -c "exec ..."`, which sets the rest.
        names = {v.split("=", 1)[0] for v in environ if v}
        assert names - set(server.allowed_env(dict.fromkeys(names, ""))) <= {"VIRTUAL_ENV", "PWD", "SHLVL", "_"}, pid
    assert "--model-control-mode=poll" in Path(f"/proc/{dep.info.pid}/cmdline").read_bytes().decode().split("\0")
    assert (dep.repo.stat().st_mode & 0o777) == 0o700
    # No bytecode written where Triton polls: a write there would read as a change and reload the model.
    assert not [p for p in dep.repo.rglob("__pycache__") if p.is_dir()]

    assert client.ready_versions(dep.info.url, dep.cfg.model_name).get(1)  # reading the index stays open
    assert server.is_ready(dep.info)
    assert client.generate(dep.info.url, ["def foo(x):"])[0].output_tokens >= 1  # inference stays open


def test_a_bad_request_is_http_400_naming_the_problem(dep):
    body = {"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["   "]}]}
    req = urllib.request.Request(f"http://{dep.info.url}/v2/models/{dep.cfg.model_name}/infer",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400
    assert "text_input[0] is empty" in json.loads(e.value.read())["error"]
    assert server.is_ready(dep.info)


def test_the_generate_endpoint_answers_text_input_with_text_output_and_400s_name_the_field(dep):
    """Triton's generate extension (JSON in, JSON out), as its own LLM backends answer it."""
    (by_client,) = client.generate(dep.info.url, ["def foo(x):"], params=client.Params(max_tokens=5))
    out = client.generate_endpoint(dep.info.url, dep.cfg.model_name, {"text_input": "def foo(x):", "max_tokens": 5})
    assert out["text_output"] == by_client.text and out["output_tokens"] == by_client.output_tokens <= 5
    assert out["model_name"] == dep.cfg.model_name and out["prompt_tokens"] > 0
    echoed = client.generate_endpoint(dep.info.url, dep.cfg.model_name,
                                      {"text_input": "def foo(x):", "max_tokens": 5, "exclude_input_in_output": False})
    assert echoed["text_output"] == "def foo(x):" + by_client.text

    sampled = {"text_input": "def foo(x):", "max_tokens": 12, "temperature": 1.5, "top_k": 50, "seed": 7}
    first = client.generate_endpoint(dep.info.url, dep.cfg.model_name, sampled)["text_output"]
    again = client.generate_endpoint(dep.info.url, dep.cfg.model_name, sampled)["text_output"]
    others = {client.generate_endpoint(dep.info.url, dep.cfg.model_name, {**sampled, "seed": s})["text_output"]
              for s in (8, 9, 10)}
    assert first == again                      # seeded sampling through Triton is repeatable
    assert others - {first}                    # and it samples: other seeds give other text

    bad = {"max_tokens": ({"text_input": "def f():", "max_tokens": -1}, "max_tokens[0] is -1"),
           "too many": ({"text_input": "def f():", "max_tokens": 10_000}, "max_tokens[0] is 10000"),
           "temperature": ({"text_input": "def f():", "temperature": -0.5}, "temperature[0] is -0.5"),
           "top_p": ({"text_input": "def f():", "top_p": 2.0}, "top_p[0] is 2.0"),
           "missing": ({"max_tokens": 4}, "text_input")}
    for name, (body, says) in bad.items():
        message = _refused(lambda b=body: client.generate_endpoint(dep.info.url, dep.cfg.model_name, b))
        assert message.startswith("HTTP 400") and says in message, (name, message)
    assert server.is_ready(dep.info)


def _refused(fn) -> str:
    with pytest.raises(client.RequestFailed) as e:
        fn()
    return str(e.value)


def test_bad_inputs_get_clear_errors_and_the_server_stays_ready(dep):
    assert_bad_inputs_refused(dep, dep.cfg.model_name, dep.requests)


def assert_bad_inputs_refused(dep, model: str, requests: Path) -> None:
    """The bad-input matrix against Triton model `model` (whose request log is `requests`): each one HTTP 400."""
    import tritonclient.http as httpclient

    c = httpclient.InferenceServerClient(dep.info.url, concurrency=12, network_timeout=120)

    def send(inputs):
        return client.infer(c, model, inputs)

    def tensor(name, arr, dtype):
        t = httpclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    good = np.array([[b"def foo(x):"]], dtype=np.object_)
    msgs = {
        "missing": _refused(lambda: send([tensor("max_tokens", np.array([[4]], dtype=np.int32), "INT32")])),
        "dtype": _refused(lambda: send([tensor("text_input", np.array([[1]], dtype=np.int32), "INT32")])),
        "shape": _refused(lambda: send([tensor("text_input", np.array([[b"a", b"b"]], dtype=np.object_), "BYTES")])),
        "empty": _refused(lambda: send(client.build_inputs([""]))),
        "chars": _refused(lambda: send(client.build_inputs(["def f(x):" + "x" * 2000]))),
        "tokens": _refused(lambda: send(client.build_inputs(["def f(" + ", ".join(f"a{i}" for i in range(80)) + ")"]))),
        "utf8": _refused(lambda: send(client.build_inputs([b"def caf\xc3\x28(x):"]))),
        "max_new": _refused(lambda: send([tensor("text_input", good, "BYTES"),
                                          tensor("max_tokens", np.array([[0]], dtype=np.int32), "INT32")])),
        "temperature": _refused(lambda: send(client.build_inputs(["def f():"], params=client.Params(temperature=-1)))),
        "stop_utf8": _refused(lambda: send([tensor("text_input", good, "BYTES"),
                                            tensor("stop", np.array([[b"\xff"]], dtype=np.object_), "BYTES")])),
    }
    assert "text_input" in msgs["missing"]
    assert "data-type" in msgs["dtype"] or "datatype" in msgs["dtype"].lower()
    assert "shape" in msgs["shape"]
    assert "is empty" in msgs["empty"]
    assert "characters" in msgs["chars"]
    assert "tokens" in msgs["tokens"]
    assert "UTF-8" in msgs["utf8"]
    assert "max_tokens[0] is 0" in msgs["max_new"]
    assert "temperature[0] is -1" in msgs["temperature"]
    assert "stop[0]" in msgs["stop_utf8"] and "UTF-8" in msgs["stop_utf8"]

    # A dynamic batch mixing good and bad requests: each gets its own answer or its own error.
    before = client.batch_sizes(dep.info.url, model)
    prompts = ["def a(x):", "", "def b(y):", b"\xff\xfe", "def c(z):", "   ", "class D:", "def e():"]
    from tritonclient.utils import InferenceServerException

    negative = client.Params(max_tokens=-2)   # a request that is bad only in its max_tokens, in the same batch
    pending = [c.async_infer(model, client.build_inputs([p], params=negative if p == "class D:" else client.Params()))
               for p in prompts]  # all in flight at once
    outcomes = []
    for req in pending:
        try:
            outcomes.append(("ok", client.parse_result(req.get_result(), 0.0)[0]))
        except InferenceServerException as e:
            outcomes.append(("error", e.message()))
    kinds = [k for k, _ in outcomes]
    assert kinds == ["ok", "error", "ok", "error", "ok", "error", "error", "ok"]
    assert "max_tokens[0] is -2" in outcomes[6][1]
    assert all(processing.is_well_formed(g.as_result()) is None for k, g in outcomes if k == "ok")
    # Triton updates its statistics after the responses go out: poll them, with a bound.
    deadline = time.monotonic() + 20
    while True:
        after = client.batch_sizes(dep.info.url, model)
        grew = {size: n - before.get(size, 0) for size, n in after.items() if n > before.get(size, 0)}
        if sum(size * n for size, n in grew.items()) >= 5 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert grew and max(grew) > 1, f"the batcher never grouped the concurrent requests: {grew}"
    c.close()

    assert server.is_live(dep.info) and server.is_ready(dep.info)
    statuses = {r["status"] for r in RequestLog(requests).read()[0]}
    assert {"ok", "empty_prompt", "invalid_utf8", "prompt_too_long", "bad_max_tokens", "bad_temperature"} <= statuses


def test_gate_refuses_a_broken_export_and_the_old_version_keeps_serving(dep, tiny_model_dir, tmp_path):
    bad = broken_copy(tiny_model_dir, tmp_path / "bad")
    with pytest.raises(RolloutRefused, match="version 2 was refused: pre-flight failed"):
        dep.rollout(2, bad)
    assert dep.serving() == [1] and dep.promoted == [1]
    assert not (dep.repo / dep.cfg.model_name / "2").exists()
    assert not list(repository.staging_dir(dep.repo).iterdir())  # refused before it entered the repository
    assert client.generate(dep.info.url, ["def foo(x):"])[0].output_tokens >= 1
    last = json.loads(dep.journal.read_text().splitlines()[-1])
    assert last["version"] == 2 and not last["ok"] and "SafetensorError" in last["reason"]


def test_gate_refuses_a_version_that_fails_validation(dep, tiny_model_dir):
    strict = dep.cfg.model_copy(update={"validation_latency_ms": 0.01})
    with pytest.raises(RolloutRefused, match="exceeds the bound"):
        dep.rollout(3, tiny_model_dir, cfg=strict)
    assert dep.serving() == [1] and dep.promoted == [1]
    assert client.ready_versions(dep.info.url, dep.cfg.model_name).get(1)
    assert server.is_ready(dep.info)  # the candidate was unloaded cleanly


def test_rollout_of_a_new_version_then_rollback(dep, tmp_path):
    other = build_tiny_model(tmp_path / "other", seed=1)
    result = dep.rollout(4, other)
    assert result.ok and result.previous == [1] and result.serving == [4] and dep.promoted == [1, 4]
    ready = client.ready_versions(dep.info.url, dep.cfg.model_name)
    assert ready.get(4) and not ready.get(1)  # the old version was unloaded after the gate passed
    assert client.generate(dep.info.url, ["def foo(x):"])[0].output_tokens >= 1

    back = dep.rollout(1, None)  # rollback: version 1's folder is still in the repository
    assert back.ok and back.serving == [1] and dep.promoted == [1, 4, 1]
    assert client.ready_versions(dep.info.url, dep.cfg.model_name).get(1)
    assert server.is_ready(dep.info)


def test_the_deploy_stage_serves_the_onnx_export_with_the_torch_tokens_and_the_same_400s(dep, tiny_model_dir, tmp_path,
                                                                                         monkeypatch, capsys):
    """[deploy] format = "onnx" through deploy_version (what the deploy stage runs), on this server as a second
    Triton model: registry -> export -> logits check -> lineage -> gate -> production; 8 prompts' greedy tokens
    equal the torch model's (version 1, serving beside it), and the bad-input matrix answers 400."""
    import mlflow.artifacts

    from lmforge.cli.cli import run_cli
    from lmforge.components.registry import current, register_model, version_tags
    from lmforge.components.sections.registry import RegistryConfig
    from lmforge.components.workspace import Workspace
    from lmforge.deploy.service import deploy_version

    root = tmp_path / "ws"
    root.mkdir()
    (root / "triton").symlink_to(dep.root)   # the workspace's model repository is the one this server polls
    monkeypatch.setenv("LMFORGE_HOME", str(root))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ws = Workspace(root).ensure()
    version = register_model(ws, RegistryConfig(model_name="tiny-onnx"), tiny_model_dir, metrics={}, tags={})
    cfg = dep.cfg.model_copy(update={"model_name": "lmforge_onnx", "format": "onnx"})
    try:
        result = deploy_version(ws, cfg, dep.info, registry_model="tiny-onnx", version=int(version), model_dir=None)
        assert result.ok and result.serving == [int(version)] and current(ws, "tiny-onnx", "production") == version
        folder = repository.version_dir(dep.repo, cfg.model_name, int(version))
        assert (folder / "model" / "model.onnx").is_file() and not list((folder / "model").glob("*.safetensors"))

        prompts, new = SIGNATURES[:8], client.Params(max_tokens=16)
        by_torch = client.generate(dep.info.url, prompts, model=dep.cfg.model_name, params=new)
        by_onnx = client.generate(dep.info.url, prompts, model=cfg.model_name, params=new)
        assert [g.token_ids for g in by_onnx] == [g.token_ids for g in by_torch]
        assert [g.text for g in by_onnx] == [g.text for g in by_torch]
        assert all(g.output_tokens >= 1 for g in by_onnx)

        assert_bad_inputs_refused(dep, cfg.model_name, ws.requests)

        tags = version_tags(ws, "tiny-onnx", version)
        assert float(tags["onnx_max_abs_diff"]) <= cfg.onnx_tolerance and tags["onnx_kv_cache"] == "true"
        listed = mlflow.artifacts.list_artifacts(artifact_uri=tags["onnx_artifact"])
        assert {Path(a.path).name for a in listed} >= {"model.onnx", "onnx.json", "tokenizer.json"}
        assert run_cli(["export", "onnx", version, "--json", "--set", "registry.model_name=tiny-onnx"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["reused"] and out["artifact_uri"] == tags["onnx_artifact"]   # exported once, registered once
    finally:
        repository.remove_model(dep.repo, cfg.model_name)
        client.wait_versions(dep.info.url, cfg.model_name, [], revision=None, timeout=120)
    assert server.is_ready(dep.info) and dep.serving() == [1]


def test_a_version_that_fails_to_load_leaves_the_server_live_and_the_others_serving(dep):
    folder = repository.version_dir(dep.repo, dep.cfg.model_name, 5)
    shutil.copytree(repository.version_dir(dep.repo, dep.cfg.model_name, 1), folder)
    (folder / "model" / "model.safetensors").write_bytes(b"\x00" * 64)
    revision = repository.write_config(dep.repo, dep.cfg, versions=[1, 5], request_log=dep.requests)
    message = _refused(lambda: client.wait_versions(dep.info.url, dep.cfg.model_name, [1, 5], revision=revision,
                                                    timeout=240))
    assert "version 5" in message
    assert server.is_live(dep.info)
    ready = client.ready_versions(dep.info.url, dep.cfg.model_name)
    assert ready[1] and not ready[5]
    assert client.generate(dep.info.url, ["def foo(x):"], version=1)[0].output_tokens >= 1
    assert client.generate(dep.info.grpc_url, ["def foo(x):"], protocol="grpc")[0].output_tokens >= 1
