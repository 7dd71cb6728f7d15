"""Monitoring: whylogs profiling throughput against pandas describe(), the A/A false alarm rate, and power.

    .venv/bin/python benchmarks/bench_monitor.py                       # a few minutes on 2 cores
    .venv/bin/python benchmarks/bench_monitor.py --rows 200000 --windows 1000

1. Profiling: rows/s of a whylogs profile of request-log rows (every column of
   components/serving/requestlog.py but the timestamp) against `DataFrame.describe(include="all")`
   on the same rows, in the same run; ratio = whylogs rows/s / pandas rows/s.
2. Calibration on real prompts: standard-library signatures parsed from this Python's
   stdlib, split by module 80/10/10 (train/validation/test) as the data stage does, and
   featurised as serving does (prompt_chars, prompt_tokens with a BPE tokenizer trained on
   the train split, rare_token_rate against the train split's token counts). The reference
   is the validation split (the default), calibrated by module halves.
   - A/A false alarm rate: share of windows drawn from the test split (modules neither
     training nor the reference saw; what in-distribution traffic is) that the calibrated
     decision calls drift. Target: <= false_alarm_target (0.05).
   - Power: the same windows with prompt_chars moved by +0.5 sd (the reference's sd; only
     that column) called drift. Target: >= 0.90.
   - Baseline: the same two rates with the train split as the reference and A/A splits by
     row, the first design; it shows why the default changed.
Writes benchmarks/results/monitor.json and monitor.md.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402
from lmforge.components.sections.monitoring import MonitoringConfig  # noqa: E402
from lmforge.components.serving.requestlog import COLUMNS  # noqa: E402
from lmforge.monitoring.calibration import calibrate  # noqa: E402
from lmforge.monitoring.drift import DRIFT, decide  # noqa: E402
from lmforge.monitoring.profiles import build_reference, profile, reference_rows  # noqa: E402
from lmforge.monitoring.traffic import _signature  # noqa: E402


def request_rows(n: int, seed: int) -> pd.DataFrame:
    """n request-log rows with realistic value ranges (the schema of components/serving/requestlog.py, minus ts)."""
    rng = np.random.default_rng(seed)
    chars = np.maximum(3, rng.lognormal(3.4, 0.6, n)).astype(int)
    frame = pd.DataFrame({
        "model": "lmforge", "version": rng.choice(["3", "4"], n), "prompt_chars": chars,
        "prompt_tokens": np.maximum(1, chars // 3 + rng.integers(-2, 3, n)), "rare_token_rate": rng.beta(0.5, 20, n),
        "output_tokens": rng.integers(1, 33, n), "output_chars": rng.integers(1, 160, n),
        "mean_logprob": -rng.gamma(2.0, 1.0, n), "latency_ms": rng.gamma(3.0, 40.0, n),
        "status": rng.choice(["ok", "ok", "ok", "ok", "ok", "ok", "ok", "ok", "ok", "prompt_too_long"], n)})
    assert list(frame.columns) == [c for c in COLUMNS if c != "ts"]
    return frame


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def stdlib_signatures() -> dict[str, list[str]]:
    """{module: [signature, ...]} for functions and classes with docstrings, parsed from the stdlib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("test", "idlelib", "site-packages", "lib2to3") or "tests" in rel.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        sigs = [s for n in ast.walk(tree) if (s := _signature(n)) and ast.get_docstring(n)]
        if sigs:
            out[".".join(rel.with_suffix("").parts)] = sigs
    return out


def serving_features(train_texts: list[str], vocab: int, min_count: int):
    """A BPE tokenizer trained on the train signatures, and the featuriser serving uses with it."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from lmforge.monitoring.served import serving_featurizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(train_texts, vocab_size=vocab, min_frequency=2,
                            special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bpe.to_str()), pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")
    folder = Path(__import__("tempfile").mkdtemp(prefix="lmforge-bench-monitor-tok-"))
    tok.save_pretrained(folder)
    counts = np.bincount(np.concatenate([np.asarray(i, dtype=np.int64) for i in tok(train_texts)["input_ids"]]),
                         minlength=len(tok))
    rare = frozenset(int(i) for i in np.nonzero(counts < min_count)[0])
    return serving_featurizer(folder, rare)


def window_rate(rows: pd.DataFrame, ref, cal, cfg: MonitoringConfig, *, windows: int, n: int, seed: int,
                shift: dict[str, float] | None = None) -> float:
    rng = np.random.default_rng(seed)
    watched = rows[list(cfg.columns)]
    hits = 0
    for _ in range(windows):
        w = watched.iloc[rng.integers(0, len(watched), size=n)].copy()
        for column, delta in (shift or {}).items():
            w[column] = w[column] + delta
        hits += decide(profile(w), ref.view, cal, cfg).status == DRIFT
    return hits / windows


def rates(reference: pd.DataFrame, test: pd.DataFrame, cfg: MonitoringConfig, args) -> dict:
    start = time.perf_counter()
    ref = build_reference(reference, cfg)
    cal = calibrate(ref.rows, args.window_rows, cfg)
    seconds = time.perf_counter() - start
    sd = float(reference["prompt_chars"].std())
    aa = window_rate(test, ref, cal, cfg, windows=args.windows, n=args.window_rows, seed=1)
    power = window_rate(test, ref, cal, cfg, windows=args.windows, n=args.window_rows, seed=2,
                        shift={"prompt_chars": 0.5 * sd})
    ci = 1.96 * np.sqrt(aa * (1 - aa) / args.windows)
    return {"calibration": {**cal.to_dict(), "seconds": seconds}, "aa_false_alarm_rate": aa,
            "aa_ci95": [max(0.0, aa - ci), aa + ci], "power_half_sd_prompt_chars": power, "prompt_chars_sd": sd,
            "reference_rows": len(ref.rows), "reference_modules": int(ref.rows["module"].nunique())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100_000, help="rows for the profiling throughput")
    ap.add_argument("--windows", type=int, default=400, help="windows per rate")
    ap.add_argument("--window-rows", type=int, default=100, help="requests per window (demo min_rows)")
    args = ap.parse_args()
    command = "python benchmarks/bench_monitor.py " + " ".join(sys.argv[1:])

    # 1. profiling throughput
    frame = request_rows(args.rows, seed=0)
    profile(frame.head(1000))   # warm up whylogs' imports and sketches
    t_whylogs = best_of(lambda: profile(frame), 3)
    t_pandas = best_of(lambda: frame.describe(include="all"), 3)
    whylogs_rps, pandas_rps = args.rows / t_whylogs, args.rows / t_pandas

    # 2. calibration on real prompts, split by module as the data stage splits
    by_module = stdlib_signatures()
    bucket = {m: int(hashlib.sha256(m.encode()).hexdigest(), 16) % 10 for m in by_module}
    split = {name: [m for m in by_module if keep(bucket[m])] for name, keep in
             (("train", lambda b: b >= 2), ("validation", lambda b: b == 0), ("test", lambda b: b == 1))}
    featurize = serving_features([s for m in split["train"] for s in by_module[m]], vocab=4096, min_count=2)

    def rows_of(name: str) -> pd.DataFrame:
        mods = split[name]
        return reference_rows([s for m in mods for s in by_module[m]], featurize,
                              [m for m in mods for _ in by_module[m]])

    train, validation, test = rows_of("train"), rows_of("validation"), rows_of("test")
    cfg = MonitoringConfig(min_rows=args.window_rows)
    default = rates(validation, test, cfg, args)
    baseline = rates(train, test, MonitoringConfig(min_rows=args.window_rows, reference_split="train",
                                                   calibration_by="row"), args)

    results = {
        "profiling": {"rows": args.rows, "whylogs_seconds": t_whylogs, "pandas_describe_seconds": t_pandas,
                      "whylogs_rows_per_s": whylogs_rps, "pandas_rows_per_s": pandas_rps,
                      "ratio_whylogs_over_pandas": whylogs_rps / pandas_rps},
        "corpus": {name: {"modules": len(split[name]), "rows": len(r)}
                   for name, r in (("train", train), ("validation", validation), ("test", test))},
        "default_validation_reference_by_module": default, "baseline_train_reference_by_row": baseline,
        "target": cfg.false_alarm_target, "power_target": 0.9, "windows": args.windows, "window_rows": args.window_rows,
    }

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    d, b = default, baseline
    table = [
        ("profiling throughput, whylogs (request-log schema)", f"{whylogs_rps:,.0f} rows/s", ""),
        ("profiling throughput, pandas describe(include='all')", f"{pandas_rps:,.0f} rows/s", ""),
        ("ratio whylogs / pandas", f"{whylogs_rps / pandas_rps:.2f}x", f"{args.rows:,} rows, best of 3"),
        ("calibration (A/A bootstrap, by module)", f"{d['calibration']['splits']} splits, "
         f"{d['calibration']['seconds']:.1f} s", f"in-sample rate {d['calibration']['false_alarm_rate']:.3f}"),
        ("A/A false alarm rate (test-split windows vs validation reference)",
         f"{d['aa_false_alarm_rate']:.3f} (95% CI {d['aa_ci95'][0]:.3f}-{d['aa_ci95'][1]:.3f})",
         f"target <= {cfg.false_alarm_target}: {verdict(d['aa_false_alarm_rate'] <= cfg.false_alarm_target)}"),
        ("power, +0.5 sd prompt_chars", f"{d['power_half_sd_prompt_chars']:.3f}",
         f"target >= 0.90: {verdict(d['power_half_sd_prompt_chars'] >= 0.9)}"),
        ("baseline: train reference, A/A by row: false alarm rate", f"{b['aa_false_alarm_rate']:.3f}",
         f"power {b['power_half_sd_prompt_chars']:.3f}"),
        ("windows", f"{args.windows} x {args.window_rows} requests",
         f"validation {len(validation)} prompts / {len(split['validation'])} modules; test {len(test)} / "
         f"{len(split['test'])}"),
    ]
    write_results("monitor", results, ["measure", "value", "note"], table, command=command)


if __name__ == "__main__":
    main()
