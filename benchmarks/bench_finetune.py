"""Fine-tuning a base: lmforge's SFT + LoRA against a plain PyTorch + peft loop, and memory of full vs LoRA, in one run.

    python benchmarks/bench_finetune.py                  # writes benchmarks/results/finetune.{json,md}
    python benchmarks/bench_finetune.py --steps 20

The base is made here (nothing downloaded): a Llama shaped like the demo preset (hidden 256,
4 layers, grouped-query attention 8/4 heads) with a 2,048-token byte-level BPE, saved with
save_pretrained. The data is the built-in corpus's signature -> summary pairs (standard-library
docstrings), tokenised as SFT examples by lmforge's own code (components/training/sft.py).

Measured, same model, precision (what `auto` picks here, reported), examples and batch (16
rows a step):
- a plain loop: one process, every core, peft LoRA r=8 on q_proj/v_proj, AdamW on the adapters,
  bf16 autocast when the precision is bf16; once with padded rows and once with packed rows, so
  the batching `auto` chooses is checked against the one that really is faster;
- lmforge: `training.objective = "sft"`, `training.lora.r = 8`, ZeRO-2 on 2 ranks through the real
  launcher (8 rows each), the batching `auto` chose;
- lmforge full fine-tuning (lora.r = 0), same layout: per-rank model-state bytes and peak RSS,
  against LoRA's.
Throughput is real (non-padding) tokens per second, the median over the steps after `--warmup`
(lmforge logs every 4 steps: a logged step waits for every rank). The plain loop (in the
batching `auto` chose) and lmforge's LoRA run alternate for `--rounds` pairs; the headline ratio
is the median of the pairs' ratios, so that load from other work on the machine falls on both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402
from lmforge.components.data.shards import write_shards  # noqa: E402
from lmforge.components.model.adapters import adapter_targets, add_adapters  # noqa: E402
from lmforge.components.model.basemodel import copy_tokenizer  # noqa: E402
from lmforge.components.runtime.accelerator import autocast, choose_precision, to_device  # noqa: E402
from lmforge.components.sections.training import TrainingConfig  # noqa: E402
from lmforge.components.training.pipeline_model import lm_loss  # noqa: E402
from lmforge.components.training.sft import SftBatches, choose_batching, write_examples  # noqa: E402
from lmforge.components.workspace import Workspace, atomic_write_json  # noqa: E402
from tests.checkpoints import train_tokenizer  # noqa: E402
from tests.integration.train_support import run_training, stdlib_records  # noqa: E402

ROWS, SEQ, R = 16, 128, 8
LOG_EVERY = 4  # a logged step waits for every rank (loss all-reduce, memory gather); steps between logs do not
VERSION = "finetune0001"


def make_base(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_tokenizer(vocab_size=2048)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def make_dataset(ws: Workspace, base: Path) -> Path:
    """A dataset as the data stage leaves it for a base: its tokenizer, records and shards."""
    from transformers import AutoTokenizer

    d = ws.dataset_dir(VERSION)
    copy_tokenizer(base, d / "tokenizer")
    records = stdlib_records(limit=2000)
    (d / "records").mkdir(parents=True, exist_ok=True)
    (d / "records" / "train.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    tok = AutoTokenizer.from_pretrained(base)
    ids = [tok(r.text)["input_ids"] + [tok.eos_token_id] for r in records]
    write_shards(d / "shards", {"train": ids, "validation": ids[:10]}, vocab_size=len(tok))
    atomic_write_json(d / "manifest.json", {"version": VERSION, "vocab_size": len(tok)})
    ws.set_latest_dataset(VERSION)
    return d


def lmforge_cfg(base: Path, steps: int, *, r: int, precision: str) -> TrainingConfig:
    return TrainingConfig.model_validate({
        "model": {"init": str(base)}, "objective": "sft", "lora": {"r": r}, "seq_len": SEQ, "micro_batch_size": ROWS // 2,
        "max_steps": steps, "warmup_steps": 2, "save_every": 10 ** 6, "precision": precision, "lr": 1e-3,
        "parallel": {"strategy": "zero2"}, "num_ranks": 2, "log_every": LOG_EVERY})


def plain_loop(base: Path, sft_dir: Path, *, batching: str, steps: int, warmup: int, precision) -> list[float]:
    """Real tokens/s per step after `warmup` of a one-process PyTorch + peft LoRA loop over lmforge's SFT batches."""
    from transformers import AutoModelForCausalLM

    dev = torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.config.use_cache = False
    chosen = adapter_targets(model, r=R, targets=["q_proj", "v_proj"], field="lora", where=base)
    model = add_adapters(model, chosen, r=R, alpha=16, dropout=0.0).to(dev)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)
    batches = SftBatches.open(sft_dir, seq_len=SEQ, seed=0, batching=batching, pad_id=2)  # type: ignore[arg-type]
    rates = []
    for step in range(steps):
        t0 = time.perf_counter()
        (inputs, labels), = batches.micro_batches(step, dp_rank=0, dp_size=1, micro=ROWS, accum=1)
        inputs, labels = {k: to_device(v, dev) for k, v in inputs.items()}, to_device(labels, dev)
        with autocast(dev, precision):
            loss = lm_loss(model(**inputs, use_cache=False).logits, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            rates.append(batches.real_tokens(step, dp_size=1, micro=ROWS, accum=1) / (time.perf_counter() - t0))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="alternating plain / lmforge LoRA pairs; the ratio is their median")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    precision = choose_precision("auto", "cpu")  # what lmforge's runs below resolve to
    print(f"precision: {precision.name} ({precision.reason})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        ws = Workspace(Path(tmp) / "ws").ensure()
        base = make_base(Path(tmp) / "base")
        dataset = make_dataset(ws, base)
        from transformers import AutoTokenizer

        sft_dir = Path(tmp) / "sft"
        made = write_examples(dataset / "records" / "train.jsonl", AutoTokenizer.from_pretrained(base), sft_dir, seq_len=SEQ)
        auto, why = choose_batching(sft_dir, setting="auto", seq_len=SEQ, micro=ROWS // 2, seed=0)
        print(made.summary(), f"; auto batching: {auto} ({why})", flush=True)

        def plain_run(batching: str) -> float:
            return statistics.median(plain_loop(base, sft_dir, batching=batching, steps=args.steps, warmup=args.warmup,
                                                precision=precision))

        def lmforge_run(name: str, r: int) -> dict:
            events, _ = run_training(ws, name, lmforge_cfg(base, args.steps, r=r, precision=precision.name),
                                     version=VERSION, timeout_s=1200)
            timed = [e for e in events if e["step"] > args.warmup]  # each event: tokens/s over the steps since the last
            return {"tokens_per_s": statistics.median(e["tokens_per_s"] for e in timed),
                    "model_state_mb": [m["total"] / 2 ** 20 for m in events[-1]["memory"]],
                    "peak_rss_mb": [max(e["memory"][i]["rss"] for e in events) / 2 ** 20 for i in range(2)]}

        other = "pad" if auto == "pack" else "pack"
        plain = {other: plain_run(other)}
        # Baseline and lmforge alternate, so that load from other processes on a shared machine falls on both.
        pairs = []
        for i in range(args.rounds):
            p = plain_run(auto)
            lora = lmforge_run(f"bench-lora-{i}", R)
            pairs.append({"plain": p, "lmforge": lora["tokens_per_s"], "ratio": lora["tokens_per_s"] / p})
            print(pairs[-1], flush=True)
        plain[auto] = statistics.median(x["plain"] for x in pairs)
        full = lmforge_run("bench-full", 0)
        print({"full": full}, flush=True)
    faster = max(plain, key=lambda b: plain[b])
    ratio = statistics.median(x["ratio"] for x in pairs)
    lora_tps = statistics.median(x["lmforge"] for x in pairs)
    runs = {"lora": {**lora, "tokens_per_s": lora_tps}, "full": full}
    results = {"precision": precision.to_dict(), "examples": made.__dict__, "auto_batching": auto, "auto_reason": why,
               "plain_tokens_per_s": plain, "measured_faster_batching": faster, "rounds": pairs,
               "lmforge": runs, "lora_vs_plain": ratio, "steps": args.steps, "warmup": args.warmup}
    baseline = plain[auto]
    rows = [
        ("plain PyTorch + peft, 1 process, padded rows", f"{plain['pad']:,.0f}", "", "", ""),
        ("plain PyTorch + peft, 1 process, packed rows", f"{plain['pack']:,.0f}", "", "", ""),
        (f"lmforge SFT + LoRA r={R}, ZeRO-2, 2 ranks ({auto})", f"{lora_tps:,.0f}",
         f"{ratio:.2f} (rounds: {', '.join(format(x['ratio'], '.2f') for x in pairs)})",
         " / ".join(f"{x:.1f}" for x in lora["model_state_mb"]), " / ".join(f"{x:.0f}" for x in lora["peak_rss_mb"])),
        (f"lmforge SFT full, ZeRO-2, 2 ranks ({auto})", f"{full['tokens_per_s']:,.0f}",
         f"{full['tokens_per_s'] / baseline:.2f}",
         " / ".join(f"{x:.1f}" for x in full["model_state_mb"]), " / ".join(f"{x:.0f}" for x in full["peak_rss_mb"])),
    ]
    write_results("finetune", results, ["run", "real tokens/s", "vs plain LoRA", "model states MB per rank",
                                        "peak RSS MB per rank"], rows,
                  command="python " + " ".join(["benchmarks/bench_finetune.py", *sys.argv[1:]]))
    print(f"auto chose {auto}; measured faster in the plain loop: {faster}")


if __name__ == "__main__":
    main()
