"""deploy/openai_api.py without Triton: requests translated into the model's contract, answers and chunks in OpenAI's
shapes, errors mapped to OpenAI's status codes and body (every 4xx, an unparsable, non-UTF-8 or wrongly typed body,
an unknown route and a wrong method included), a dropped stream closing its Triton request, the Prometheus metrics
a request moves, log-probs and echo in OpenAI's legacy shape, and deploy/gateway.py's port rules.

The Triton side is a fake put in `app.state.triton` here: it records what it is asked and answers scripted Replies
(a string in the script is a model error message, raised as the real client raises it: triton_error).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from lmforge.deploy.openai_api import create_app
from lmforge.deploy.openai_protocol import triton_error
from lmforge.deploy.openai_triton import Reply

FINAL = {"finish_reason": "length", "prompt_tokens": 5, "output_tokens": 3}
BUSY = "lmforge v1 is busy: 4 requests in flight, the limit (max_queue); retry later"


class FakeTriton:
    def __init__(self, script=(), *, delay: float = 0.0, forever: bool = False) -> None:
        self.script, self.delay, self.forever = list(script), delay, forever
        self.calls: list[dict] = []
        self.cancelled = threading.Event()

    async def generate(self, text, settings, *, stream, prompt_param="prompt"):
        self.calls.append({"text": text, "settings": settings, "stream": stream})
        finished = False
        try:
            for item in self.script:
                if isinstance(item, str):
                    raise triton_error(item, prompt_param=prompt_param)
                yield item
                await asyncio.sleep(self.delay)
            while self.forever:
                yield Reply("x")
                await asyncio.sleep(self.delay)
            finished = True
        finally:
            if not finished:
                self.cancelled.set()

    async def close(self) -> None:
        pass


def repo_with(tmp_path: Path, kind: str | None) -> Path:
    """A model repository whose served version 1 records task `kind` (None: no task recorded)."""
    root = tmp_path / "repo" / "lmforge"
    (root / "1").mkdir(parents=True)
    (root / "config.pbtxt").write_text('version_policy: { specific: { versions: [ 1 ] } }\n')
    meta = {"version": 1, **({"lmforge": {"task": {"kind": kind, "stop": []}}} if kind else {})}
    (root / "1" / "meta.json").write_text(json.dumps(meta))
    return tmp_path / "repo"


def app_with(tmp_path, script=(), *, kind: str | None = None, **fake):
    app = create_app("127.0.0.1:1", "lmforge", repo_with(tmp_path, kind))
    app.state.triton = FakeTriton(script, **fake)
    return app, app.state.triton


def events(response) -> list:
    return [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]


def test_models_lists_the_served_model(tmp_path):
    app, _ = app_with(tmp_path)
    body = TestClient(app).get("/v1/models").json()
    assert body["object"] == "list" and [(m["id"], m["object"]) for m in body["data"]] == [("lmforge", "model")]


def test_a_completion_maps_its_settings_to_sampling_parameters(tmp_path):
    app, fake = app_with(tmp_path, [Reply("hello", FINAL)])
    r = TestClient(app).post("/v1/completions", json={
        "model": "lmforge", "prompt": ["Once"], "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 7,
        "stop": "\n", "top_k": 4, "user": "u1", "n": 1, "echo": False})
    assert r.status_code == 200, r.text
    assert fake.calls == [{"text": "Once", "stream": False, "settings": {
        "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 7, "stop": ["\n"]}}]
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "lmforge"
    assert body["choices"] == [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_settings_left_out_are_not_sent(tmp_path):
    app, fake = app_with(tmp_path, [Reply("", FINAL)])
    TestClient(app).post("/v1/completions", json={"model": "lmforge", "prompt": "Once"})
    assert fake.calls[0]["settings"] == {}


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Once"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_ignore_eos_goes_to_sampling_parameters(tmp_path, path, body):
    app, fake = app_with(tmp_path, [Reply("", FINAL)], kind="chat")
    r = TestClient(app).post(path, json={"model": "lmforge", "max_tokens": 8, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    assert fake.calls[0]["settings"] == {"max_tokens": 8, "ignore_eos": True}


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.parametrize("body, constraint", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}}, {"json": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json": {"type": "object"}}),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
])
def test_openais_response_format_and_vllms_structured_outputs_constrain_the_model(tmp_path, body, constraint):
    app, fake = app_with(tmp_path, [Reply("", FINAL)], kind="chat")
    r = TestClient(app).post("/v1/chat/completions", json={"model": "lmforge", "messages": [{"role": "user",
                                                                                           "content": "Hi"}], **body})
    assert r.status_code == 200, r.text
    assert fake.calls[0]["settings"].get("structured_outputs") == constraint


@pytest.mark.parametrize("body, says", [
    ({"response_format": {"type": "json_schema"}}, "json_schema is missing"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "send one"),
])
def test_a_constraint_said_wrong_or_twice_is_400(tmp_path, body, says):
    app, fake = app_with(tmp_path, [Reply("", FINAL)])
    r = TestClient(app).post("/v1/completions", json={"model": "lmforge", "prompt": "Once", **body})
    assert r.status_code == 400 and says in r.json()["error"]["message"] and not fake.calls


@pytest.mark.parametrize("chat, extra", [(False, {"usage": None}), (False, {}), (True, {"usage": None}), (True, {})])
def test_a_text_event_is_the_bytes_of_its_whole_chunk(chat, extra):
    from lmforge.deploy.openai_api import Answer, TextEvents, choice, sse
    from lmforge.deploy.openai_metrics import Metrics

    answer = Answer("lmforge", chat, Metrics("lmforge"), "/v1/completions")
    for text in ("he", ' "quoted"\n', "é\u2028\x00"):
        assert TextEvents(answer, extra)(text) == sse(answer.obj([choice(chat, text, None)], stream=True, **extra))


def test_a_streamed_completion_is_chunks_then_finish_then_usage_then_done(tmp_path):
    app, fake = app_with(tmp_path, [Reply("he"), Reply("llo"), Reply("", FINAL)])
    r = TestClient(app).post("/v1/completions", json={"model": "lmforge", "prompt": "Once", "stream": True,
                                                      "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    *chunks, done = events(r)
    chunks = [json.loads(c) for c in chunks]
    assert done == "[DONE]" and fake.calls[0]["stream"] is True
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["he", "llo"]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks[:3])
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["total_tokens"] == 8


def test_chat_sends_the_messages_as_a_json_list(tmp_path):
    app, fake = app_with(tmp_path, [Reply("Hi!", {**FINAL, "finish_reason": "stop"})], kind="chat")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    r = TestClient(app).post("/v1/chat/completions", json={"model": "lmforge", "messages": messages,
                                                           "max_completion_tokens": 9})
    assert r.status_code == 200, r.text
    assert json.loads(fake.calls[0]["text"]) == [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Hello"}]
    assert fake.calls[0]["settings"] == {"max_tokens": 9}
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_a_streamed_chat_sends_the_role_then_the_content(tmp_path):
    app, _ = app_with(tmp_path, [Reply("Hi"), Reply("!", FINAL)], kind="chat")
    r = TestClient(app).post("/v1/chat/completions", json={"model": "lmforge", "stream": True,
                                                           "messages": [{"role": "user", "content": "Hello"}]})
    *chunks, done = events(r)
    deltas = [json.loads(c)["choices"][0] for c in chunks]
    assert done == "[DONE]" and all(json.loads(c)["object"] == "chat.completion.chunk" for c in chunks)
    assert [d["delta"] for d in deltas] == [{"role": "assistant", "content": ""}, {"content": "Hi"}, {"content": "!"}, {}]
    assert [d["finish_reason"] for d in deltas] == [None, None, None, "length"]


@pytest.mark.parametrize("kind", [None, "completion", "docstring"])
def test_chat_on_a_model_without_a_chat_task_is_400(tmp_path, kind):
    app, fake = app_with(tmp_path, kind=kind)
    r = TestClient(app).post("/v1/chat/completions", json={"model": "lmforge",
                                                           "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and fake.calls == []
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert "no chat template/task" in error["message"] and "/v1/completions" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"n": 2}, "n"), ({"echo": [1]}, "echo"), ({"temperature": "hot"}, "temperature"), ({"stop": 3}, "stop"),
    ({"logprobs": 6}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"max_tokens": 0}, "max_tokens"),
    ({"stream": True, "logprobs": 1}, "logprobs"), ({"stream": True, "echo": True}, "echo"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"logit_bias": {}}, "logit_bias"), ({"prompt": None}, "prompt"),
])
def test_wrong_fields_are_400_naming_the_field(tmp_path, body, param):
    app, fake = app_with(tmp_path, [Reply("", FINAL)])
    r = TestClient(app).post("/v1/completions", json={"model": "lmforge", "prompt": "Once", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"
    assert fake.calls == []


def test_a_body_that_is_not_json_is_400(tmp_path):
    app, _ = app_with(tmp_path)
    r = TestClient(app).post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_an_unknown_model_is_404(tmp_path):
    app, fake = app_with(tmp_path)
    r = TestClient(app).post("/v1/completions", json={"model": "gpt-4", "prompt": "Once"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and fake.calls == []
    assert r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("message, status, param", [
    ("max_tokens[0] is 999; it must be between 1 and 128", 400, "max_tokens"),
    ("sampling_parameters.top_p is 'x'; it must be a number", 400, "top_p"),
    ("text_input[0] is empty; send some text", 400, "prompt"),
    (BUSY, 503, None),
    ("lmforge v1 is not ready: the engine's batching loop died (RuntimeError: boom); restart the server or roll out "
     "again (lmforge run deploy)", 503, None),
    ("generation failed: CUDA out of memory", 500, None),
])
def test_model_errors_keep_their_message_and_get_openais_status(tmp_path, stream, message, status, param):
    app, _ = app_with(tmp_path, [message])
    r = TestClient(app).post("/v1/completions", json={"model": "lmforge", "prompt": "Once", "stream": stream})
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] == message and error["param"] == param
    assert error["type"] == ("invalid_request_error" if status == 400 else "server_error")
    assert (r.headers.get("retry-after") == "1") == (status == 503)


def test_an_error_after_the_stream_started_ends_it_with_an_error_event(tmp_path):
    app, _ = app_with(tmp_path, [Reply("he"), "generation failed: boom"])
    r = TestClient(app).post("/v1/completions", json={"model": "lmforge", "prompt": "Once", "stream": True})
    chunks = events(r)
    assert json.loads(chunks[0])["choices"][0]["text"] == "he"
    assert json.loads(chunks[-1])["error"]["message"] == "generation failed: boom" and "[DONE]" not in chunks


@contextlib.contextmanager
def uvicorn_serving(app):
    """The app on a real uvicorn in a thread, on a free loopback port: yields the port; stopped on leaving."""
    import uvicorn

    from lmforge.components.runtime.ports import free_port

    port = free_port("127.0.0.1")
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield port
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def first_event(port: int, body: dict) -> socket.socket:
    """A raw connection that posts a streamed request and has read its first event (the caller closes it)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    got = b""
    while b"data: " not in got:
        got += s.recv(4096)
    return s


def test_a_client_that_goes_away_closes_its_triton_request(tmp_path):
    """A real uvicorn: the client reads the first event and hangs up; the fake's generator is closed (the real one
    cancels its gRPC call there) instead of running on."""
    app, fake = app_with(tmp_path, delay=0.02, forever=True)
    with uvicorn_serving(app) as port:
        first_event(port, {"model": "lmforge", "prompt": "Once", "stream": True}).close()
        assert fake.cancelled.wait(5), "the Triton request was not closed after the client went away"


# --- every error in OpenAI's shape ------------------------------------------------------------

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("method, path, kwargs, status, code", [
    ("POST", "/v1/completions", {"content": b"{nope", "headers": JSON}, 400, "invalid_json"),
    ("POST", "/v1/completions", {"content": b'{"model": "lmforge", "prompt": "caf\xe9"}', "headers": JSON}, 400,
     "invalid_encoding"),
    ("POST", "/v1/chat/completions", {"content": b"\xff\xfe{}", "headers": JSON}, 400, "invalid_encoding"),
    ("POST", "/v1/completions", {"content": b"model=lmforge&prompt=x",
                                 "headers": {"content-type": "application/x-www-form-urlencoded"}}, 400,
     "invalid_content_type"),
    ("POST", "/v1/completions", {"content": b"[1, 2]", "headers": JSON}, 400, "invalid_json"),
    ("GET", "/v1/nope", {}, 404, "unknown_url"),
    ("POST", "/completions", {"json": {"model": "lmforge", "prompt": "x"}}, 404, "unknown_url"),
    ("GET", "/v1/completions", {}, 405, "method_not_allowed"),
    ("DELETE", "/v1/models", {}, 405, "method_not_allowed"),
])
def test_every_4xx_has_openais_error_shape(tmp_path, method, path, kwargs, status, code):
    app, fake = app_with(tmp_path, [Reply("", FINAL)])
    r = TestClient(app).request(method, path, **kwargs)
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code and body["error"]["type"] == "invalid_request_error"
    assert fake.calls == []


def test_the_errors_say_what_to_do(tmp_path):
    app, _ = app_with(tmp_path)
    c = TestClient(app)
    not_utf8 = c.post("/v1/completions", content=b'{"prompt": "\xe9"}', headers=JSON).json()["error"]["message"]
    assert "not UTF-8" in not_utf8 and "byte 12" in not_utf8 and "UTF-8" in not_utf8.split(";")[1]
    ctype = c.post("/v1/completions", content=b"x", headers={"content-type": "text/plain"}).json()["error"]
    assert "text/plain" in ctype["message"] and "application/json" in ctype["message"]
    missing = c.get("/v1/nope").json()["error"]["message"]
    assert "GET /v1/nope" in missing and "POST /v1/completions" in missing
    wrong = c.get("/v1/chat/completions")
    assert "send POST" in wrong.json()["error"]["message"] and wrong.headers["allow"] == "POST"


def test_a_body_without_a_content_type_is_read_as_json(tmp_path):
    app, fake = app_with(tmp_path, [Reply("hi", FINAL)])
    r = TestClient(app).post("/v1/completions", content=json.dumps({"model": "lmforge", "prompt": "Once"}).encode(),
                             headers={"content-type": ""})
    assert r.status_code == 200, r.text
    assert fake.calls[0]["text"] == "Once"


class Broken(FakeTriton):
    async def generate(self, text, settings, *, stream, prompt_param="prompt"):
        raise RuntimeError("a bug")
        yield  # an async generator, as the real one is


def test_a_bug_is_a_500_in_openais_shape(tmp_path):
    app = create_app("127.0.0.1:1", "lmforge", repo_with(tmp_path, None))
    app.state.triton = Broken()
    r = TestClient(app, raise_server_exceptions=False).post("/v1/completions", json={"model": "lmforge", "prompt": "x"})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "RuntimeError: a bug" in r.json()["error"]["message"]


def test_health_answers_with_the_instance_it_was_started_with(tmp_path):
    app = create_app("127.0.0.1:1", "lmforge", repo_with(tmp_path, None), instance="abc123")
    assert TestClient(app).get("/health").json() == {"status": "ok", "instance": "abc123"}


# --- /metrics ------------------------------------------------------------------------------------

def metric(client, name: str, **labels) -> float:
    """One sample of /metrics (0.0 when absent), read back with prometheus_client's own text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return sum(s.value for family in text_string_to_metric_families(r.text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_completion_moves_the_metrics(tmp_path):
    final = {**FINAL, "output_tokens": 5, "first_token_ms": 30.0, "decode_ms": 400.0}
    app, _ = app_with(tmp_path, [Reply("he"), Reply("llo", final)])
    c = TestClient(app)
    model = {"model_name": "lmforge"}
    assert metric(c, "lmforge:prompt_tokens_total", **model) == 0
    r = c.post("/v1/completions", json={"model": "lmforge", "prompt": "Once", "stream": True})
    assert r.status_code == 200 and events(r)[-1] == "[DONE]"
    assert metric(c, "lmforge:prompt_tokens_total", **model) == 5
    assert metric(c, "lmforge:generation_tokens_total", **model) == 5
    assert metric(c, "lmforge:request_success_total", finish_reason="length", **model) == 1
    assert metric(c, "lmforge:http_requests_total", endpoint="/v1/completions", status="200") == 1
    assert metric(c, "lmforge:time_to_first_token_seconds_count", **model) == 1
    assert metric(c, "lmforge:time_per_output_token_seconds_count", **model) == 1
    assert metric(c, "lmforge:time_per_output_token_seconds_sum", **model) == pytest.approx(0.1)   # 400 ms / 4
    assert metric(c, "lmforge:time_per_output_token_seconds_bucket", le="0.1", **model) == 1
    assert metric(c, "lmforge:time_per_output_token_seconds_bucket", le="0.075", **model) == 0
    assert metric(c, "lmforge:e2e_request_latency_seconds_count", **model) == 1
    assert metric(c, "lmforge:num_requests_running", **model) == 0


def test_errors_are_counted_by_endpoint_status_and_code(tmp_path):
    app, _ = app_with(tmp_path, [BUSY])
    c = TestClient(app)
    c.post("/v1/completions", json={"model": "lmforge", "prompt": "Once"})
    c.post("/v1/completions", json={"model": "lmforge", "prompt": "Once", "n": 3})
    c.get("/v1/no/such/route/42")
    assert metric(c, "lmforge:request_errors_total", endpoint="/v1/completions", status="503", code="model_busy") == 1
    assert metric(c, "lmforge:request_errors_total", endpoint="/v1/completions", status="400",
                  code="invalid_value") == 1
    assert metric(c, "lmforge:http_requests_total", endpoint="/v1/completions", status="503") == 1
    assert metric(c, "lmforge:http_requests_total", endpoint="other", status="404") == 1   # no series per path
    assert metric(c, "lmforge:prompt_tokens_total") == 0


def test_an_error_that_ends_a_stream_is_counted(tmp_path):
    app, _ = app_with(tmp_path, [Reply("he"), "generation failed: boom"])
    c = TestClient(app)
    c.post("/v1/completions", json={"model": "lmforge", "prompt": "Once", "stream": True})
    assert metric(c, "lmforge:request_errors_total", status="500", code="generation_failed") == 1
    assert metric(c, "lmforge:request_success_total") == 0


def test_requests_in_flight_are_a_gauge(tmp_path):
    """A real uvicorn: while a stream is open the gauge reads 1, after the client left it is back to 0."""
    app, fake = app_with(tmp_path, delay=0.02, forever=True)
    c = TestClient(app)
    with uvicorn_serving(app) as port:
        conn = first_event(port, {"model": "lmforge", "prompt": "Once", "stream": True})
        assert metric(c, "lmforge:num_requests_running", model_name="lmforge") == 1
        conn.close()
        assert fake.cancelled.wait(5)
        deadline = time.monotonic() + 5
        while metric(c, "lmforge:num_requests_running", model_name="lmforge") and time.monotonic() < deadline:
            time.sleep(0.05)
    assert metric(c, "lmforge:num_requests_running", model_name="lmforge") == 0


# --- log-probabilities ------------------------------------------------------------------------------

def entry(token: str, logprob: float, *top: tuple[str, float], id: int = 1) -> dict:
    """One token as the model reports it (components/serving/triton_model.py's contract): id, text, log-prob, top alternatives."""
    return {"id": id, "token": token, "logprob": logprob, "top": [list(t) for t in top]}


# A prompt "<e>Hi there" (the eos text first, as the harness's lmforge_heldout contexts start) and one generated "!".
EOS_PROMPT = "<e>Hi there"
PROMPT_LOGPROBS = [None, entry("Hi", -2.0, ("Hi", -2.0)), entry(" there", -1.0, (" here", -0.7))]
GENERATED = [entry("!", -0.5, (".", -0.3))]
WITH_LOGPROBS = {**FINAL, "prompt_tokens": 3, "output_tokens": 1, "logprobs": GENERATED,
                 "prompt_logprobs": PROMPT_LOGPROBS}


def test_echo_with_logprobs_is_openais_legacy_shape(tmp_path):
    app, fake = app_with(tmp_path, [Reply("!", WITH_LOGPROBS)])
    body = {"model": "lmforge", "prompt": EOS_PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "seed": 1234, "echo": True}   # what lm-evaluation-harness's local-completions sends for a log-likelihood
    r = TestClient(app).post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert fake.calls[0]["settings"] == {"max_tokens": 1, "temperature": 0, "seed": 1234, "logprobs": 1,
                                         "prompt_logprobs": 1}
    out = r.json()["choices"][0]
    assert out["text"] == EOS_PROMPT + "!"
    assert out["logprobs"] == {
        "tokens": ["<e>", "Hi", " there", "!"],
        "token_logprobs": [None, -2.0, -1.0, -0.5],
        "top_logprobs": [None, {"Hi": -2.0}, {" here": -0.7, " there": -1.0}, {".": -0.3, "!": -0.5}],
        "text_offset": [0, 3, 5, 11]}


def test_the_harness_reads_the_continuations_logprob_and_greediness(tmp_path):
    """lm-evaluation-harness's own parser of local-completions answers: the context is its first 2 tokens, so the
    continuation is " there" (log-prob -1.0, not the greedy " here")."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    app, _ = app_with(tmp_path, [Reply("!", WITH_LOGPROBS)])
    r = TestClient(app).post("/v1/completions", json={"model": "lmforge", "prompt": EOS_PROMPT, "max_tokens": 1,
                                                      "logprobs": 1, "echo": True})
    assert LocalCompletionsAPI.parse_logprobs(r.json(), ctxlens=[2]) == [(-1.0, False)]
    assert LocalCompletionsAPI.parse_logprobs(r.json(), ctxlens=[1]) == [(-3.0, False)]


def test_logprobs_without_echo_count_offsets_from_the_prompts_end(tmp_path):
    app, fake = app_with(tmp_path, [Reply("!", {**WITH_LOGPROBS, "prompt_logprobs": None})])
    r = TestClient(app).post("/v1/completions", json={"model": "lmforge", "prompt": "Hi there", "logprobs": 0})
    assert fake.calls[0]["settings"] == {"logprobs": 0}
    out = r.json()["choices"][0]
    assert out["text"] == "!"
    assert out["logprobs"] == {"tokens": ["!"], "token_logprobs": [-0.5], "top_logprobs": [{".": -0.3, "!": -0.5}],
                               "text_offset": [8]}


def test_a_start_token_the_model_adds_is_an_empty_first_token(tmp_path):
    """A prompt that does not start with the eos text: the model reads its own eos first, which is no text."""
    app, _ = app_with(tmp_path, [Reply("!", WITH_LOGPROBS)])
    r = TestClient(app).post("/v1/completions", json={"model": "lmforge", "prompt": "Hi there", "max_tokens": 1,
                                                      "logprobs": 1, "echo": True})
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"][:3] == ["", "Hi", " there"] and logprobs["text_offset"] == [0, 0, 2, 8]


def test_echo_with_no_tokens_is_the_prompt_alone(tmp_path):
    app, fake = app_with(tmp_path, [Reply("", {**FINAL, "output_tokens": 0, "prompt_logprobs": PROMPT_LOGPROBS})])
    r = TestClient(app).post("/v1/completions", json={"model": "lmforge", "prompt": "Hi there", "max_tokens": 0,
                                                      "echo": True})
    assert r.status_code == 200, r.text
    assert fake.calls[0]["settings"] == {"max_tokens": 0, "prompt_logprobs": 0}
    assert r.json()["choices"][0]["text"] == "Hi there" and r.json()["choices"][0]["logprobs"] is None


def test_echo_alone_puts_the_prompt_before_the_text(tmp_path):
    app, fake = app_with(tmp_path, [Reply(" there", FINAL)])
    r = TestClient(app).post("/v1/completions", json={"model": "lmforge", "prompt": "Hi", "echo": True})
    assert fake.calls[0]["settings"] == {}
    assert r.json()["choices"][0]["text"] == "Hi there"


def test_a_model_that_sends_no_logprobs_is_a_500_saying_so(tmp_path):
    app, _ = app_with(tmp_path, [Reply("!", FINAL)])
    r = TestClient(app).post("/v1/completions", json={"model": "lmforge", "prompt": "Hi", "logprobs": 2, "echo": True})
    assert r.status_code == 500 and r.json()["error"]["code"] == "no_logprobs"
    assert "logprobs or prompt_logprobs" in r.json()["error"]["message"]


@pytest.mark.parametrize("message, param", [
    ("sampling_parameters.logprobs is not served here; the keys are max_tokens, ...", "logprobs"),
    ("sampling_parameters.prompt_logprobs is 30; it must be between 0 and 20", "echo"),
])
def test_the_models_logprob_errors_name_the_requests_field(message, param):
    assert triton_error(message).param == param


class Result:
    """A tritonclient InferResult as the final response carries it: numpy arrays by output name."""

    def __init__(self, **outputs) -> None:
        self.outputs = outputs

    def as_numpy(self, name):
        import numpy as np

        if name not in self.outputs:
            return None
        v = self.outputs[name]
        return np.array([v.encode() if isinstance(v, str) else v], dtype=object if isinstance(v, str) else None)


def test_to_reply_reads_the_logprob_outputs_and_timings():
    from lmforge.deploy.openai_triton import to_reply

    final = to_reply(Result(text_output="!", finish_reason="length", prompt_tokens=3, output_tokens=1,
                            first_token_ms=12.5, decode_ms=0.0, logprobs=json.dumps(GENERATED),
                            prompt_logprobs=json.dumps(PROMPT_LOGPROBS))).final
    assert final["logprobs"] == GENERATED and final["prompt_logprobs"] == PROMPT_LOGPROBS
    assert final["first_token_ms"] == 12.5 and final["decode_ms"] == 0.0
    plain = to_reply(Result(text_output="x", prompt_tokens=3, output_tokens=1)).final
    assert plain["logprobs"] is None and plain["prompt_logprobs"] is None and plain["finish_reason"] == "stop"
    assert to_reply(Result(text_output="x")).final is None


# --- the gateway's port ------------------------------------------------------------------------------

def gateway_cfg(port: int):
    from lmforge.components.sections.deploy import DeployConfig

    return DeployConfig(http_port=0, grpc_port=0, metrics_port=0, openai_port=port, model_name="lmforge")


def test_the_gateway_port_is_fixed_by_default_and_clear_of_the_other_servers():
    from lmforge.components.sections.deploy import DeployConfig

    cfg = DeployConfig()
    assert cfg.openai_port == 9000 and cfg.openai_port not in (cfg.http_port, cfg.grpc_port, cfg.metrics_port, 5000, 4200)
    with pytest.raises(ValueError, match="openai_port must differ"):
        DeployConfig(http_port=9000)


def test_a_port_in_use_is_refused_before_the_launch_naming_the_setting(tmp_path):
    from lmforge.components.errors import UserError
    from lmforge.deploy import gateway

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(UserError) as e:
            gateway.start_gateway(repo_with(tmp_path, None), gateway_cfg(port), triton_grpc="127.0.0.1:1",
                                  log_path=tmp_path / "gw.log", wait=30)
    assert e.value.what == "deploy.openai_port" and e.value.value == port
    assert "already in use" in str(e.value) and "--set deploy.openai_port=" in str(e.value)
    assert not (tmp_path / "gw.log").exists()   # nothing was launched


def test_another_gateway_on_the_port_is_not_taken_for_this_one(tmp_path, monkeypatch):
    """The port is free when checked and taken before the launch binds it (another gateway, answering /health):
    the launch fails, and the error names deploy.openai_port, instead of a GatewayInfo for the other process."""
    from lmforge.components.errors import UserError
    from lmforge.deploy import gateway

    repo = repo_with(tmp_path, None)
    other = create_app("127.0.0.1:1", "lmforge", repo, instance="someone-else")
    monkeypatch.setattr(gateway, "port_in_use", lambda host, port: False)
    with uvicorn_serving(other) as port:
        started = time.monotonic()
        try:
            gw = gateway.start_gateway(repo, gateway_cfg(port), triton_grpc="127.0.0.1:1",
                                       log_path=tmp_path / "gw.log", wait=60)
        except UserError as error:
            e = error
        else:
            gateway.stop_gateway(gw)   # nothing of this test's left running
            pytest.fail(f"the gateway on port {port} was taken for the one this launch started (pid {gw.pid})")
    assert e.what == "deploy.openai_port" and e.value == port, e
    assert "address already in use" in (tmp_path / "gw.log").read_text().lower()
    assert time.monotonic() - started < 30
