"""The Triton python-backend model: batched generation with an exported safetensors model.

Copied by deploy/repository.py into `<repo>/<model>/<version>/model.py`, beside
`lmforge_runtime/` (processing, records, requestlog) and `model/` (the Hugging Face folder).
It runs inside the server's Python (.venv-serve locally, the NGC container's on GPUs):

    inputs   PROMPT [n,1] BYTES (a signature), CONTEXT [n,1] BYTES (optional retrieved text),
             MAX_NEW_TOKENS [n,1] INT32 (optional)
    outputs  SUMMARY, COMPLETION [n,1] BYTES; OUTPUT_TOKENS [n,1] INT32; MEAN_LOGPROB,
             FIRST_TOKEN_MS, DECODE_MS [n,1] FP32

Triton hands `execute` every request of a dynamic batch; their valid rows are generated
together, and each request gets exactly one response: its outputs, or a TritonError
saying what is wrong with it. One bad request never fails the others. Every row is
appended to the request log for monitoring.
"""

import json
import os
import sys
import time

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lmforge_runtime import processing  # noqa: E402
from lmforge_runtime.requestlog import RequestLog, RequestRecord, now_iso  # noqa: E402

OUTPUTS = ("SUMMARY", "COMPLETION", "OUTPUT_TOKENS", "MEAN_LOGPROB", "FIRST_TOKEN_MS", "DECODE_MS")


class _FirstTokenClock:
    """A logits processor that only notes when the first decoding step starts (after prefill)."""

    def __init__(self):
        self.first = None

    def __call__(self, input_ids, scores):
        if self.first is None:
            self.first = time.perf_counter()
        return scores


class TritonPythonModel:
    def initialize(self, args):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, StoppingCriteriaList
        from transformers.generation.stopping_criteria import StopStringCriteria

        self.torch = torch
        self._processors = LogitsProcessorList
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.name = args["model_name"]
        self.version = str(args["model_version"])
        self.limits = processing.Limits(
            max_prompt_chars=int(params["max_prompt_chars"]), max_prompt_tokens=int(params["max_prompt_tokens"]),
            max_new_tokens=int(params["max_new_tokens"]), max_new_tokens_limit=int(params["max_new_tokens_limit"]))
        threads = int(params.get("threads", "0")) or max(1, (os.cpu_count() or 1) // int(params.get("instances", "1")))
        torch.set_num_threads(threads)
        if args["model_instance_kind"] == "GPU" and torch.cuda.is_available():
            self.device = torch.device(f"cuda:{args['model_instance_device_id']}")
        else:
            self.device = torch.device("cpu")

        here = os.path.dirname(os.path.abspath(__file__))
        folder = os.path.join(here, "model")
        self.tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        self.tok.padding_side = "left"  # decoder-only batches are padded on the left
        self.model = AutoModelForCausalLM.from_pretrained(
            folder, use_safetensors=True, trust_remote_code=False,  # never run code shipped with a model
            dtype=torch.float32 if self.device.type == "cpu" else "auto").to(self.device).eval()
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.eos_id = self.tok.eos_token_id
        # Padding fills rows that stopped early; the model itself never emits it, so a row's length is unambiguous.
        self.suppress = [self.pad_id] if self.pad_id != self.eos_id else None
        self.stop = StoppingCriteriaList([StopStringCriteria(self.tok, ['"""'])])
        self.rare_ids = processing.load_rare_ids(here)
        log_dir = params.get("request_log", "")
        self.log = RequestLog(log_dir) if log_dir else None

    # --- one request: validate and tokenise --------------------------------------
    def _parse(self, request):
        prompts = pb_utils.get_input_tensor_by_name(request, "PROMPT")
        if prompts is None:  # Triton refuses a missing required input before us; this guards a config drift
            raise processing.BadRequest("missing_input", "input PROMPT is required")
        rows = prompts.as_numpy().reshape(-1)
        ctx = pb_utils.get_input_tensor_by_name(request, "CONTEXT")
        contexts = ctx.as_numpy().reshape(-1) if ctx is not None else [None] * len(rows)
        if len(contexts) != len(rows):
            raise processing.BadRequest("bad_shape", f"CONTEXT has {len(contexts)} rows but PROMPT has {len(rows)}")
        mnt = pb_utils.get_input_tensor_by_name(request, "MAX_NEW_TOKENS")
        max_new = processing.parse_max_new_tokens(
            None if mnt is None else mnt.as_numpy().reshape(-1).tolist(), len(rows), self.limits)
        parsed = []
        for row, (raw, raw_ctx) in enumerate(zip(rows, contexts)):
            signature = processing.decode_prompt(raw, self.limits, row=row)
            context = processing.decode_context(raw_ctx, self.limits, row=row)
            ids = processing.check_tokens(self.tok(processing.build_prompt(signature, context))["input_ids"],
                                          self.limits, row=row)
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
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e)))
                self._log([{"chars": 0, "tokens": 0, "rare": 0.0}], None, start, status=e.code)
                continue
            owners.append((i, len(rows), len(parsed)))
            rows.extend(parsed)
        if rows:
            try:
                results = self._generate(rows)
            except Exception as e:  # a failure of the batch itself (e.g. out of memory): every request says so
                for i, _, n in owners:
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
        torch = self.torch
        width = max(len(r["ids"]) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            input_ids[b, width - len(r["ids"]):] = torch.tensor(r["ids"])
            mask[b, width - len(r["ids"]):] = 1
        clock = _FirstTokenClock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                max_new_tokens=max(r["max_new"] for r in rows), do_sample=False, pad_token_id=self.pad_id,
                eos_token_id=self.eos_id, suppress_tokens=self.suppress, stopping_criteria=self.stop,
                logits_processor=self._processors([clock]),
                return_dict_in_generate=True, output_scores=True)
            logprobs = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        t_end = time.perf_counter()
        first = clock.first or t_end
        generated = out.sequences[:, width:].cpu().tolist()
        logprobs = logprobs.float().cpu().tolist()
        results = []
        for b, r in enumerate(rows):
            n = _row_length(generated[b], r["max_new"], self.eos_id, self.pad_id)
            text = self.tok.decode(generated[b][:n], skip_special_tokens=True)
            lp = logprobs[b][:n]
            results.append({"summary": processing.extract_summary(text), "completion": text, "output_tokens": n,
                            "mean_logprob": sum(lp) / len(lp) if lp else 0.0,
                            "first_token_ms": (first - t0) * 1e3, "decode_ms": (t_end - first) * 1e3})
        return results

    def _tensors(self, results):
        def col(key, dtype):
            return np.array([[r[key]] for r in results], dtype=dtype)
        return [
            pb_utils.Tensor("SUMMARY", col("summary", np.object_)),
            pb_utils.Tensor("COMPLETION", col("completion", np.object_)),
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
        self.model = None


def _row_length(tokens, limit, eos_id, pad_id):
    """Generated tokens of one row: through its eos, before the padding that follows its stop, within its limit."""
    for n, t in enumerate(tokens[:limit]):
        if t == eos_id:
            return n + 1
        if t == pad_id:
            return n
    return min(len(tokens), limit)
