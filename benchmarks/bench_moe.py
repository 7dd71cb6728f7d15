"""Mixture of Experts against dense at equal active parameters: tokens/s and loss after the same tokens, in one run.

    python benchmarks/bench_moe.py                  # writes benchmarks/results/moe.{json,md}
    python benchmarks/bench_moe.py --steps 40 --rounds 2

Models (the demo preset's shape: hidden 256, 4 layers, 8 heads, MLP 688; a 512-token BPE on
standard-library docstrings, tests/integration/train_support.py):
- dense: the preset's Llama;
- MoE: every layer's MLP as 4 experts, each as wide as the dense MLP, top-1, capacity 1.25,
  aux_loss_coef 0.01 (transformers' Qwen3-MoE, run as DeepSpeed MoE layers). A token computes
  with one expert, so the active parameters match the dense model's, plus the router
  (4 x 256 a layer) and Qwen3's per-head q/k norms; the MoE holds about 4x the MLP weights.
Both train through lmforge's real launcher on 2 ranks, ZeRO-2, fp32, from the same seed on the
same batches (seq 128, 8 rows a rank, every step logged); the MoE runs at expert_parallel 1
(each rank all 4 experts) and 2 (2 experts a rank, tokens exchanged by all-to-all). Throughput
is the median of the logged steps' tokens/s after `--warmup`; loss is the mean LM loss (without
the auxiliary loss) of the last 5 steps, the same tokens for every run. The runs alternate for
`--rounds` rounds and each ratio is the median of the rounds' ratios, so load from other work on
the machine falls on all of them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402
from lmforge.components.sections.training import ModelConfig, TrainingConfig  # noqa: E402
from lmforge.components.training.model import param_count  # noqa: E402
from lmforge.components.workspace import Workspace  # noqa: E402
from tests.integration.train_support import make_dataset, run_training  # noqa: E402

EXPERTS, VOCAB = 4, 512
RUNS = {"dense": (0, 1), "moe-ep1": (EXPERTS, 1), "moe-ep2": (EXPERTS, 2)}


def training(experts: int, ep: int, steps: int) -> TrainingConfig:
    return TrainingConfig.model_validate({
        "seed": 0, "num_ranks": 2, "precision": "fp32", "seq_len": 128, "micro_batch_size": 8, "max_steps": steps,
        "warmup_steps": 4, "save_every": steps, "log_every": 1,
        "model": {"preset": "demo", "moe": {"num_experts": experts, "top_k": 1}},
        "parallel": {"strategy": "zero2", "expert_parallel": ep}})


def measure(ws: Workspace, name: str, cfg: TrainingConfig, warmup: int) -> dict:
    events, _ = run_training(ws, name, cfg, timeout_s=1200)
    tps = statistics.median(e["tokens_per_s"] for e in events[warmup:])
    return {"tokens_per_s": tps, "loss_last5": statistics.fmean(e["loss"] for e in events[-5:]),
            "losses": [e["loss"] for e in events], "dropped": [e.get("moe_dropped_fraction") for e in events],
            "tokens": cfg.max_steps * cfg.seq_len * cfg.micro_batch_size * 2}


def counts(experts: int) -> dict[str, int]:
    cfg = ModelConfig(preset="demo", moe={"num_experts": experts, "top_k": 1})
    return {"params": param_count(cfg, vocab_size=VOCAB), "active": param_count(cfg, vocab_size=VOCAB, active=True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="dense / MoE runs alternate; ratios are the rounds' medians")
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as tmp:
        ws = Workspace(Path(tmp) / "ws").ensure()
        make_dataset(ws, vocab_size=VOCAB)
        rounds = [{name: measure(ws, f"{name}-{i}", training(*RUNS[name], args.steps), args.warmup) for name in RUNS}
                  for i in range(args.rounds)]
    results = {"steps": args.steps, "warmup": args.warmup, "rounds": rounds,
               "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]},
               "counts": {"dense": counts(0), "moe": counts(EXPERTS)}}
    rows = []
    for name in RUNS:
        tps = [r[name]["tokens_per_s"] for r in rounds]
        speed = [r[name]["tokens_per_s"] / r["dense"]["tokens_per_s"] for r in rounds]
        loss = statistics.fmean(r[name]["loss_last5"] for r in rounds)
        c = results["counts"]["dense" if name == "dense" else "moe"]
        results[name] = {"tokens_per_s": statistics.median(tps), "vs_dense": statistics.median(speed), "loss_last5": loss}
        dropped = [d for r in rounds for d in r[name]["dropped"] if d is not None]
        rows.append((name, f"{c['params'] / 1e6:.2f}M", f"{c['active'] / 1e6:.2f}M", f"{statistics.median(tps):,.0f}",
                     f"{statistics.median(speed):.2f} ({', '.join(f'{s:.2f}' for s in speed)})", f"{loss:.3f}",
                     f"{statistics.fmean(dropped):.3f}" if dropped else ""))
    write_results("moe", results, ["run", "params", "active/token", "tokens/s", "vs dense (rounds)",
                                   f"loss, mean of steps {args.steps - 4}-{args.steps}", "dropped fraction"], rows,
                  command="python benchmarks/bench_moe.py" + "".join(f" {a}" for a in sys.argv[1:]))
    print(f"1-min load average: {results['load_average_1min']['start']:.1f} at the start, "
          f"{results['load_average_1min']['end']:.1f} at the end")


if __name__ == "__main__":
    main()
