"""The ONNX python-backend model against the torch python-backend model on one Triton server, in one run.

    .venv/bin/python benchmarks/bench_onnx_serve.py                  # ~3-5 min on 2 cores
    .venv/bin/python benchmarks/bench_onnx_serve.py --model .lmforge/registry/<name>/<v>/hf --rounds 3

One tritonserver serves the same model twice, as two Triton models built by deploy/repository.py
from the same DeployConfig: `torch` (the safetensors folder: components/serving/triton_model.py runs
transformers' generate) and `onnx` (its export by deploy/onnx_export.py, checked against
torch first: components/serving/triton_model.py runs the graph in onnxruntime through generation.decode). Both
are python-backend models; nvidia-pytriton's tritonserver has no onnxruntime backend. The model
is by default a random LlamaForCausalLM of the demo's shape (bench_serve.build_model).

The clients are bench_serve's (closed loop, a gRPC stream per request, greedy, its mixed output
lengths: 8 to 64 tokens; --new-tokens is only the warm-up's); the two models are measured in
alternating rounds at each concurrency, so load from other processes falls on both. Reported per
model and concurrency: generated tokens/s
and median TTFT (the client's time to the first streamed piece), and the
ratios onnx / torch (tokens/s: > 1 is faster; TTFT: < 1 is faster; TTFT of a point is its median request's,
and of several rounds the median of theirs).

Then, without a server, where the difference comes from: 8 prompts one at a time through transformers'
generate (the torch model's loop), generation.decode over torch (the ONNX model's loop, torch's forward)
and generation.decode over onnxruntime, at --threads threads each, alternating: the ratios separate
the decoding loop from the runtime. Writes benchmarks/results/onnx_serve.json and .md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402
from benchmarks.bench_serve import PROMPTS, build_model, run_point, triton_sender  # noqa: E402
from lmforge.components.sections.deploy import DeployConfig  # noqa: E402
from lmforge.components.serving.task import DEMO  # noqa: E402
from lmforge.deploy import client, repository, server  # noqa: E402
from lmforge.deploy.onnx_export import export_onnx  # noqa: E402

MODELS = ("torch", "onnx")
LOOPS = ("torch generate", "torch decode", "onnx decode")


def in_process(model_dir: Path, onnx_dir: Path, new_tokens: int, rounds: int, threads: int) -> dict[str, Any]:
    """Where the difference comes from, without a server: 8 prompts one at a time, greedy, through transformers'
    generate (what the torch model serves with), generation.decode over torch, and generation.decode over
    onnxruntime (what the ONNX model serves with); generated tokens/s and the mean time to the first token."""
    import time

    import torch

    from lmforge.components.serving import generation, modelload
    from lmforge.components.serving.onnxrun import OnnxForward

    torch.set_num_threads(threads)
    model, tok = modelload.load_model(model_dir), modelload.load_tokenizer(model_dir)
    prompts = [DEMO.encode(tok, p) for p in PROMPTS[:8]]
    by_torch, by_onnx = generation.torch_forward(model), OnnxForward(onnx_dir / "model.onnx", threads=threads)
    stops = DEMO.stop_strings
    runs = {"torch generate": lambda ids: generation.generate(model, tok, [ids], max_new_tokens=new_tokens,
                                                              stop_strings=stops),
            "torch decode": lambda ids: generation.decode(by_torch, tok, [ids], max_new_tokens=new_tokens,
                                                          stop_strings=stops),
            "onnx decode": lambda ids: generation.decode(by_onnx, tok, [ids], max_new_tokens=new_tokens,
                                                         stop_strings=stops)}
    for run in runs.values():
        run(prompts[0])  # warm-up
    totals = {name: {"tokens": 0, "seconds": 0.0, "first_s": []} for name in runs}
    for r in range(rounds):
        for name in (LOOPS if r % 2 == 0 else LOOPS[::-1]):
            for ids in prompts:
                t0 = time.perf_counter()
                (out,) = runs[name](ids)
                totals[name]["seconds"] += time.perf_counter() - t0
                totals[name]["tokens"] += out.tokens
                totals[name]["first_s"].append(out.first_token_s)
    return {name: {"tokens_per_s": t["tokens"] / t["seconds"], "ttft_ms": 1e3 * sum(t["first_s"]) / len(t["first_s"]),
                   "tokens": t["tokens"]} for name, t in totals.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a Hugging Face folder (default: a random model of the demo's shape)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per model and concurrency")
    ap.add_argument("--threads", type=int, default=2, help="threads of the in-process comparison (torch and onnxruntime)")
    args = ap.parse_args()
    command = "python benchmarks/bench_onnx_serve.py " + " ".join(sys.argv[1:])

    tmp = Path(tempfile.mkdtemp(prefix="bench_onnx_serve-"))
    results: dict[str, Any] = {"points": [], "new_tokens": args.new_tokens, "rounds": args.rounds,
                               "load_average_start": os.getloadavg()}
    try:
        model_dir = args.model or build_model(tmp / "model")
        results["model"] = str(args.model) if args.model else "random LlamaForCausalLM, hidden 256, 4 layers"
        report = export_onnx(model_dir, tmp / "onnx")
        results["export"] = {"seconds": report.export_s, "max_abs_diff": report.max_abs_diff,
                             "tolerance": report.tolerance, "kv_cache": report.kv_cache, "versions": report.versions}
        base = DeployConfig(http_port=0, grpc_port=0, metrics_port=0, max_requests_per_step=8,
                            max_new_tokens=args.new_tokens, readiness_timeout_s=300)
        cfgs = {name: base.model_copy(update={"model_name": name}) for name in MODELS}
        repo = tmp / "repo"
        for name, folder in (("torch", model_dir), ("onnx", tmp / "onnx")):
            repository.build_version(repo, cfgs[name], version=1, model_dir=folder)
            repository.write_config(repo, cfgs[name], versions=[1], request_log=None)
        info = server.start_server(repo, base, log_path=tmp / "server.log")
        try:
            server.wait_ready(info, timeout=300)
            for name in MODELS:
                client.wait_versions(info.url, name, [1], revision=repository.config_revision(repo, name), timeout=300)
            senders = {name: triton_sender(info.grpc_url, name) for name in MODELS}
            for name in MODELS:
                for p in PROMPTS[:3]:
                    senders[name](p, args.new_tokens)  # warm-up
            for c in args.concurrency:
                for r in range(args.rounds):
                    order = MODELS if r % 2 == 0 else MODELS[::-1]
                    for name in order:
                        point = {"config": name, "round": r,
                                 **run_point(senders[name], c, args.requests_per_client * c)}
                        print(point, flush=True)
                        results["points"].append(point)
        finally:
            server.stop_server(info)
        results["in_process"] = in_process(model_dir, tmp / "onnx", args.new_tokens, args.rounds, threads=args.threads)
        print(results["in_process"], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    results["load_average_end"] = os.getloadavg()   # torch's CPU threads slow down far more than onnxruntime's
    rows, ratios = [], {}                            # when other processes share the cores: record how busy they were
    for c in args.concurrency:
        agg = {}
        for name in MODELS:
            pts = [p for p in results["points"] if p["config"] == name and p["concurrency"] == c]
            agg[name] = {"requests": sum(p["requests"] for p in pts), "errors": sum(p["errors"] for p in pts),
                         "tokens_per_s": statistics.mean(p["tokens_per_s"] for p in pts),
                         "ttft_ms": statistics.median(p["ttft_p50_ms"] for p in pts)}
            rows.append((name, c, agg[name]["requests"], f"{agg[name]['tokens_per_s']:.1f}",
                         f"{agg[name]['ttft_ms']:.0f}", agg[name]["errors"]))
        tps = agg["onnx"]["tokens_per_s"] / agg["torch"]["tokens_per_s"]
        ttft = agg["onnx"]["ttft_ms"] / agg["torch"]["ttft_ms"]
        ratios[str(c)] = {"tokens_per_s": tps, "ttft": ttft, **{f"{k}_{m}": v for m, a in agg.items() for k, v in a.items()}}
        rows.append((f"**onnx / torch at concurrency {c}**", "", "", f"**{tps:.2f}x**", f"**{ttft:.2f}x**", ""))
    results["ratios"] = ratios
    loops = results["in_process"]
    for name in LOOPS:
        rows.append((f"in-process, {name}", 1, loops[name]["tokens"], f"{loops[name]['tokens_per_s']:.1f}",
                     f"{loops[name]['ttft_ms']:.0f}", 0))
    for a, b in (("onnx decode", "torch decode"), ("torch decode", "torch generate")):
        tps = loops[a]["tokens_per_s"] / loops[b]["tokens_per_s"]
        ttft = loops[a]["ttft_ms"] / loops[b]["ttft_ms"]
        results["ratios"][f"{a} / {b}"] = {"tokens_per_s": tps, "ttft": ttft}
        rows.append((f"**in-process {a} / {b}**", "", "", f"**{tps:.2f}x**", f"**{ttft:.2f}x**", ""))
    start, end = results["load_average_start"], results["load_average_end"]
    rows.append((f"1-min load average: {start[0]:.1f} at the start, {end[0]:.1f} at the end", "", "", "", "", ""))
    write_results("onnx_serve", results, ["model", "concurrency", "requests", "tokens/s", "TTFT ms (median)", "errors"],
                  rows, command=command)


if __name__ == "__main__":
    main()
