"""Serving under load, like with like: lmforge's served paths against the engine they wrap and the server a user
would otherwise pick, with one load generator, the same requests and the same concurrency (issue 42).

    .venv/bin/python benchmarks/bench_serve.py                      # everything: 2 models, 6 targets, c = 1 32 128
    .venv/bin/python benchmarks/bench_serve.py --models 100m --servers lmforge-transformers grpc-transformers \\
        engine-inprocess --concurrency 32 128 --workloads fixed --repeats 3
    .venv/bin/python benchmarks/bench_serve.py --models demo --servers lmforge-vllm vllm-own --concurrency 32

Targets (`--servers`), each loaded through the same asyncio generator (benchmarks/loadgen.py):
  lmforge-transformers  the OpenAI gateway (deploy/openai_api.py) → Triton gRPC → the model's stub → the
                        transformers continuous-batching Engine ([deploy] engine = "transformers")
  grpc-transformers     the same Triton server over gRPC streaming directly (tritonclient.grpc.aio, one channel)
  engine-inprocess      the same Engine (components/serving/engine.py) in this process: c submitters, same rows
  lmforge-vllm, grpc-vllm   the same two with [deploy] engine = "vllm" (vLLM's AsyncLLM in the stub, .venv-vllm)
  vllm-own              vLLM's own OpenAI server (.venv-vllm, `python -m vllm.entrypoints.openai.api_server`),
                        the same model, fp32, 32 sequences a step, the same KV budget
Models (`--models`, benchmarks/serve_models.py): "demo" (the demo's shape, ~3M parameters) and "100m" (a Llama of
hidden 768, 12 layers: 88M), random weights, built here. Workloads (`--workloads`): "fixed" (every request 64
tokens: `ignore_eos` and max_tokens) and "mixed" (8 to 64 tokens in a fixed order, `ignore_eos` too); greedy.

Each point is `concurrency` closed-loop streaming clients sharing max(--requests, 2 x concurrency) requests. The
targets that run on one engine (transformers: the first three; vllm: the last three) are up together and are run
at each concurrency in turn, `--repeats` times, the order reversed every other repeat (A B C, C B A, ...), after an
unrecorded warm-up point each; then they are stopped before the next group starts. Reported per target and
concurrency: output tokens/s, TTFT and TPOT p50/p99 (median and range over the repeats), errors, the generator's CPU
(% of one core: this process, over the point's wall time) and each server process's (its tree's, psutil). Ratios
are taken per repeat (A and B of one repeat) and summarised by their median and range:
  ratio 1 = lmforge-transformers / engine-inprocess;  ratio 2 = lmforge-vllm / vllm-own;
  gateway / gRPC = lmforge-X / grpc-X.
The per-token breakdown reads the transformers chain's medians at each concurrency: wall time per output token
(1 / throughput) and TPOT p50 of the engine in process, + Triton and the stub (direct gRPC), + the gateway.
Writes benchmarks/results/serve.json and .md, with the 1-minute load average at the start, end and each point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import loadgen, serve_models, serve_targets  # noqa: E402
from benchmarks.serve_report import report  # noqa: E402
from benchmarks.serve_threads import PROMPTS, build_model, run_point, triton_sender  # noqa: E402, F401 (bench_engine's, bench_onnx_serve's)

GROUPS = {"transformers": ("lmforge-transformers", "grpc-transformers", "engine-inprocess"),
          "vllm": ("lmforge-vllm", "grpc-vllm", "vllm-own")}
TARGETS = tuple(t for group in GROUPS.values() for t in group)


def start_group(stack: contextlib.ExitStack, group: str, chosen: list[str], folder: Path, tmp: Path,
                args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """Start what the chosen targets of one group need; target -> (how it is driven, what drives it)."""
    top, out = max(args.concurrency), {}
    if {f"lmforge-{group}", f"grpc-{group}"} & set(chosen):
        lm = stack.enter_context(serve_targets.lmforge_server(folder, tmp / "lmforge", group, top))
        out[f"lmforge-{group}"] = ("openai", lm)
        grpc = serve_targets.Served(grpc_url=lm.grpc_url, model=lm.model, pids={"triton": lm.pids["triton"]},
                                    alone=lm.alone, metrics=lm.metrics)
        out[f"grpc-{group}"] = ("grpc", grpc)
    if "engine-inprocess" in chosen:
        ip = stack.enter_context(serve_targets.inprocess_engine(folder, top, ignore_eos=args.ignore_eos))
        out["engine-inprocess"] = ("engine", ip)
    if "vllm-own" in chosen:
        out["vllm-own"] = ("openai", stack.enter_context(serve_targets.vllm_server(folder, tmp / "vllm-own", top)))
    return {name: out[name] for name in chosen}


async def drive(targets: dict[str, tuple[str, Any]], args: argparse.Namespace, model: str,
                points: list[dict[str, Any]]) -> None:
    """Make each target's sender (one aiohttp session for the HTTP ones, one gRPC channel per server) and sweep."""
    import aiohttp
    import tritonclient.grpc.aio as grpcaio

    connector = aiohttp.TCPConnector(limit=0)   # one connection per client, as many clients as asked
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        senders: dict[str, tuple[loadgen.Send, serve_targets.Served]] = {}
        clients = []
        for name, (kind, t) in targets.items():
            if kind == "openai":
                senders[name] = (loadgen.openai_sender(session, t.base_url, t.model, ignore_eos=args.ignore_eos), t)
            elif kind == "grpc":
                clients.append(grpcaio.InferenceServerClient(t.grpc_url))
                senders[name] = (loadgen.grpc_sender(clients[-1], t.model, ignore_eos=args.ignore_eos), t)
            else:
                senders[name] = (serve_targets.engine_sender(t), serve_targets.Served())
        try:
            await sweep(senders, args, model, points)
        finally:
            for client in clients:
                await client.close()


async def sweep(senders: dict[str, tuple[loadgen.Send, serve_targets.Served]], args: argparse.Namespace, model: str,
                points: list[dict[str, Any]]) -> None:
    """Every workload and concurrency: a warm-up point per target, then the repeats, order reversed every other; each
    point appended to `points` as it ends (an interrupted run reports those)."""
    names = list(senders)
    for kind in args.workloads:
        for c in args.concurrency:
            work = loadgen.workload(kind, max(args.requests, 2 * c), args.fixed_tokens)
            for name in names:
                warm = await loadgen.closed_loop(senders[name][0], work[:c], c)
                print(f"{model} {kind} c={c} {name}: warm-up {warm['tokens_per_s']:.0f} tok/s, "
                      f"{warm['errors']} errors {warm['error_sample'][:1]}", flush=True)
            for r in range(args.repeats):
                for name in (names if r % 2 == 0 else names[::-1]):
                    point = await measured_point(*senders[name], work, c)
                    points.append({"model": model, "workload": kind, "target": name, "repeat": r + 1, **point})
                    print(f"  {name} r{r + 1}: {point['tokens_per_s']:.0f} tok/s, TPOT p50 "
                          f"{point['tpot_p50_ms']:.1f} ms, gen CPU {point['gen_cpu_pct']:.0f}%, server CPU "
                          f"{point['server_cpu_pct']}, {point['errors']} errors", flush=True)


async def measured_point(send: loadgen.Send, served: serve_targets.Served, work: list[tuple[str, int]],
                         c: int) -> dict[str, Any]:
    """One closed-loop point, with the CPU each server process used during it and, for lmforge's servers, the stub's
    mean time to send a response (its counters, pushed every 0.1 s: read 0.3 s after the point's last response)."""
    cpu, sent = serve_targets.cpu_seconds(served), serve_targets.responses_sent(served)
    point = await loadgen.closed_loop(send, work, c)
    if served.metrics is not None:
        await asyncio.sleep(0.3)
    cpu_after, sent_after = serve_targets.cpu_seconds(served), serve_targets.responses_sent(served)
    point["server_cpu_pct"] = {k: round(100 * (cpu_after[k] - cpu[k]) / point["seconds"]) for k in cpu}
    responses = sent_after[0] - sent[0]
    if responses:
        point["responses"], point["send_us"] = responses, 1e6 * (sent_after[1] - sent[1]) / responses
    point["load_1min"] = os.getloadavg()[0]
    return point


def run_model(model: str, folder: Path, tmp: Path, args: argparse.Namespace, points: list[dict[str, Any]]) -> None:
    for group, members in GROUPS.items():
        chosen = [t for t in members if t in args.servers]
        if chosen:
            with contextlib.ExitStack() as stack:   # the group's servers stop however the sweep ends
                targets = start_group(stack, group, chosen, folder, tmp / group, args)
                asyncio.run(drive(targets, args, model, points))


def interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(serve_models.MODELS), choices=serve_models.MODELS)
    ap.add_argument("--model-dir", type=Path, help="serve this Hugging Face folder instead (named by its folder)")
    ap.add_argument("--servers", nargs="+", default=list(TARGETS), choices=TARGETS)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--workloads", nargs="+", default=list(loadgen.WORKLOADS), choices=loadgen.WORKLOADS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64, help="requests per point (at least 2 per client)")
    ap.add_argument("--fixed-tokens", type=int, default=loadgen.FIXED_TOKENS, help="each fixed request's length")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="do not send ignore_eos (a served model that predates it refuses the key)")
    ap.add_argument("--name", default="serve", help="results name: <out>/<name>.json and .md")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="results folder")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:] if argv is None else argv)
    load_start = os.getloadavg()[0]   # the cores are shared: the load beside this run is part of its conditions
    tmp = Path(tempfile.mkdtemp(prefix="bench_serve-"))
    points: list[dict[str, Any]] = []
    models: dict[str, Any] = {}
    signal.signal(signal.SIGTERM, interrupt)   # `timeout` too: servers stopped, the points so far reported
    try:
        todo = [(args.model_dir.name, args.model_dir)] if args.model_dir else \
            [(m, serve_models.build(m, tmp / "models" / m)) for m in args.models]
        for name, folder in todo:
            models[name] = serve_models.describe(folder)
            run_model(name, folder, tmp / name, args, points)
    except KeyboardInterrupt as e:
        args.interrupted = f"interrupted ({e or 'SIGINT'}) after {len(points)} points"
        print(args.interrupted, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load = {"start": load_start, "end": os.getloadavg()[0]}
    return report(points, models, vars(args), load, command=command, name=args.name, out=args.out)


if __name__ == "__main__":
    main()
