"""ZeRO-Infinity's NVMe tier against cpu offload: host RAM (peak rss a rank) and tokens/s, as ratios in one run.

    python benchmarks/bench_offload.py                    # writes benchmarks/results/offload.{json,md}
    python benchmarks/bench_offload.py --steps 20 --rounds 2 --nvme-dir /mnt/nvme

Both runs train the demo preset (hidden 256, 4 layers, MLP 688; a 512-token BPE on standard-library
docstrings, tests/integration/train_support.py) through lmforge's real launcher on 2 CPU ranks,
ZeRO-3, fp32, from the same seed on the same batches (seq 128, 8 rows a rank): `cpu` with
offload_optimizer = offload_param = "cpu", `nvme` with both "nvme" under --nvme-dir (a folder with
O_DIRECT; the default is a temporary folder, checked). Host RAM is each rank's peak resident set
(getrusage, from the step events' memory rows) at the last step; tokens/s the median of the logged
steps after `--warmup`; NVMe bytes the rank's swap files at the last step. The runs alternate for
`--rounds` rounds and each ratio is the median of the rounds' ratios, so load from other work on the
machine falls on both alike. Final losses are listed to show both runs trained the same numbers.
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
from lmforge.components.training.nvme import check_direct_io  # noqa: E402
from lmforge.components.workspace import Workspace  # noqa: E402
from tests.integration.train_support import make_dataset, run_training  # noqa: E402

VOCAB = 512


def training(device: str, steps: int, nvme_dir: Path) -> TrainingConfig:
    parallel = {"strategy": "zero3", "offload_optimizer": device, "offload_param": device,
                **({"nvme_path": str(nvme_dir)} if device == "nvme" else {})}
    return TrainingConfig.model_validate({
        "seed": 0, "num_ranks": 2, "precision": "fp32", "seq_len": 128, "micro_batch_size": 8, "max_steps": steps,
        "warmup_steps": 4, "save_every": steps, "log_every": 1, "model": {"preset": "demo"}, "parallel": parallel})


def measure(ws: Workspace, name: str, cfg: TrainingConfig, warmup: int) -> dict:
    events, _ = run_training(ws, name, cfg, timeout_s=1200)
    last = events[-1]["memory"]
    return {"tokens_per_s": statistics.median(e["tokens_per_s"] for e in events[warmup:]),
            "rss_peak_mb": [m["rss_peak"] / 2 ** 20 for m in last], "nvme_mb": [m["nvme"] / 2 ** 20 for m in last],
            "final_loss": events[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="cpu / nvme runs alternate; ratios are the rounds' medians")
    ap.add_argument("--nvme-dir", type=Path, default=None, help="a folder with O_DIRECT; default: a temporary one")
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_offload_") as tmp:
        nvme_dir = args.nvme_dir or Path(tmp) / "nvme"
        check_direct_io(nvme_dir)
        ws = Workspace(Path(tmp) / "ws").ensure()
        make_dataset(ws, vocab_size=VOCAB)
        rounds = [{d: measure(ws, f"{d}-{i}", training(d, args.steps, nvme_dir), args.warmup) for d in ("cpu", "nvme")}
                  for i in range(args.rounds)]
    results = {"steps": args.steps, "warmup": args.warmup, "rounds": rounds,
               "params": param_count(ModelConfig(preset="demo"), vocab_size=VOCAB),
               "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]}}
    rss = [max(r["nvme"]["rss_peak_mb"]) / max(r["cpu"]["rss_peak_mb"]) for r in rounds]
    tps = [r["nvme"]["tokens_per_s"] / r["cpu"]["tokens_per_s"] for r in rounds]
    results["nvme_vs_cpu"] = {"peak_rss": statistics.median(rss), "tokens_per_s": statistics.median(tps)}
    rows = []
    for d in ("cpu", "nvme"):
        peak = statistics.median(max(r[d]["rss_peak_mb"]) for r in rounds)
        rows.append((d, f"{peak:,.0f}", f"{statistics.median(max(r[d]['nvme_mb']) for r in rounds):,.1f}",
                     f"{statistics.median(r[d]['tokens_per_s'] for r in rounds):,.0f}",
                     ", ".join(f"{r[d]['final_loss']:.4f}" for r in rounds)))
    rows.append(("nvme / cpu (rounds)", f"{statistics.median(rss):.3f} ({', '.join(f'{x:.3f}' for x in rss)})", "",
                 f"{statistics.median(tps):.2f} ({', '.join(f'{x:.2f}' for x in tps)})", ""))
    write_results("offload", results, ["offload", "peak rss a rank, MiB (max of 2)", "NVMe swap a rank, MiB",
                                       "tokens/s", f"loss at step {args.steps} (rounds)"], rows,
                  command="python benchmarks/bench_offload.py" + "".join(f" {a}" for a in sys.argv[1:]))
    print(f"1-min load average: {load_start:.1f} at the start, {results['load_average_1min']['end']:.1f} at the end")


if __name__ == "__main__":
    main()
