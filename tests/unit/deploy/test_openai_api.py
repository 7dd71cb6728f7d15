"""deploy/openai_api.py without Triton: requests translated into the model's contract, answers and chunks in OpenAI's
shapes, errors mapped to OpenAI's status codes and body, and a dropped stream closing its Triton request.

The Triton side is a fake put in `app.state.triton` here: it records what it is asked and answers scripted Replies
(a string in the script is a model error message, raised as the real client raises it: triton_error).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from lmforge.deploy.openai_api import Reply, create_app, triton_error

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
    ({"n": 2}, "n"), ({"echo": True}, "echo"), ({"temperature": "hot"}, "temperature"), ({"stop": 3}, "stop"),
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


def test_a_client_that_goes_away_closes_its_triton_request(tmp_path):
    """A real uvicorn: the client reads the first event and hangs up; the fake's generator is closed (the real one
    cancels its gRPC call there) instead of running on."""
    import uvicorn

    from lmforge.components.runtime.ports import free_port

    app, fake = app_with(tmp_path, delay=0.02, forever=True)
    port = free_port("127.0.0.1")
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.05)
        body = json.dumps({"model": "lmforge", "prompt": "Once", "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            got = b""
            while b"data: " not in got:
                got += s.recv(4096)
        assert fake.cancelled.wait(5), "the Triton request was not closed after the client went away"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
