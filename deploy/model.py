"""The Triton python-backend model: batched generation with lmforge's one generation path, under the LLM convention.

Copied by deploy/repository.py into `<repo>/<model>/<version>/model.py`, beside
`lmforge_runtime/` (generation, task, modelload, processing, records, requestlog) and `model/`
(the model folder). It runs inside the server's Python (.venv-serve locally, the NGC
container's on GPUs). Its tensors are those of Triton's own LLM backends (vLLM's, TensorRT-LLM's),
so Triton's generate endpoint (`POST /v2/models/<model>/generate` with
`{"text_input": "...", "max_tokens": 16}`), tritonclient and the tools built for them work unchanged:

    inputs   text_input [n,1] BYTES; optional max_tokens INT32, temperature FP32, top_p FP32, top_k INT32,
             seed INT64, exclude_input_in_output BOOL [n,1]; stop [n,k] BYTES (stop strings)
    outputs  text_output, token_ids [n,1] BYTES; prompt_tokens, output_tokens [n,1] INT32; mean_logprob,
             first_token_ms, decode_ms [n,1] FP32

A prompt is rendered, stopped and scored by the model's task (lmforge_runtime/task.py, recorded in
the model's lmforge.json): for a chat task, a text_input holding a JSON list of {role, content}
messages is the chat, any other text one user turn. text_output is the completion, cut before the
first stop string (the task's and the request's); with `exclude_input_in_output = false` it
starts with the text_input. Greedy unless `temperature > 0`; a sampled request runs alone with its
seed, so the same seed gives the same text whatever shares its batch.

The model loads with modelload.load_model (an int8 or low-rank variant as what it is) and goes to
the instance's GPU unless its kernels are CPU-only (processing.serving_device: an int8 variant stays
on the CPU, and the server log says why). A version whose model/ folder is an ONNX export
(model.onnx, [deploy] format = "onnx") runs the graph in onnxruntime on the CPU through
generation.decode (greedy only: a sampled request is refused): nvidia-pytriton's tritonserver ships
the python backend only, no onnxruntime backend, so the graph is served from here. token_ids holds
the generated ids, space-separated. Triton hands `execute` every request of a dynamic batch; their
valid rows are generated together, and each request gets exactly one response: its outputs, or a
TritonError with code INVALID_ARG (HTTP 400) naming the input that is wrong. One bad request never
fails the others. Every row is appended to the request log.
"""

import json
import os
import sys
import time

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lmforge_runtime import generation, modelload, onnxrun, processing, task  # noqa: E402
from lmforge_runtime.requestlog import RequestLog, RequestRecord, now_iso  # noqa: E402

BYTES_OUTPUTS = ("text_output", "token_ids")
INT_OUTPUTS = ("prompt_tokens", "output_tokens")
FLOAT_OUTPUTS = ("mean_logprob", "first_token_ms", "decode_ms")


class TritonPythonModel:
    def initialize(self, args):
        import torch

        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.name = args["model_name"]
        self.version = str(args["model_version"])
        self.limits = processing.Limits(
            max_prompt_chars=int(params["max_prompt_chars"]), max_prompt_tokens=int(params["max_prompt_tokens"]),
            max_new_tokens=int(params["max_new_tokens"]), max_new_tokens_limit=int(params["max_new_tokens_limit"]))
        threads = int(params.get("threads", "0")) or max(1, (os.cpu_count() or 1) // int(params.get("instances", "1")))
        torch.set_num_threads(threads)
        here = os.path.dirname(os.path.abspath(__file__))
        folder = os.path.join(here, "model")
        self.tok = modelload.load_tokenizer(folder)
        self.task = task.Task.load(folder)
        self.rare_ids = processing.load_rare_ids(here)
        log_dir = params.get("request_log", "")
        self.log = RequestLog(log_dir) if log_dir else None
        self.model = self.forward = None
        graph = os.path.join(folder, onnxrun.GRAPH_FILE)
        if os.path.isfile(graph):  # an ONNX export: the same loop (generation.decode) over onnxruntime's forward
            self.device = "cpu"
            self.forward = onnxrun.OnnxForward(graph, threads=threads)
            pb_utils.Logger.log_info(f"{self.name} v{self.version}: ONNX graph on onnxruntime "
                                     f"{onnxrun.runtime_version()} (CPU execution provider, {threads} threads); "
                                     f"task {self.task.kind}")
            return
        self.model = modelload.load_model(folder)  # safetensors only; never runs code shipped with a model
        # A GPU instance of an int8 variant keeps it on the CPU: torch's quantized::linear_dynamic has
        # CPU kernels only (processing.serving_device, a copy of lmforge's accelerator.runnable_device check).
        device, why = processing.serving_device(self.model, args["model_instance_kind"],
                                                args["model_instance_device_id"], torch.cuda.is_available())
        if device != "cpu":
            self.model = self.model.to(torch.device(device))
        self.device = device
        pb_utils.Logger.log_info(f"{self.name} v{self.version}: model on {device} ({why}); task {self.task.kind}")

    # --- one request: validate and tokenise --------------------------------------
    def _input(self, request, name):
        """The rows of an optional input as a list (None when absent); one row a prompt."""
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return None
        arr = t.as_numpy()
        return [list(r) for r in arr.reshape(arr.shape[0], -1)] if name == "stop" else arr.reshape(-1).tolist()

    def _parse(self, request):
        texts = self._input(request, "text_input")
        if texts is None:  # Triton refuses a missing required input before us; this guards a config drift
            raise processing.BadRequest("missing_input", "input text_input is required")
        n = len(texts)
        max_new = processing.parse_max_tokens(self._input(request, "max_tokens"), n, self.limits)
        sampling = processing.parse_sampling({k: self._input(request, k) for k in processing.SAMPLING_INPUTS}, n)
        stops = processing.parse_stop(self._input(request, "stop"), n)
        exclude = self._input(request, "exclude_input_in_output")
        parsed = []
        for row, raw in enumerate(texts):
            text = processing.decode_text(raw, self.limits, row=row)
            if self.forward is not None and not sampling[row].greedy:
                raise processing.BadRequest("bad_temperature", f"temperature[{row}] is {sampling[row].temperature}; "
                                            "this version is an ONNX export, served greedy only: send 0")
            try:
                ids = self.task.encode(self.tok, self.task.parse_prompt(text))
            except task.TaskError as e:
                raise processing.BadRequest("bad_prompt", f"text_input[{row}]: {e}") from None
            ids = processing.check_tokens(ids, self.limits, row=row)
            text_ids = self.tok(text)["input_ids"]
            parsed.append({"row": generation.Row(ids, max_new[row], sampling[row],
                                                 (*self.task.stop_strings, *stops[row])),
                           "chars": len(text), "tokens": len(text_ids), "prompt_tokens": len(ids),
                           "rare": processing.rare_token_rate(text_ids, self.rare_ids, self.tok.unk_token_id),
                           "echo": text if exclude is not None and not bool(exclude[row]) else ""})
        return parsed

    # --- a dynamic batch ----------------------------------------------------------
    def execute(self, requests):
        start = time.perf_counter()
        responses = [None] * len(requests)
        rows, owners = [], []
        for i, request in enumerate(requests):
            try:
                parsed = self._parse(request)
            except processing.BadRequest as e:
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
                self._log([{"chars": 0, "tokens": 0, "rare": 0.0}], None, start, status=e.code)
                continue
            owners.append((i, len(rows), len(parsed)))
            rows.extend(parsed)
        if rows:
            try:
                results = self._generate(rows)
            except Exception as e:  # a failure of the batch itself (e.g. out of memory): every request says so
                for i, _, _n in owners:
                    responses[i] = pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"generation failed: {type(e).__name__}: {e}"))
                self._log(rows, None, start, status="generation_failed")
                return responses
            for i, first, n in owners:
                mine = results[first:first + n]
                responses[i] = pb_utils.InferenceResponse(output_tensors=self._tensors(mine))
            self._log(rows, results, start, status="ok")
        return responses

    def _generate(self, rows):
        todo = [r["row"] for r in rows]
        if self.forward is not None:  # greedy only (checked in _parse): rows that stop alike decode together
            outs = [None] * len(todo)
            for members in generation.batches(todo):
                done = generation.decode(self.forward, self.tok, [todo[i].ids for i in members], scores=True,
                                         max_new_tokens=[todo[i].max_new_tokens for i in members],
                                         stop_strings=todo[members[0]].stop_strings)
                for i, o in zip(members, done):
                    outs[i] = o
        else:
            outs = generation.generate_rows(self.model, self.tok, todo, scores=True)
        return [{"text_output": r["echo"] + o.text, "token_ids": " ".join(str(t) for t in o.token_ids),
                 "prompt_tokens": r["prompt_tokens"], "output_tokens": o.tokens, "mean_logprob": o.mean_logprob,
                 "first_token_ms": o.first_token_s * 1e3, "decode_ms": (o.total_s - o.first_token_s) * 1e3}
                for r, o in zip(rows, outs)]

    def _tensors(self, results):
        def col(key, dtype):
            return pb_utils.Tensor(key, np.array([[r[key]] for r in results], dtype=dtype))
        return ([col(k, np.object_) for k in BYTES_OUTPUTS] + [col(k, np.int32) for k in INT_OUTPUTS]
                + [col(k, np.float32) for k in FLOAT_OUTPUTS])

    def _log(self, rows, results, start, *, status):
        if self.log is None:
            return
        latency = (time.perf_counter() - start) * 1e3
        ts = now_iso()
        for k, r in enumerate(rows):
            res = results[k] if results else None
            try:
                self.log.append(RequestRecord(
                    ts=ts, model=self.name, version=self.version, prompt_chars=r["chars"], prompt_tokens=r["tokens"],
                    rare_token_rate=float(r["rare"]), output_tokens=res["output_tokens"] if res else 0,
                    output_chars=len(res["text_output"]) if res else 0,
                    mean_logprob=float(res["mean_logprob"]) if res else 0.0, latency_ms=latency, status=status))
            except OSError as e:  # a full disk must not fail serving; the server log says so
                pb_utils.Logger.log_error(f"request log: {e}")

    def finalize(self):
        self.model = self.forward = None

