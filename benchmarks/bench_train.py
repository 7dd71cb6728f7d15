"""Training throughput, MFU, ZeRO memory and the pipeline bubble, against baselines, in one run.

    python benchmarks/bench_train.py                       # CPU: writes benchmarks/results/train.{json,md}
    python benchmarks/bench_train.py --steps 20 --strategies ddp,zero2
    python benchmarks/bench_train.py --device cuda         # one GPU: writes benchmarks/results/train.cuda.{json,md}

CPU mode. Same model (the demo Llama preset), same data and the same global batch (16 x 128
tokens) everywhere, in the precision `auto` chooses on this CPU (reported):
- baselines: a plain single-process PyTorch loop and the HF Trainer;
- each strategy with 2 ranks through lmforge's real launcher (deepspeed, gloo on CPU);
- per-rank model-state memory of ZeRO 0/1/2/3 (measured with gradients alive) against the
  ZeRO paper's 16 / 4+12/N / 2+14/N / 16/N bytes per parameter;
- the pipeline bubble (2 stages): the idle fraction per stage against (p-1)/(m+p-1), m = 2, 4, 8.
MFU is against the peak lmforge logs (a large GEMM measured once per machine).

CUDA mode. For the 125m (ddp, micro 16) and 1b (zero2, micro 8) presets at seq 1024, one GPU:
lmforge (launcher, one rank, its defaults: compile, fused AdamW) against a plain eager loop and
a plain torch.compile loop (bf16 autocast, fused AdamW) on the same model, data and batch; lmforge runs
twice, once per `training.mixed_precision` (DeepSpeed's bf16 weights with an fp32 master copy, and its
torch_autocast over fp32 weights, as the plain loop trains), so the faster can be chosen by measurement.
Target: lmforge >= 0.95x the plain torch.compile loop.
Tokens/s, MFU against the GPU's dense datasheet peak, and peak GPU memory.

Tokens/s is the median over the steps after the first `--warmup` of each run.
"""

from __future__ import annotations

import argparse
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

from lmforge.components.runtime.accelerator import Precision, autocast, choose_precision, to_device  # noqa: E402
from lmforge.components.sections.training import TrainingConfig  # noqa: E402
from lmforge.components.training.model import build_model, count_params, load_tokenizer, train_flops_per_token  # noqa: E402
from lmforge.components.training.perf import device_peak  # noqa: E402
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


def training_cfg(steps: int, parallel: dict, micro: int, *, precision: str = "auto", preset: str = "demo", seq: int = SEQ,
                 num_ranks: int | None = 2, log_every: int = 1, mixed_precision: str = "bf16_weights") -> TrainingConfig:
    return TrainingConfig.model_validate({
        "model": {"preset": preset}, "seq_len": seq, "micro_batch_size": micro, "max_steps": steps, "warmup_steps": 2,
        "save_every": 10 ** 6, "precision": precision, "parallel": parallel, "num_ranks": num_ranks, "log_every": log_every,
        "mixed_precision": mixed_precision})


def plain_loop(ws: Workspace, version: str, steps: int, warmup: int, *, precision: Precision, device: str = "cpu",
               preset: str = "demo", micro: int = GLOBAL_BATCH, seq: int = SEQ, compiled: bool = False,
               sync_every: int = 1) -> tuple[list[float], int]:
    """(tokens/s per timed window after `warmup` steps, peak device bytes) of a plain PyTorch loop."""
    from lmforge.components.training.batches import TokenWindows

    dev = torch.device(device)
    tok = load_tokenizer(ws.dataset_dir(version) / "tokenizer")
    cfg = training_cfg(steps, {"strategy": "ddp"}, micro, preset=preset, seq=seq)
    model = build_model(cfg.model, tok, seq_len=seq, seed=0).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=dev.type == "cuda")
    net = torch.compile(model) if compiled else model
    windows = TokenWindows.open(ws.training_shards(version), seq_len=seq, seed=0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rates, t0, n = [], time.perf_counter(), 0
    for step in range(steps):
        x, y = (to_device(t, dev) for t in windows.micro_batches(step, dp_rank=0, dp_size=1, micro=micro, accum=1)[0])
        with autocast(dev, precision):
            loss = lm_loss(net(input_ids=x).logits, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        n += 1
        if (step + 1) % sync_every == 0 or step + 1 == steps:
            sync()
            now = time.perf_counter()
            if step + 1 > warmup:
                rates.append(micro * seq * n / (now - t0))
            t0, n = now, 0
    peak_mem = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
    del net, model, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rates, peak_mem


def hf_trainer(ws: Workspace, version: str, steps: int, warmup: int, *, precision: Precision) -> list[float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lmforge.components.training.batches import TokenWindows

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
                                 bf16=precision.name == "bf16", use_cpu=True, report_to=[], save_strategy="no",
                                 logging_strategy="no", dataloader_num_workers=0, max_grad_norm=1.0, weight_decay=0.1,
                                 disable_tqdm=True)
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


CUDA_PRESETS = {"125m": {"strategy": "ddp", "micro": 16}, "1b": {"strategy": "zero2", "micro": 8}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 25 on CPU, 40 on CUDA)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 5 on CPU, 15 on CUDA)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="CPU mode")
    ap.add_argument("--bubble", default="2,4,8", help="CPU mode: pipeline micro-batch counts; empty to skip")
    ap.add_argument("--presets", default="125m,1b", help="CUDA mode")
    ap.add_argument("--seq", type=int, default=1024, help="CUDA mode: sequence length")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    if args.device == "cuda":
        args.steps, args.warmup = args.steps or 40, args.warmup if args.warmup is not None else 15
        result = cuda_main(args)
        name, text = "train.cuda", render_cuda(result)
    else:
        args.steps, args.warmup = args.steps or 25, args.warmup if args.warmup is not None else 5
        result = cpu_main(args)
        name, text = "train", render(result)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / f"{name}.json", result)
    atomic_write_text(args.out / f"{name}.md", text)
    print(text)


def cpu_main(args: argparse.Namespace) -> dict:
    info = machine()
    torch.set_num_threads(os.cpu_count() or 1)
    precision = choose_precision("auto", "cpu")  # what lmforge's runs below resolve too
    print(f"precision: {precision.name} ({precision.reason})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        ws = Workspace(Path(tmp) / "ws").ensure()
        version = make_dataset(ws, vocab_size=2048)
        tok = load_tokenizer(ws.dataset_dir(version) / "tokenizer")
        demo = training_cfg(1, {"strategy": "ddp"}, 8).model
        n_params = count_params(build_model(demo, tok, seq_len=SEQ, seed=0))
        fpt = train_flops_per_token(demo, vocab_size=len(tok), seq_len=SEQ)
        peak = device_peak(precision.name, torch.device("cpu"))
        rows, memory, bubble = [], [], []
        base = statistics.median(plain_loop(ws, version, args.steps, args.warmup, precision=precision)[0])
        rows.append({"run": "plain PyTorch (1 process)", "tokens_per_s": base, "mfu": base * fpt / peak.flops})
        print(rows[-1], flush=True)
        tps = statistics.median(hf_trainer(ws, version, args.steps, args.warmup, precision=precision))
        rows.append({"run": "HF Trainer (1 process)", "tokens_per_s": tps, "mfu": tps * fpt / peak.flops})
        print(rows[-1], flush=True)
        for name in filter(None, args.strategies.split(",")):
            par = STRATEGIES[name]
            dp = 1 if ("pipeline" in par or "tensor" in par) else 2
            m = par.get("pipeline", {}).get("micro_batches", 1)
            events, _ = run_training(ws, f"bench-{name}", training_cfg(args.steps, par, GLOBAL_BATCH // dp // m), timeout_s=900)
            tps = statistics.median(e["tokens_per_s"] for e in events[args.warmup:])
            rows.append({"run": f"{name} (2 ranks)", "tokens_per_s": tps,
                         "mfu": statistics.median(e["mfu"] for e in events[args.warmup:]), "vs_plain": tps / base})
            print(rows[-1], flush=True)
            if name in ("ddp", "zero1", "zero2", "zero3"):
                theory = sum(v for k, v in model_state_bytes(n_params, strategy=name, dp=2, precision=precision.name).items()
                             if k != "host")
                measured = [r["total"] for r in events[1]["memory"]]
                memory.append({"strategy": name, "theory_mb": theory / 2 ** 20,
                               "measured_mb_per_rank": [x / 2 ** 20 for x in measured], "ratio": max(measured) / theory})
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
        again = statistics.median(plain_loop(ws, version, args.steps, args.warmup, precision=precision)[0])
        if again > base:
            rows[0] = {"run": rows[0]["run"], "tokens_per_s": again, "mfu": again * fpt / peak.flops}
            for row in rows[2:]:
                row["vs_plain"] = row["tokens_per_s"] / again
        rows[0]["runs"] = [base, again]
    return {"machine": info, "command": " ".join([Path(sys.executable).name, *sys.argv]), "params": n_params,
            "global_batch_tokens": GLOBAL_BATCH * SEQ, "precision": precision.to_dict(), "peak": peak.to_dict(),
            "throughput": rows, "memory": memory, "bubble": bubble}


def cuda_main(args: argparse.Namespace) -> dict:
    """lmforge vs plain eager vs plain torch.compile, per preset, on one GPU."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    info = {**machine(), "gpu": torch.cuda.get_device_name(0)}
    dev = torch.device("cuda")
    precision = choose_precision("auto", dev)
    peak = device_peak(precision.name, dev)
    print(f"{info['gpu']}: {precision.name} ({precision.reason}); "
          f"peak {peak.flops / 1e12:.1f} TFLOP/s ({peak.source})", flush=True)
    rows = []
    sync_every = 5
    with tempfile.TemporaryDirectory() as tmp:
        ws = Workspace(Path(tmp) / "ws").ensure()
        version = make_dataset(ws, vocab_size=4096)
        tok = load_tokenizer(ws.dataset_dir(version) / "tokenizer")
        for preset in filter(None, args.presets.split(",")):
            spec = CUDA_PRESETS[preset]
            model_cfg = training_cfg(1, {"strategy": "ddp"}, 1, preset=preset, seq=args.seq).model
            fpt = train_flops_per_token(model_cfg, vocab_size=len(tok), seq_len=args.seq)
            common = dict(precision=precision, device="cuda", preset=preset, micro=spec["micro"], seq=args.seq,
                          sync_every=sync_every)
            for run, compiled in (("plain eager", False), ("plain torch.compile", True)):
                rates, mem = plain_loop(ws, version, args.steps, args.warmup, compiled=compiled, **common)
                tps = statistics.median(rates)
                rows.append({"preset": preset, "run": run, "tokens_per_s": tps, "mfu": tps * fpt / peak.flops,
                             "peak_mem_bytes": mem})
                print(rows[-1], flush=True)
            for mode in ("bf16_weights", "autocast"):  # DeepSpeed's bf16 section, then its torch_autocast one
                cfg = training_cfg(args.steps, {"strategy": spec["strategy"]}, spec["micro"], preset=preset, seq=args.seq,
                                   num_ranks=1, log_every=sync_every, mixed_precision=mode)
                events, _ = run_training(ws, f"bench-{preset}-{mode}", cfg, timeout_s=1800)
                timed = [e for e in events if e["step"] > args.warmup]
                tps = statistics.median(e["tokens_per_s"] for e in timed)
                rows.append({"preset": preset, "run": f"lmforge ({spec['strategy']}, 1 rank, {mode})", "tokens_per_s": tps,
                             "mfu": tps * fpt / peak.flops, "logged_mfu": statistics.median(e["mfu"] for e in timed),
                             "peak_mem_bytes": max(e["memory"][0]["device_peak"] for e in events),
                             "final_loss": events[-1]["loss"]})
                print(rows[-1], flush=True)
            compiled_tps = next(r["tokens_per_s"] for r in rows if r["preset"] == preset and r["run"] == "plain torch.compile")
            for r in rows:
                if r["preset"] == preset:
                    r["vs_compiled"] = r["tokens_per_s"] / compiled_tps
    return {"machine": info, "command": " ".join([Path(sys.executable).name, *sys.argv]), "seq_len": args.seq,
            "steps": args.steps, "warmup": args.warmup, "precision": precision.to_dict(), "peak": peak.to_dict(),
            "throughput": rows, "targets": {"1b": 0.95, "125m": 0.95}}


def render_cuda(r: dict) -> str:
    m = r["machine"]
    lines = [f"## bench_train --device cuda: {m['gpu']}, seq {r['seq_len']}, {r['precision']['name']}", "",
             f"machine: {m['nproc']} cores, {m['cpu']}; python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}, "
             f"transformers {m['transformers']}; peak {r['peak']['flops'] / 1e12:.1f} TFLOP/s ({r['peak']['source']})", "",
             f"command: `{r['command']}` ({r['steps']} steps, median over those after {r['warmup']})", "",
             "| preset | run | tokens/s | MFU (datasheet) | peak GPU memory | vs plain torch.compile | target |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in r["throughput"]:
        target = f"{r['targets'][row['preset']]:.1f}x" if row["run"].startswith("lmforge") else ""
        lines.append(f"| {row['preset']} | {row['run']} | {row['tokens_per_s']:.0f} | {row['mfu']:.1%} | "
                     f"{row['peak_mem_bytes'] / 2 ** 30:.1f} GiB | {row['vs_compiled']:.2f}x | {target} |")
    return "\n".join(lines) + "\n"


def render(r: dict) -> str:
    m = r["machine"]
    lines = [f"## bench_train: {r['params'] / 1e6:.2f}M-param Llama, global batch {r['global_batch_tokens']} tokens, "
             f"{r['precision']['name']}", "",
             f"machine: {m['nproc']} cores, {m['cpu']}; load average at start {m['load_avg_at_start']:.1f}; "
             f"python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}, transformers {m['transformers']}", "",
             f"precision (auto): {r['precision']['name']}: {r['precision']['reason']}", "",
             f"peak: {r['peak']['flops'] / 1e9:.0f} GFLOP/s ({r['peak']['source']})", "", f"command: `{r['command']}`", "",
             "| run | tokens/s | MFU | vs plain loop |", "|---|---:|---:|---:|"]
    base = r["throughput"][0]["tokens_per_s"]
    for row in r["throughput"]:
        lines.append(f"| {row['run']} | {row['tokens_per_s']:.0f} | {row['mfu']:.1%} | {row['tokens_per_s'] / base:.2f}x |")
    if r["memory"]:
        lines += ["", "| ZeRO model state per rank | theory MB | measured MB (rank 0, rank 1) | measured / theory |",
                  "|---|---:|---:|---:|"]
        for row in r["memory"]:
            lines.append(f"| {row['strategy']} | {row['theory_mb']:.2f} | "
                         f"{', '.join(f'{x:.2f}' for x in row['measured_mb_per_rank'])} | {row['ratio']:.3f} |")
    if r["bubble"]:
        lines += ["", "| pipeline micro-batches m (p=2) | theory (p-1)/(m+p-1) | idle stage 0 | idle stage 1 | max error |",
                  "|---:|---:|---:|---:|---:|"]
        for row in r["bubble"]:
            lines.append(f"| {row['micro_batches']} | {row['theory']:.3f} | {row['idle_per_stage'][0]:.3f} | "
                         f"{row['idle_per_stage'][1]:.3f} | {row['max_abs_error']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
