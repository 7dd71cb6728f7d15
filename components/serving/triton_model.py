"""The Triton python-backend model: a decoupled LLM model with continuous batching and token streaming.

deploy/repository.py copies this package (components/serving) whole into `<repo>/<model>/<version>/lmforge_serving/`,
beside `model/` (the model folder) and a `model.py` of three lines that imports `TritonPythonModel` from here. It
runs inside the server's Python (.venv-serve locally, the NGC container's on GPUs), or the model's own
execution environment (`EXECUTION_ENV_PATH`: .venv-vllm for engine = "vllm").

Its contract is NVIDIA's vllm_backend's, so Triton's generate endpoints, tritonclient's streaming
and the tools built for them (genai-perf, Triton's OpenAI frontend) work unchanged:

    decoupled, max_batch_size 0: one prompt per request, one or more responses, the last flagged final
    inputs   text_input [1] BYTES; optional stream BOOL, sampling_parameters BYTES (JSON: max_tokens,
             temperature, top_p, top_k, seed, stop, logprobs, prompt_logprobs), exclude_input_in_output BOOL,
             return_finish_reason,
             return_num_input_tokens, return_num_output_tokens BOOL; and the individual max_tokens INT32,
             temperature FP32, top_p FP32, top_k INT32, seed INT64, stop [-1] BYTES (TensorRT-LLM's form;
             a setting sent both ways is refused)
    outputs  text_output (streamed: only the new text of each response), and on the final response
             token_ids BYTES, prompt_tokens, output_tokens INT32, mean_logprob, first_token_ms, decode_ms FP32;
             finish_reason, num_input_tokens, num_output_tokens when their return_* input asks; logprobs,
             prompt_logprobs BYTES (JSON lists, one entry per token) when sampling_parameters asks

`POST /v2/models/<model>/generate` answers `{"text_input": "...", "max_tokens": 16}` with one JSON
object; `.../generate_stream` with `"stream": true` sends server-sent events, one per new piece of
text. Over gRPC a stream (`start_stream`/`async_stream_infer`) gets the same responses.

`execute` parses each request, hands it to the instance's engine (engine.py: transformers' continuous
batching, one manager per instance; or, with parameter engine = "vllm", vllm_engine.py: vLLM's AsyncLLM in
this stub, whose Python is then .venv-vllm) and returns at once; the engine's thread hands its responses to the
instance's outbox, whose thread sends them in order (as vllm_backend's response thread does; responses.py). A
request is rendered and stopped by the model's task (task.py). vllm_backend's `ignore_eos`, and a
`structured_outputs` constraint (vLLM engine only), are taken from `sampling_parameters` too; the gauge
`lmforge_engine_requests` counts the requests the engine holds, by its own count, and the counters
`lmforge_responses_total` and `lmforge_response_send_seconds_total` the responses sent and the time spent sending
them (the stub's hop to Triton: their ratio is a response's cost).
Every request ends with a final response: its outputs, or a TritonError (INVALID_ARG, HTTP 400, naming the input
that is wrong; UNAVAILABLE, HTTP 503, when the instance already holds `max_queue` requests; INTERNAL when
generation fails). A client that cancels or goes away (`is_cancelled()`) has its request dropped from the batch.
One bad request never fails another.
Every request is logged once, when it ends and before its final response goes (prompt features, output tokens,
TTFT, TPOT, finish reason).

The model loads with modelload.load_model (an int8 or low-rank variant as what it is) and goes to
the instance's GPU unless its kernels are CPU-only (processing.serving_device). A version whose
model/ folder is an ONNX export (model.onnx) runs the graph in onnxruntime on the CPU through
generation.decode behind engine.Batcher (greedy only: a sampled request is refused); nvidia-pytriton's
tritonserver ships the python backend only, no onnxruntime backend.
"""

import dataclasses
import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from . import engine, generation, modelload, onnxrun, processing, task, vllm_engine
from .requestlog import RequestLog, RequestRecord, now_iso
from .responses import FINAL, Outbox, Stream

# The version folder: <version>/model.py imports this package, copied whole as <version>/lmforge_serving/.
VERSION_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETTINGS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
         "return_num_output_tokens")


class TritonPythonModel:
    def initialize(self, args):
        import torch

        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.name = args["model_name"]
        self.version = str(args["model_version"])
        here = VERSION_DIR
        folder = os.path.join(here, "model")
        self.tok = modelload.load_tokenizer(folder)
        engine_config = engine.EngineConfig(
            max_requests_per_step=int(params["max_requests_per_step"]), kv_cache_tokens=int(params["kv_cache_tokens"]),
            page_tokens=int(params["kv_page_tokens"]), max_queue=int(params["max_queue"]))
        threads = int(params.get("threads", "0")) or max(1, (os.cpu_count() or 1) // int(params.get("instances", "1")))
        torch.set_num_threads(threads)
        self.task = task.Task.load(folder)
        self.task_stops, self.task_ends = self.task.stops(self.tok)   # a chat template's end of turn included
        self.rare_ids = processing.load_rare_ids(here)
        log_dir = params.get("request_log", "")
        self.log = RequestLog(log_dir) if log_dir else None
        self.onnx = os.path.isfile(os.path.join(folder, onnxrun.GRAPH_FILE))
        self.model = None   # the torch module, where this engine has one (log-probabilities are scored with it)
        if self.onnx:
            self.engine = self._onnx_engine(folder, threads, engine_config)
        elif params.get("engine") == "vllm":
            self.engine = self._vllm_engine(folder, args, engine_config, params)
        else:
            self.engine = self._torch_engine(folder, args, engine_config)
        self.limits = self._limits(folder, params)
        self.ready_gauge = self._ready_gauge(args)
        self.outbox = Outbox()
        self.engine.on_failure = self._engine_failed
        self.engine.start()
        self.ready_gauge.set(1)
        self.live = {}   # engine request id -> its response sender, watched for cancellation
        self.live_lock = threading.Lock()
        self.watching = True
        self.watcher = threading.Thread(target=self._watch_cancellations, name="lmforge-cancel", daemon=True)
        self.watcher.start()

    def _ready_gauge(self, args):
        """Triton's metrics endpoint carries lmforge_engine_ready{model, version, instance}: 1 while this instance's
        engine serves, 0 once it has failed (`lmforge status` reads it; Triton's own readiness cannot be changed by a
        python model)."""
        # Kept for the instance's life: Triton refuses a metric whose family has been deleted.
        self.ready_family = pb_utils.MetricFamily(name="lmforge_engine_ready", kind=pb_utils.MetricFamily.GAUGE,
                                                  description="1 while the model instance's engine serves, 0 once it "
                                                              "has failed")
        labels = {"model": self.name, "version": self.version, "instance": str(args.get("model_instance_name", ""))}
        self.requests_family = pb_utils.MetricFamily(
            name="lmforge_engine_requests", kind=pb_utils.MetricFamily.GAUGE,
            description="requests the model instance's engine holds (queued or running), by its own count")
        self.requests_gauge = self.requests_family.Metric(labels=labels)
        self.sent_family = pb_utils.MetricFamily(
            name="lmforge_responses_total", kind=pb_utils.MetricFamily.COUNTER,
            description="responses the model instance sent (each streamed piece and each final response)")
        self.sent_counter = self.sent_family.Metric(labels=labels)
        self.send_family = pb_utils.MetricFamily(
            name="lmforge_response_send_seconds_total", kind=pb_utils.MetricFamily.COUNTER,
            description="seconds the model instance spent handing its responses to Triton (the stub's IPC)")
        self.send_counter = self.send_family.Metric(labels=labels)
        return self.ready_family.Metric(labels=labels)

    def _engine_failed(self, why):
        self.ready_gauge.set(0)
        pb_utils.Logger.log_error(f"{self.name} v{self.version}: the engine failed ({why}); every request in flight "
                                  "was ended with an error, and new ones are refused (UNAVAILABLE) until the server "
                                  "or the model is restarted")

    def _limits(self, folder, params):
        """The request limits: the model's context, tightened by the deployment's caps where they are set (non-zero);
        the character bound is the tokens a prompt may use times the longest token's characters."""
        from transformers import AutoConfig

        config = self.model.config if self.model is not None else AutoConfig.from_pretrained(folder)
        context = processing.context_length(config.get_text_config())
        tokens = int(params["max_prompt_tokens"]) or context
        longest = max((len(t) for t in self.tok.get_vocab()), default=1)
        return processing.Limits(
            context=context, max_new_tokens=int(params["max_new_tokens"]),
            max_prompt_chars=int(params["max_prompt_chars"]) or tokens * max(longest, 1),
            max_prompt_tokens=int(params["max_prompt_tokens"]), max_new_tokens_limit=int(params["max_new_tokens_limit"]))

    def _torch_engine(self, folder, args, engine_config):
        import torch

        model = self.model = modelload.load_model(folder)  # safetensors only; never runs code shipped with a model
        device, why = processing.serving_device(model, args["model_instance_kind"], args["model_instance_device_id"],
                                                torch.cuda.is_available())
        if device != "cpu":
            model = model.to(torch.device(device))
        pb_utils.Logger.log_info(f"{self.name} v{self.version}: model on {device} ({why}); task {self.task.kind}; "
                                 f"continuous batching, {engine_config.max_requests_per_step} requests a step, "
                                 f"KV cache {engine_config.kv_cache_tokens} tokens, queue {engine_config.max_queue}")
        return engine.Engine(model, self.tok, engine_config, ends=self.task_ends)

    def _vllm_engine(self, folder, args, engine_config, params):
        """vLLM's AsyncLLM in this stub (its Python is the model's EXECUTION_ENV_PATH, .venv-vllm), fp32 on a CPU so
        that greedy answers equal the transformers engine's; the instance's GPU is the one Triton gave it."""
        import torch
        from transformers import AutoConfig

        gpu = args["model_instance_kind"] == "GPU" and torch.cuda.is_available()
        if gpu:
            torch.cuda.set_device(int(args["model_instance_device_id"]))
        shape = modelload.cache_shape(AutoConfig.from_pretrained(folder))
        settings = vllm_engine.VllmSettings(
            kv_cache_bytes=vllm_engine.kv_cache_bytes(shape, engine_config.kv_cache_tokens, 2 if gpu else 4),
            dtype="auto" if gpu else "float32", gpu_memory_utilization=float(params["gpu_memory_utilization"]),
            start_timeout_s=float(params.get("vllm_start_timeout_s", "600")))
        pb_utils.Logger.log_info(f"{self.name} v{self.version}: vLLM engine in this stub on "
                                 f"{'cuda:' + str(args['model_instance_device_id']) if gpu else 'cpu'}; task "
                                 f"{self.task.kind}; {engine_config.max_requests_per_step} requests a step, KV cache "
                                 f"{engine_config.kv_cache_tokens} tokens ({settings.kv_cache_bytes / 2**20:.0f} MiB), "
                                 f"queue {engine_config.max_queue}")
        return vllm_engine.VllmEngine(folder, self.tok, engine_config, settings, ends=self.task_ends,
                                      note=lambda said: pb_utils.Logger.log_info(f"{self.name} v{self.version}: {said}"))

    def _onnx_engine(self, folder, threads, engine_config):
        forward = onnxrun.OnnxForward(os.path.join(folder, onnxrun.GRAPH_FILE), threads=threads)
        pb_utils.Logger.log_info(f"{self.name} v{self.version}: ONNX graph on onnxruntime {onnxrun.runtime_version()} "
                                 f"(CPU execution provider, {threads} threads); task {self.task.kind}")

        def run(rows):   # greedy only (checked in _parse): rows that stop alike decode together
            outs = [None] * len(rows)
            for members in generation.batches(rows):
                done = generation.decode(forward, self.tok, [rows[i].ids for i in members], scores=True,
                                         ends=self.task_ends,
                                         max_new_tokens=[rows[i].max_new_tokens for i in members],
                                         stop_strings=rows[members[0]].stop_strings)
                for i, o in zip(members, done):
                    outs[i] = o
            return outs
        return engine.Batcher(run, engine_config)

    # --- a request in ------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            self._submit(request, time.perf_counter())
        return None

    def _submit(self, request, arrived):
        sender = request.get_response_sender()
        try:
            parsed = self._parse(request)
        except processing.BadRequest as e:
            self._refuse(sender, str(e), pb_utils.TritonError.INVALID_ARG, status=e.code)
            return
        stream = Stream(self, sender, parsed, arrived)
        row = parsed["row"]
        if row.max_new_tokens == 0:   # only the prompt's log-probabilities: no generation
            if self.model is not None:   # scored here, in one forward pass
                stream.on_event(engine.Final("length", generation.Output((), "", 0.0, 0.0,
                                                                         time.perf_counter() - arrived)))
                return
            row = dataclasses.replace(row, max_new_tokens=1)   # vLLM scores the prompt on the way to one token
        try:
            rid = self.engine.submit(row, stream.on_event)
        except engine.Busy as e:
            self._refuse(sender, f"{self.name} v{self.version} is busy: {e}", pb_utils.TritonError.UNAVAILABLE,
                         status="busy", parsed=parsed)
            return
        except engine.EngineFailed as e:
            self._refuse(sender, f"{self.name} v{self.version} is not ready: {e}; restart the server or roll out "
                                 "again (lmforge run deploy)", pb_utils.TritonError.UNAVAILABLE,
                         status="engine_failed", parsed=parsed)
            return
        with self.live_lock:
            stream.rid = rid
            if not stream.ended:
                self.live[rid] = (sender, stream)
        del sender, stream   # only `live` and the engine hold them: Triton unloads a model once its senders are gone

    def _refuse(self, sender, message, code, *, status, parsed=None):
        self.record(parsed, None, status=status, arrived=None)
        self.outbox.put(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), FINAL)

    def _value(self, request, name):
        """An optional input's value: a scalar, the list of a [-1] input (stop), or None when it is absent."""
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return None
        values = t.as_numpy().reshape(-1).tolist()
        return values if name == "stop" else (values[0] if values else None)

    def _parse(self, request):
        text_input = self._value(request, "text_input")
        if text_input is None:  # Triton refuses a missing required input before us; this guards a config drift
            raise processing.BadRequest("missing_input", "input text_input is required")
        flags = {name: bool(v) for name in FLAGS if (v := self._value(request, name)) is not None}
        if flags.get("stream") and flags.get("exclude_input_in_output") is False:
            raise processing.BadRequest("bad_exclude_input", "exclude_input_in_output = false is not allowed when "
                                                             "streaming (as in vLLM's backend); leave it out")
        individual = {k: (None if (v := self._value(request, k)) is None else [v]) for k in SETTINGS}
        settings = processing.request_settings(individual, self._value(request, "sampling_parameters"), self.limits)
        text = processing.decode_text(text_input, self.limits)
        if self.onnx and not settings.sampling.greedy:
            raise processing.BadRequest("bad_temperature", f"temperature[0] is {settings.sampling.temperature}; this "
                                                           "version is an ONNX export, served greedy only: send 0")
        self._check_engine_can(settings)
        try:   # a prompt to score is scored as given (a harness's context is rendered already), as vLLM does
            ids = (self.tok(text, add_special_tokens=False)["input_ids"] if settings.prompt_logprobs is not None
                   else self.task.encode(self.tok, self.task.parse_prompt(text)))
        except task.TaskError as e:
            raise processing.BadRequest("bad_prompt", f"text_input[0]: {e}") from None
        ids, max_new = processing.check_tokens(ids, self.limits, settings.max_new)
        text_ids = self.tok(text)["input_ids"]
        row = generation.Row(ids, max_new, settings.sampling, (*self.task_stops, *settings.stops),
                             ignore_eos=settings.ignore_eos, logprobs=settings.logprobs,
                             prompt_logprobs=settings.prompt_logprobs, structured=settings.structured)
        return {"row": row, "flags": flags, "chars": len(text), "tokens": len(text_ids), "prompt_tokens": len(ids),
                "rare": processing.rare_token_rate(text_ids, self.rare_ids, self.tok.unk_token_id),
                "echo": text if flags.get("exclude_input_in_output") is False else "",
                "logprobs": settings.logprobs, "prompt_logprobs": settings.prompt_logprobs}

    def _check_engine_can(self, settings):
        """What only some engines do: vLLM constrains output and reports log-probabilities itself; the transformers
        engine scores with its model; the ONNX graph does neither. A request asking for what this one cannot is a
        400 naming it."""
        vllm = isinstance(self.engine, vllm_engine.VllmEngine)
        if settings.structured is not None and not vllm:
            raise processing.BadRequest("bad_sampling_parameters", "sampling_parameters.structured_outputs needs "
                                                                   "[deploy] engine = \"vllm\"; this version's engine "
                                                                   f"is {'ONNX' if self.onnx else 'transformers'}")
        if self.onnx and (settings.logprobs is not None or settings.prompt_logprobs is not None):
            raise processing.BadRequest("bad_sampling_parameters", "sampling_parameters.logprobs: this version's "
                                                                   "engine (ONNX) reports no log-probabilities; leave "
                                                                   "it out")
        if settings.ignore_eos and settings.sampling.seeded and not vllm:
            raise processing.BadRequest("bad_sampling_parameters", "sampling_parameters.ignore_eos with a seed: the "
                                                                   "transformers engine runs a seeded row alone, "
                                                                   "stopping at its end ids; leave out one of them")

    def scores(self, parsed, out):
        """The final response's logprobs and prompt_logprobs tensors, when the request asked for them: one forward
        pass over the prompt and the answer (generation.score_tokens), entries as JSON lists. It runs on the thread
        that delivers the final response (the engine's result thread), so such a request delays its neighbours'
        next tokens by one forward pass over its own tokens."""
        want = {k: parsed[k] for k in ("logprobs", "prompt_logprobs") if parsed[k] is not None}
        if not want:
            return []
        ids = list(parsed["row"].ids)
        if self.model is None:   # the engine reported them (vLLM)
            parts = {"prompt_logprobs": list(out.prompt_logprobs or []), "logprobs": list(out.logprobs or [])}
            return [pb_utils.Tensor(k, np.array([json.dumps(trim(parts[k], top)).encode()], dtype=np.object_))
                    for k, top in want.items()]
        entries = generation.score_tokens(self.model, self.tok, ids + list(out.token_ids), top=max(want.values()),
                                          then=out.end_id)
        parts = {"prompt_logprobs": entries[:len(ids)], "logprobs": entries[len(ids):]}
        return [pb_utils.Tensor(k, np.array([json.dumps(trim(parts[k], top)).encode()], dtype=np.object_))
                for k, top in want.items()]

    # --- cancellation and the log ----------------------------------------------------------
    def _watch_cancellations(self):
        """Every 0.1 s: a request whose client cancelled or went away is dropped from the engine."""
        while self.watching:
            # Under the lock: a request leaves `live` (ended) before its final response is sent, and asking a sender
            # whose final response has gone is a use after free in the server (it crashed the server in a test).
            with self.live_lock:
                cancelled = [rid for rid, (sender, _) in self.live.items() if sender.is_cancelled()]
            for rid in cancelled:
                self.engine.cancel(rid)
            self.requests_gauge.set(self.engine.engine_requests)
            self._push_sends()
            time.sleep(0.1)

    def _push_sends(self):
        """The responses sent since the last push onto their counters (a metric update is an IPC call to Triton:
        once every 0.1 s, not once a token)."""
        count, seconds = self.outbox.take()
        if count:
            self.sent_counter.increment(count)
            self.send_counter.increment(seconds)

    def ended(self, stream):
        with self.live_lock:
            stream.ended = True
            for rid, (_, s) in list(self.live.items()):
                if s is stream:
                    del self.live[rid]

    def record(self, parsed, output, *, status, arrived, finish_reason=""):
        if self.log is None:
            return
        p = parsed or {"tokens": 0, "chars": 0, "rare": 0.0}
        sampling = parsed["row"].sampling if parsed else generation.GREEDY
        now = time.perf_counter()
        ttft = output.first_token_s * 1e3 if output else 0.0
        tpot = (output.total_s - output.first_token_s) * 1e3 / (output.tokens - 1) if output and output.tokens > 1 else 0.0
        try:
            self.log.append(RequestRecord(
                ts=now_iso(), model=self.name, version=self.version, prompt_chars=p["chars"], prompt_tokens=p["tokens"],
                rare_token_rate=float(p["rare"]), output_tokens=output.tokens if output else 0,
                output_chars=len(output.text) if output else 0,
                mean_logprob=float(output.mean_logprob) if output else 0.0,
                latency_ms=(now - arrived) * 1e3 if arrived else 0.0, status=status, ttft_ms=ttft, tpot_ms=tpot,
                finish_reason=finish_reason, temperature=float(sampling.temperature),
                seed=str(sampling.seed) if sampling.seeded else ""))
        except OSError as e:  # a full disk must not fail serving; the server log says so
            pb_utils.Logger.log_error(f"request log: {e}")

    def finalize(self):
        self.watching = False
        self.watcher.join(timeout=5)   # before the engine stops and the stub tears down what is_cancelled() uses
        self.engine.stop()
        self.outbox.close()   # the final responses of what stop() ended go out before the stub tears down
        del self.ready_gauge, self.requests_gauge, self.sent_counter, self.send_counter   # metrics before families
        del self.ready_family, self.requests_family, self.sent_family, self.send_family


def trim(entries, top):
    """score_tokens' entries with `top` alternatives each (a request's logprobs and prompt_logprobs may differ)."""
    return [None if e is None else {**e, "top": e["top"][:top]} for e in entries]
