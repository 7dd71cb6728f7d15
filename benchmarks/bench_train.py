"""Training throughput, MFU, ZeRO memory and the pipeline bubble, against baselines, in one run.

    python benchmarks/bench_train.py                       # writes benchmarks/results/train.{json,md}
    python benchmarks/bench_train.py --steps 20 --strategies ddp,zero2

Same model (the demo Llama preset), same data and the same global batch (16 x 128 tokens)
everywhere:
- baselines: a plain single-process PyTorch loop (bf16 autocast, AdamW) and the HF Trainer;
- each strategy with 2 ranks through lmforge's real launcher (deepspeed, gloo on CPU);
- per-rank model-state memory of ZeRO 0/1/2/3 (measured with gradients alive) against the
  ZeRO paper's 16 / 4+12/N / 2+14/N / 16/N bytes per parameter;
- the pipeline bubble (2 stages): the idle fraction per stage against (p-1)/(m+p-1), m = 2, 4, 8.
Tokens/s is the median over the steps after the first `--warmup` of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lmforge.components.sections.training import TrainingConfig  # noqa: E402
from lmforge.components.training.model import build_model, count_params, load_tokenizer, train_flops_per_token  # noqa: E402
from lmforge.components.training.perf import matmul_peak_flops  # noqa: E402
from lmforge.components.training.pipeline_model import lm_loss  # noqa: E402
from lmforge.components.training.planner import model_state_bytes  # noqa: E402
from lmforge.components.workspace import Workspace, atomic_write_json, atomic_write_text  # noqa: E402
from tests.integration.train_support import make_dataset, run_training  # noqa: E402

GLOBAL_BATCH, SEQ = 16, 128
STRATEGIES = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "pipeline": {"strategy": "ddp", "pipeline": {"stages": 2, "micro_batches": 4, "partition": "parameters"}},
    "tensor": {"strategy": "zero1", "tensor": {"autotp_size": 2}},
}


def training_cfg(steps: int, parallel: dict, micro: int) -> TrainingConfig:
    return TrainingConfig.model_validate({
        "model": {"preset": "demo"}, "seq_len": SEQ, "micro_batch_size": micro, "max_steps": steps, "warmup_steps": 2,
        "save_every": 10 ** 6, "precision": "bf16", "parallel": parallel, "num_ranks": 2})


def plain_loop(ws: Workspace, version: str, steps: int, warmup: int) -> list[float]:
    from lmforge.components.training.data import TokenWindows

    tok = load_tokenizer(ws.dataset_dir(version) / "tokenizer")
    cfg = training_cfg(steps, {"strategy": "ddp"}, GLOBAL_BATCH)
    model = build_model(cfg.model, tok, seq_len=SEQ, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    windows = TokenWindows.open(ws.training_shards(version), seq_len=SEQ, seed=0)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = windows.micro_batches(step, dp_rank=0, dp_size=1, micro=GLOBAL_BATCH, accum=1)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model(input_ids=x).logits, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return [GLOBAL_BATCH * SEQ / t for t in times[warmup:]]


def hf_trainer(ws: Workspace, version: str, steps: int, warmup: int) -> list[float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lmforge.components.training.data import TokenWindows

    tok = load_tokenizer(ws.dataset_dir(version) / "tokenizer")
    model = build_model(training_cfg(steps, {"strategy": "ddp"}, GLOBAL_BATCH).model, tok, seq_len=SEQ, seed=0)
    windows = TokenWindows.open(ws.training_shards(version), seq_len=SEQ, seed=0)
    rows = [windows.batch(windows.window_ids(i, 1)) for i in range(GLOBAL_BATCH * steps)]
    data = [{"input_ids": x[0], "labels": torch.cat([x[0][:1], y[0][:-1]])} for x, y in rows]  # HF shifts labels itself
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_train_end(self, *a, **k):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH, max_steps=steps, learning_rate=3e-3,
                                 bf16=True, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                                 dataloader_num_workers=0, max_grad_norm=1.0, weight_decay=0.1, disable_tqdm=True)
        Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()]).train()
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    return [GLOBAL_BATCH * SEQ / t for t in times[warmup:]]


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    import deepspeed
    import transformers

    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
            "load_avg_at_start": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--bubble", default="2,4,8", help="pipeline micro-batch counts; empty to skip")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        ws = Workspace(Path(tmp) / "ws").ensure()
        version = make_dataset(ws, vocab_size=2048)
        tok = load_tokenizer(ws.dataset_dir(version) / "tokenizer")
        demo = training_cfg(1, {"strategy": "ddp"}, 8).model
        n_params = count_params(build_model(demo, tok, seq_len=SEQ, seed=0))
        fpt = train_flops_per_token(demo, vocab_size=len(tok), seq_len=SEQ)
        torch.set_num_threads(os.cpu_count() or 1)
        peak = matmul_peak_flops(torch.bfloat16)
        rows, memory, bubble = [], [], []
        for name, fn in (("plain PyTorch (1 process)", plain_loop), ("HF Trainer (1 process)", hf_trainer)):
            tps = statistics.median(fn(ws, version, args.steps, args.warmup))
            rows.append({"run": name, "tokens_per_s": tps, "mfu": tps * fpt / peak})
            print(rows[-1], flush=True)
        base = rows[0]["tokens_per_s"]
        for name in filter(None, args.strategies.split(",")):
            par = STRATEGIES[name]
            dp = 1 if ("pipeline" in par or "tensor" in par) else 2
            m = par.get("pipeline", {}).get("micro_batches", 1)
            events, _ = run_training(ws, f"bench-{name}", training_cfg(args.steps, par, GLOBAL_BATCH // dp // m), timeout_s=900)
            tps = statistics.median(e["tokens_per_s"] for e in events[args.warmup:])
            rows.append({"run": f"{name} (2 ranks)", "tokens_per_s": tps, "mfu": statistics.median(e["mfu"] for e in events[args.warmup:]),
                         "vs_plain": tps / base})
            print(rows[-1], flush=True)
            if name in ("ddp", "zero1", "zero2", "zero3"):
                theory = sum(v for k, v in model_state_bytes(n_params, strategy=name, dp=2, precision="bf16").items() if k != "host")
                measured = [r["total"] for r in events[1]["memory"]]
                memory.append({"strategy": name, "theory_mb": theory / 2 ** 20, "measured_mb_per_rank": [x / 2 ** 20 for x in measured],
                               "ratio": max(measured) / theory})
        for m in [int(x) for x in args.bubble.split(",") if x]:
            par = {"strategy": "ddp", "pipeline": {"stages": 2, "micro_batches": m, "partition": "parameters"}}
            events, _ = run_training(ws, f"bench-bubble-{m}", training_cfg(args.steps, par, GLOBAL_BATCH // m), timeout_s=900)
            per_stage = [statistics.median(e["memory"][r]["idle_fraction"] for e in events[args.warmup:]) for r in range(2)]
            theory = 1 / (m + 1)
            bubble.append({"micro_batches": m, "theory": theory, "idle_per_stage": per_stage,
                           "max_abs_error": max(abs(x - theory) for x in per_stage)})
            print(bubble[-1], flush=True)
        # The plain loop again at the end, so that load from other processes on a shared machine
        # does not favour one side: the baseline is the better of its two runs.
        again = statistics.median(plain_loop(ws, version, args.steps, args.warmup))
        if again > base:
            rows[0] = {"run": rows[0]["run"], "tokens_per_s": again, "mfu": again * fpt / peak}
            for row in rows[2:]:
                row["vs_plain"] = row["tokens_per_s"] / again
        rows[0]["runs"] = [base, again]
    result = {"machine": info, "command": " ".join([Path(sys.executable).name, *sys.argv]), "params": n_params,
              "global_batch_tokens": GLOBAL_BATCH * SEQ, "peak_bf16_flops": peak, "throughput": rows, "memory": memory,
              "bubble": bubble}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "train.json", result)
    atomic_write_text(args.out / "train.md", render(result))
    print(render(result))


def render(r: dict) -> str:
    m = r["machine"]
    lines = [f"## bench_train: {r['params'] / 1e6:.2f}M-param Llama, global batch {r['global_batch_tokens']} tokens, bf16", "",
             f"machine: {m['nproc']} cores, {m['cpu']}; load average at start {m['load_avg_at_start']:.1f}; "
             f"python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}, transformers {m['transformers']}; "
             f"measured bf16 matmul peak {r['peak_bf16_flops'] / 1e9:.0f} GFLOP/s", "", f"command: `{r['command']}`", "",
             "| run | tokens/s | MFU | vs plain loop |", "|---|---:|---:|---:|"]
    base = r["throughput"][0]["tokens_per_s"]
    for row in r["throughput"]:
        lines.append(f"| {row['run']} | {row['tokens_per_s']:.0f} | {row['mfu']:.1%} | {row['tokens_per_s'] / base:.2f}x |")
    if r["memory"]:
        lines += ["", "| ZeRO model state per rank | theory MB | measured MB (rank 0, rank 1) | measured / theory |", "|---|---:|---:|---:|"]
        for row in r["memory"]:
            lines.append(f"| {row['strategy']} | {row['theory_mb']:.2f} | {', '.join(f'{x:.2f}' for x in row['measured_mb_per_rank'])} | {row['ratio']:.3f} |")
    if r["bubble"]:
        lines += ["", "| pipeline micro-batches m (p=2) | theory (p-1)/(m+p-1) | idle stage 0 | idle stage 1 | max error |", "|---:|---:|---:|---:|---:|"]
        for row in r["bubble"]:
            lines.append(f"| {row['micro_batches']} | {row['theory']:.3f} | {row['idle_per_stage'][0]:.3f} | {row['idle_per_stage'][1]:.3f} | {row['max_abs_error']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
