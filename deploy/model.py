"""The Triton python-backend model: batched generation with lmforge's one generation path.

Copied by deploy/repository.py into `<repo>/<model>/<version>/model.py`, beside
`lmforge_runtime/` (generation, modelload, processing, records, requestlog) and `model/`
(the model folder). It runs inside the server's Python (.venv-serve locally, the NGC
container's on GPUs):

    inputs   PROMPT [n,1] BYTES (a signature), MAX_NEW_TOKENS [n,1] INT32 (optional)
    outputs  SUMMARY, COMPLETION, TOKEN_IDS [n,1] BYTES; OUTPUT_TOKENS [n,1] INT32; MEAN_LOGPROB,
             FIRST_TOKEN_MS, DECODE_MS [n,1] FP32

The model loads with modelload.load_model (an int8 or low-rank variant as what it is), goes
to the instance's GPU unless its kernels are CPU-only (processing.serving_device: an int8
variant stays on the CPU, and the server log says why), and generates with generation.generate:
the prompt template, eos prefix, greedy decoding and
stopping rule that evaluation scores and the MLflow pyfunc runs. A version whose model/ folder
is an ONNX export (model.onnx, [deploy] format = "onnx") runs the graph in onnxruntime on the CPU
instead, through generation.decode (the same prompt ids, greedy rows, stopping rule and outputs;
components/onnxrun.py is its forward): nvidia-pytriton's tritonserver ships the python backend
only, no onnxruntime backend, so the graph is served from here. TOKEN_IDS holds the
generated ids, space-separated. Triton hands `execute` every request of a dynamic batch;
their valid rows are generated together, and each request gets exactly one response:
its outputs, or a TritonError with code INVALID_ARG (HTTP 400) saying what is wrong with
it. One bad request never fails the others. Every row is appended to the request log.
"""

import json
import os
import sys
import time

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lmforge_runtime import generation, modelload, onnxrun, processing  # noqa: E402
from lmforge_runtime.requestlog import RequestLog, RequestRecord, now_iso  # noqa: E402

OUTPUTS = ("SUMMARY", "COMPLETION", "TOKEN_IDS", "OUTPUT_TOKENS", "MEAN_LOGPROB", "FIRST_TOKEN_MS", "DECODE_MS")


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
        self.forward = None
        graph = os.path.join(folder, onnxrun.GRAPH_FILE)
        if os.path.isfile(graph):  # an ONNX export: the same loop (generation.decode) over onnxruntime's forward
            self.model, self.device = None, "cpu"
            self.forward = onnxrun.OnnxForward(graph, threads=threads)
            pb_utils.Logger.log_info(f"{self.name} v{self.version}: ONNX graph on onnxruntime "
                                     f"{onnxrun.runtime_version()} (CPU execution provider, {threads} threads)")
            self.rare_ids = processing.load_rare_ids(here)
            log_dir = params.get("request_log", "")
            self.log = RequestLog(log_dir) if log_dir else None
            return
        self.model = modelload.load_model(folder)  # safetensors only; never runs code shipped with a model
        # A GPU instance of an int8 variant keeps it on the CPU: torch's quantized::linear_dynamic has
        # CPU kernels only (processing.serving_device, a copy of lmforge's accelerator.runnable_device check).
        device, why = processing.serving_device(self.model, args["model_instance_kind"],
                                                args["model_instance_device_id"], torch.cuda.is_available())
        if device != "cpu":
            self.model = self.model.to(torch.device(device))
        self.device = device
        pb_utils.Logger.log_info(f"{self.name} v{self.version}: model on {device} ({why})")
        self.rare_ids = processing.load_rare_ids(here)
        log_dir = params.get("request_log", "")
        self.log = RequestLog(log_dir) if log_dir else None

    # --- one request: validate and tokenise --------------------------------------
    def _parse(self, request):
        prompts = pb_utils.get_input_tensor_by_name(request, "PROMPT")
        if prompts is None:  # Triton refuses a missing required input before us; this guards a config drift
            raise processing.BadRequest("missing_input", "input PROMPT is required")
        rows = prompts.as_numpy().reshape(-1)
        mnt = pb_utils.get_input_tensor_by_name(request, "MAX_NEW_TOKENS")
        max_new = processing.parse_max_new_tokens(
            None if mnt is None else mnt.as_numpy().reshape(-1).tolist(), len(rows), self.limits)
        parsed = []
        for row, raw in enumerate(rows):
            signature = processing.decode_prompt(raw, self.limits, row=row)
            ids = processing.check_tokens(generation.encode_prompt(self.tok, signature), self.limits, row=row)
            sig_ids = self.tok(signature)["input_ids"]
            rate = processing.rare_token_rate(sig_ids, self.rare_ids, self.tok.unk_token_id)
            parsed.append({"ids": ids, "chars": len(signature), "tokens": len(sig_ids), "rare": rate,
                           "max_new": max_new[row]})
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
        prompts, limits = [r["ids"] for r in rows], [r["max_new"] for r in rows]
        if self.forward is not None:
            outs = generation.decode(self.forward, self.tok, prompts, max_new_tokens=limits, scores=True)
        else:
            outs = generation.generate(self.model, self.tok, prompts, max_new_tokens=limits, scores=True)
        return [{"summary": o.summary, "completion": o.text, "token_ids": " ".join(str(t) for t in o.token_ids),
                 "output_tokens": o.tokens, "mean_logprob": o.mean_logprob, "first_token_ms": o.first_token_s * 1e3,
                 "decode_ms": (o.total_s - o.first_token_s) * 1e3} for o in outs]

    def _tensors(self, results):
        def col(key, dtype):
            return np.array([[r[key]] for r in results], dtype=dtype)
        return [
            pb_utils.Tensor("SUMMARY", col("summary", np.object_)),
            pb_utils.Tensor("COMPLETION", col("completion", np.object_)),
            pb_utils.Tensor("TOKEN_IDS", col("token_ids", np.object_)),
            pb_utils.Tensor("OUTPUT_TOKENS", col("output_tokens", np.int32)),
            pb_utils.Tensor("MEAN_LOGPROB", col("mean_logprob", np.float32)),
            pb_utils.Tensor("FIRST_TOKEN_MS", col("first_token_ms", np.float32)),
            pb_utils.Tensor("DECODE_MS", col("decode_ms", np.float32)),
        ]

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
                    output_chars=len(res["completion"]) if res else 0,
                    mean_logprob=float(res["mean_logprob"]) if res else 0.0, latency_ms=latency, status=status))
            except OSError as e:  # a full disk must not fail serving; the server log says so
                pb_utils.Logger.log_error(f"request log: {e}")

    def finalize(self):
        self.model = self.forward = None

