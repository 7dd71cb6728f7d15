"""The parameter-server family against DDP (all-reduce) on 2 CPU ranks: same model, same data, one run.

    python benchmarks/bench_ps.py                     # writes benchmarks/results/ps.{json,md}
    python benchmarks/bench_ps.py --steps 30 --straggle 0.3 --rounds 2

Runs: ddp (DeepSpeed, ZeRO stage 0: gradients all-reduced), ps-sync, async-sgd (max_staleness 4),
hogwild and easgd (alpha 0.25, tau 4), each through lmforge's real launcher on 2 ranks (rank 0 is the
server and worker 0), fp32, from the same seed on the same batches: the demo preset's shape at seq 64,
4 windows a worker a step, every step logged. Scenario "straggler": rank 1 sleeps `--straggle` seconds
every step (protocol.STRAGGLER_ENV), on purpose.

Reported per run:
- held-out loss of the exported model after the same tokens (the same steps x 2 workers x 4 x 64), in
  nats per token on the validation split, beside the unigram baseline's on the same tokens;
- training loss at equal wall time: the last logged loss at or before T, where T is the shortest run's
  training time in that scenario (from the step events: DDP's per-step times summed, the family's
  own elapsed clock, both from its first step, start-up excluded);
- tokens/s after the first `--warmup` steps (their tokens / the time from that step's event to the last),
  and its ratio to DDP's in the same scenario and round; every run is repeated for `--rounds` rounds (all
  strategies, both scenarios, in turn) and the table gives the median ratio with each round's, since load
  from other work on the machine moves a single run's figures by up to 2x;
- staleness (mean, max) and updates dropped;
- bytes sent per step: measured for the family (every message counted at the server, through which
  all of them pass); for DDP the ring all-reduce's 2 (W - 1) x weight bytes across all ranks, a formula,
  not a measurement (DeepSpeed's CPU ranks all-reduce through shared memory).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402
from lmforge.components.sections.training import TrainingConfig  # noqa: E402
from lmforge.components.training.protocol import STRAGGLER_ENV  # noqa: E402
from lmforge.components.workspace import Workspace  # noqa: E402
from tests.integration.train_support import make_dataset, run_training  # noqa: E402

STRATEGIES = ("ddp", "ps-sync", "async-sgd", "hogwild", "easgd")
SEQ, MICRO, WORKERS = 64, 4, 2


def training(strategy: str, steps: int, preset: str) -> TrainingConfig:
    return TrainingConfig.model_validate({
        "seed": 0, "num_ranks": WORKERS, "precision": "fp32", "seq_len": SEQ, "micro_batch_size": MICRO,
        "max_steps": steps, "warmup_steps": 3, "save_every": steps, "log_every": 1, "lr": 0.01,
        "model": {"preset": preset},
        "parallel": {"strategy": strategy, "easgd": {"alpha": 0.25, "tau": 4}, "async_sgd": {"max_staleness": 4}}})


def heldout(ws: Workspace, export: Path) -> tuple[float, float]:
    """(the export's, the unigram baseline's) mean nats per validation token (tests/integration/test_train_ps.py)."""
    from tests.integration.test_train_ps import _heldout_nats

    return _heldout_nats(ws, export)


def elapsed(events: list[dict]) -> list[float]:
    """Training seconds at each logged step, from the first step's start."""
    if "ps" in events[0]:
        return [e["ps"]["elapsed_s"] for e in events]
    out, t = [], 0.0
    for e in events:
        t += e["step_s"]
        out.append(t)
    return out


def measure(ws: Workspace, name: str, strategy: str, steps: int, preset: str, warmup: int) -> dict:
    events, run_dir = run_training(ws, name, training(strategy, steps, preset), timeout_s=1500)
    times = elapsed(events)
    export_loss, unigram = heldout(ws, run_dir / "export")
    tokens = steps * WORKERS * MICRO * SEQ
    after = (steps - warmup) * WORKERS * MICRO * SEQ
    out = {"heldout_loss": export_loss, "unigram": unigram, "seconds": times[-1], "tokens": tokens,
           "tokens_per_s": after / (times[-1] - times[warmup - 1]), "times": times, "losses": [e["loss"] for e in events]}
    if strategy == "ddp":
        params = json.loads((run_dir / "export" / "lmforge.json").read_text())["params"]
        out.update(bytes_per_step=2 * (WORKERS - 1) * params * 4, bytes_measured=False, staleness_mean=0.0,
                   staleness_max=0, dropped=0)
    else:
        stats = json.loads((run_dir / "ps_stats.json").read_text())
        out.update(bytes_per_step=stats["bytes_sent_per_step"], bytes_measured=True, staleness_mean=stats["staleness_mean"],
                   staleness_max=stats["staleness_max"], dropped=stats["dropped"], staleness_hist=stats["staleness_hist"])
    return out


def loss_at(run: dict, t: float) -> float:
    seen = [loss for time, loss in zip(run["times"], run["losses"], strict=True) if time <= t + 1e-9]
    return seen[-1] if seen else math.nan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--straggle", type=float, default=0.3, help="seconds rank 1 sleeps each step in the straggler scenario")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="bench_ps_") as tmp:
        ws = Workspace(Path(tmp) / "ws").ensure()
        make_dataset(ws)
        for i in range(args.rounds):
            scenarios: dict[str, dict] = {}
            for scenario, straggle in (("even", None), ("straggler", f"1:{args.straggle}")):
                if straggle:
                    os.environ[STRAGGLER_ENV] = straggle
                else:
                    os.environ.pop(STRAGGLER_ENV, None)
                scenarios[scenario] = {s: measure(ws, f"{scenario}-{s}-{i}", s, args.steps, args.preset, args.warmup)
                                       for s in STRATEGIES}
            os.environ.pop(STRAGGLER_ENV, None)
            for runs in scenarios.values():
                t_equal = min(r["seconds"] for r in runs.values())
                for r in runs.values():
                    r["equal_time_s"], r["loss_at_equal_time"] = t_equal, loss_at(r, t_equal)
                    r["vs_ddp_tokens_per_s"] = r["tokens_per_s"] / runs["ddp"]["tokens_per_s"]
            rounds.append(scenarios)
    rows = []
    for scenario in ("even", "straggler"):
        for s in STRATEGIES:
            runs = [rd[scenario][s] for rd in rounds]
            r = runs[0]
            ratios = [x["vs_ddp_tokens_per_s"] for x in runs]
            rows.append((scenario, s, " / ".join(f"{x['heldout_loss']:.3f}" for x in runs) + f" (unigram {r['unigram']:.3f})",
                         " / ".join(f"{x['loss_at_equal_time']:.3f} at {x['equal_time_s']:.1f} s" for x in runs),
                         f"{statistics.median(x['tokens_per_s'] for x in runs):,.0f}",
                         f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})",
                         " / ".join(f"{x['staleness_mean']:.2f}, {x['staleness_max']}" for x in runs),
                         " / ".join(str(x["dropped"]) for x in runs),
                         f"{r['bytes_per_step'] / 2 ** 20:.2f}{'' if r['bytes_measured'] else ' (formula)'}"))
    results = {"steps": args.steps, "preset": args.preset, "straggle_s": args.straggle, "workers": WORKERS,
               "warmup": args.warmup, "rounds": rounds,
               "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]}}
    write_results("ps", results, ["scenario", "strategy", f"held-out loss after {args.steps} steps (nats/token), by round",
                                  "train loss at equal wall time, by round", "tokens/s (median)", "vs ddp: median (rounds)",
                                  "staleness mean, max by round", "dropped by round", "MiB sent per step"], rows,
                  command="python benchmarks/bench_ps.py" + "".join(f" {a}" for a in sys.argv[1:]))
    print(f"1-min load average: {results['load_average_1min']['start']:.1f} at the start, "
          f"{results['load_average_1min']['end']:.1f} at the end")


if __name__ == "__main__":
    main()
