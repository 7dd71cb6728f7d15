"""How the Triton model's responses go out: a request's Stream turns the engine's events into Triton responses (each
new piece of text when streaming, then the final response with its outputs), and the instance's Outbox sends them, in
order, from a thread of its own, as vllm_backend's response thread does (components/serving/triton_model.py uses
both)."""

import dataclasses
import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from . import engine

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Outbox:
    """An instance's responses, sent in order by a thread of their own, as vllm_backend's response thread sends them.
    Triton's `send()` waits for the server's side to take each response (about 0.5 ms a response on a busy 2-core
    host, by these counters); sent from the engine's thread, that wait came between two steps, ~13% of a token's
    time at 32 streams (docs/benchmarks.md). Counts the responses sent and the seconds spent sending them."""

    def __init__(self):
        self.queue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.count, self.seconds = 0, 0.0
        self.thread = threading.Thread(target=self._run, name="lmforge-send", daemon=True)
        self.thread.start()

    def put(self, sender, response=None, flags=0, *, gone=None):
        """Send later, in this order; `gone(error)` is called when the client has gone away (a closed sender)."""
        self.queue.put((sender, response, flags, gone))

    def _run(self):
        while (item := self.queue.get()) is not None:
            start = time.perf_counter()
            self._send(*item)
            spent = time.perf_counter() - start
            with self.lock:
                self.count += 1
                self.seconds += spent
            del item   # the sender is released once its response is out

    @staticmethod
    def _send(sender, response, flags, gone):
        """One send; nothing it raises stops the outbox (the next request's responses wait behind it)."""
        try:
            try:
                if response is None:
                    sender.send(flags=flags)
                else:
                    sender.send(response, flags=flags)
            except pb_utils.TritonModelException as e:   # the client went away between two responses
                if gone is not None:
                    gone(e)
        except Exception as e:
            pb_utils.Logger.log_error(f"outbox: a response was not sent: {type(e).__name__}: {e}")

    def take(self):
        """(responses, seconds) since the last take."""
        with self.lock:
            out, (self.count, self.seconds) = (self.count, self.seconds), (0, 0.0)
        return out

    def close(self, timeout=10.0):
        """Send what is queued, then stop."""
        self.queue.put(None)
        self.thread.join(timeout=timeout)


class Stream:
    """One request's responses: each engine Delta (when streaming), then the final response; logged once."""

    def __init__(self, model, sender, parsed, arrived):
        self.model, self.sender, self.parsed, self.arrived = model, sender, parsed, arrived
        self.flags = parsed["flags"]
        self.streaming = self.flags.get("stream", False)
        self.ended = False
        self.rid = None   # the engine's id for it, once submitted
        # Three threads may call in: the engine's with a delta, the cancellation watcher's (through engine.cancel)
        # with the final, the outbox's when the client has gone; one at a time, so the request ends, and is logged,
        # once.
        self.lock = threading.Lock()

    def on_event(self, event):
        with self.lock:
            if self.sender is None:   # ended already (its client went away): nothing more to send
                return
            self._respond(event)

    def gone(self, error):
        """The client went away between two responses (its sender is closed): the request ends, logged cancelled,
        and leaves the engine's batch."""
        with self.lock:
            if self.sender is None:
                return
            self.model.ended(self)
            self.sender = None
            self.model.record(self.parsed, None, status="cancelled", arrived=self.arrived, finish_reason="cancelled")
        if self.rid is not None:
            self.model.engine.cancel(self.rid)

    def _respond(self, event):
        if self.parsed["row"].max_new_tokens == 0:   # the prompt scored only (vLLM generated a token to score it)
            if isinstance(event, engine.Delta):
                return
            if event.output is not None:
                event = engine.Final("length", dataclasses.replace(event.output, token_ids=(), text="", logprobs=(),
                                                                   mean_logprob=0.0, end_id=None))
        if isinstance(event, engine.Delta):
            if self.streaming and event.text:
                self.model.outbox.put(self.sender, pb_utils.InferenceResponse(
                    output_tensors=self._text(event.text, len(event.token_ids))), gone=self.gone)
            return
        self.model.ended(self)
        sender, self.sender = self.sender, None   # released once the final response is out: Triton waits for it
        # Logged before the final response goes: a client that has its answer finds its request in the log.
        if event.finish_reason == "error":
            self.model.record(self.parsed, None, status="generation_failed", arrived=self.arrived)
            self.model.outbox.put(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"generation failed: {event.error}", pb_utils.TritonError.INTERNAL)), FINAL)
            return
        out = event.output
        self.model.record(self.parsed, out, status="ok" if event.finish_reason != "cancelled" else "cancelled",
                          arrived=self.arrived, finish_reason=event.finish_reason)
        if event.finish_reason == "cancelled":
            self.model.outbox.put(sender, None, FINAL)   # the client is gone or asked to stop: end the stream, nothing more
        else:
            text = "" if self.streaming else self.parsed["echo"] + out.text
            new = 0 if self.streaming else out.tokens
            tensors = (self._text(text, new, finish_reason=event.finish_reason) + self._details(out)
                       + self.model.scores(self.parsed, out))
            self.model.outbox.put(sender, pb_utils.InferenceResponse(output_tensors=tensors), FINAL)

    def _text(self, text, new_tokens, *, finish_reason=None):
        tensors = [pb_utils.Tensor("text_output", np.array([text], dtype=np.object_))]
        if self.flags.get("return_num_output_tokens"):
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([new_tokens], dtype=np.uint32)))
        if finish_reason and self.flags.get("return_finish_reason"):
            tensors.append(pb_utils.Tensor("finish_reason", np.array([finish_reason], dtype=np.object_)))
        if finish_reason and self.flags.get("return_num_input_tokens"):
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array([self.parsed["prompt_tokens"]], dtype=np.uint32)))
        return tensors

    def _details(self, out):
        """lmforge's outputs on the final response: the whole answer's tokens, counts, score and timings."""
        values = {"token_ids": (" ".join(str(t) for t in out.token_ids), np.object_),
                  "prompt_tokens": (self.parsed["prompt_tokens"], np.int32), "output_tokens": (out.tokens, np.int32),
                  "mean_logprob": (out.mean_logprob, np.float32), "first_token_ms": (out.first_token_s * 1e3, np.float32),
                  "decode_ms": ((out.total_s - out.first_token_s) * 1e3, np.float32)}
        return [pb_utils.Tensor(k, np.array([v], dtype=dt)) for k, (v, dt) in values.items()]
