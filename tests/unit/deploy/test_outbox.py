"""The Triton model's outbox (components/serving/responses.py): the engine's thread hands a response over and goes
on while the outbox's own thread sends, in order; a closed sender says its client has gone; what was sent and
the time spent sending are counted. Through the real tritonserver: tests/integration/test_serving_traffic.py."""

from __future__ import annotations

import importlib
import sys
import threading
import time

import pytest

from tests.unit.deploy import fake_triton


@pytest.fixture
def outbox(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_triton.module([]))
    monkeypatch.delitem(sys.modules, "lmforge.components.serving.responses", raising=False)
    box = importlib.import_module("lmforge.components.serving.responses").Outbox()
    yield box
    box.close()
    monkeypatch.delitem(sys.modules, "lmforge.components.serving.responses")


class SlowSender(fake_triton.Sender):
    """Each send waits until the test lets it go, as Triton's send waits for the server's side."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def send(self, response=None, flags=0) -> None:
        self.go.wait(timeout=10)
        super().send(response, flags)


class ClosedSender(fake_triton.Sender):
    def send(self, response=None, flags=0) -> None:
        raise fake_triton.TritonModelException("Unable to send response. Response sender has been closed.")


def test_a_response_is_handed_over_without_waiting_for_its_send_and_responses_go_in_order(outbox):
    sender = SlowSender()
    start = time.perf_counter()
    for i in range(3):
        outbox.put(sender, fake_triton.InferenceResponse([]), 1 if i == 2 else 0)
    assert time.perf_counter() - start < 0.5 and sender.sent == []   # the caller (the engine) did not wait
    sender.go.set()
    outbox.close()
    assert [flags for _, flags in sender.sent] == [0, 0, 1]
    count, seconds = outbox.take()
    assert count == 3 and seconds > 0
    assert outbox.take() == (0, 0.0)


def test_a_closed_sender_tells_its_request_the_client_has_gone_and_the_next_request_is_sent(outbox):
    gone, fine = [], fake_triton.Sender()
    outbox.put(ClosedSender(), fake_triton.InferenceResponse([]), gone=gone.append)
    outbox.put(fine, None, 1)
    outbox.close()
    assert len(gone) == 1 and isinstance(gone[0], fake_triton.TritonModelException)
    assert fine.sent == [(None, 1)]


def test_a_send_that_fails_otherwise_is_logged_and_the_outbox_goes_on(monkeypatch):
    logged: list[str] = []
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_triton.module(logged))
    monkeypatch.delitem(sys.modules, "lmforge.components.serving.responses", raising=False)
    box = importlib.import_module("lmforge.components.serving.responses").Outbox()

    def broken(error):
        raise RuntimeError("the request's log is gone")
    fine = fake_triton.Sender()
    box.put(ClosedSender(), fake_triton.InferenceResponse([]), gone=broken)
    box.put(fine, None, 1)
    box.close()
    monkeypatch.delitem(sys.modules, "lmforge.components.serving.responses")
    assert fine.sent == [(None, 1)] and any("the request's log is gone" in m for m in logged)
