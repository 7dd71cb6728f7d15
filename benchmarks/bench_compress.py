"""Compression variants against their parent, in one run: CPU generation speed, weight size, BPC.

    .venv/bin/python benchmarks/bench_compress.py                 # ~4-6 min on 2 cores
    .venv/bin/python benchmarks/bench_compress.py --train-steps 300 --hidden 512

The parent is a LlamaForCausalLM (hidden 384, 6 layers, MLP 1024, vocab 4096 by default,
~14M parameters) trained briefly here from scratch, in bf16 autocast with the
compression fine-tune loop, on standard-library docstrings (a byte-level BPE tokenizer
trained on the same text); held-out text comes from modules it never saw. A brief
training matters: on random weights every variant's BPC is the uniform one and the
quality column would say nothing.

Variants (built with components/compression, loaded with `load_variant`):
- int8: dynamic int8 quantization of every Linear. Targets: >= 1.5x generation
  tokens/s, >= 3.5x smaller Linear weights, <= 3% BPC increase.
- lowrank50: truncated SVD with a budget of 50% of the Linear parameters (attention and
  MLP projections). Reported: the BPC change.
- distill-half: a student with half the layers, initialised from the teacher's and
  distilled (KL at T=2 plus CE). Reported: the BPC change.
- bf16: the cast, for reference.

Generation: greedy, batch 1, `--new-tokens` tokens per prompt (no stop string), over
`--prompts` signature prompts, with evaluation's KV-cache loop; tokens/s = generated
tokens / wall time, TTFT = mean time to the first token. Each model is timed twice and
the faster run kept, so a background burst on the shared machine penalises no one.
Writes benchmarks/results/compress.json and compress.md.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402
from lmforge.components.compression.build import build_variant  # noqa: E402
from lmforge.components.compression.finetune import Finetuner  # noqa: E402
from lmforge.components.compression.modules import count_params, linear_weight_bytes  # noqa: E402
from lmforge.components.compression.variant import load_variant  # noqa: E402
from lmforge.components.data.shards import write_shards  # noqa: E402
from lmforge.components.evaluation.bpc import bits_per_character  # noqa: E402
from lmforge.components.evaluation.timed_generation import generate  # noqa: E402
from lmforge.components.sections.compression import CompressionConfig, FinetuneConfig  # noqa: E402
from lmforge.components.serving.records import Record, generation_prompt  # noqa: E402
from lmforge.components.serving.task import Task  # noqa: E402

# The prompts are already templated (generation_prompt): encoded as given, with no stop string, every row
# generates its whole new-token budget, so the timings compare like with like.
NO_STOP = Task("completion")

MODULES = ["argparse", "ast", "asyncio.base_events", "calendar", "collections", "configparser", "csv", "dataclasses",
           "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "ftplib", "functools", "gettext",
           "glob", "gzip", "heapq", "http.client", "imaplib", "inspect", "ipaddress", "json.decoder", "logging",
           "mailbox", "pathlib", "pickle", "pprint", "pydoc", "random", "shutil", "smtplib", "socket", "statistics",
           "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tkinter", "turtle", "typing",
           "unittest.case", "urllib.parse", "urllib.request", "uuid", "zipfile", "zoneinfo._zoneinfo", "xml.dom.minidom",
           "optparse", "doctest", "locale", "nntplib", "poplib", "sched", "selectors", "ssl", "tracemalloc", "wave"]
HELDOUT = {"statistics", "textwrap", "zipfile", "uuid", "wave", "sched"}


def stdlib_records() -> list[Record]:
    out = []
    lib = Path(sysconfig.get_paths()["stdlib"])
    for mod in MODULES:
        spec = importlib.util.find_spec(mod) if "." not in mod else None
        path = Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".py") else \
            lib / (mod.replace(".", "/") + ".py")
        if not path.is_file():
            path = lib / mod.replace(".", "/") / "__init__.py"
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (doc := ast.get_docstring(node)):
                out.append(Record.from_parts(source="stdlib", module=mod, qualname=node.name,
                                             signature=f"def {node.name}({ast.unparse(node.args)})", docstring=doc))
    return out


def build_parent(out: Path, args: argparse.Namespace, train: list[Record], shards: Path) -> tuple[Path, float]:
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([r.text for r in train], vocab_size=args.vocab, min_frequency=2,
                            special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bpe.to_str()), pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")
    docs = [tok(r.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in train]
    write_shards(shards, {"train": docs}, vocab_size=len(tok))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.mlp,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=args.hidden // 64, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    tuner = Finetuner(FinetuneConfig(seq_len=128, batch_size=8, lr=1e-3, bf16=True), shard_dir=shards, seed=0)
    start = time.perf_counter()
    losses = tuner.run(model, steps=args.train_steps)
    seconds = time.perf_counter() - start
    print(f"parent: {count_params(model):,} params, {args.train_steps} steps in {seconds:.0f} s, "
          f"loss {losses[0]:.2f} -> {losses[-1]:.2f}", flush=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "lmforge.json").write_text(json.dumps({"source": "benchmarks/bench_compress.py", "train_steps": args.train_steps,
                                                  "final_loss": losses[-1]}))
    return out, seconds


def quality(model, tok, model_dir: Path, heldout: list[Record], args: argparse.Namespace) -> dict[str, float]:
    b = bits_per_character(model, tok, [r.text for r in heldout[: args.bpc_docs]], start_id=tok.eos_token_id,
                           context_length=256, batch_size=8)
    return {"bpc": b.bpc, "params": count_params(model), "linear_weight_bytes": linear_weight_bytes(model),
            "disk_bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))}


def speed(model, tok, prompts: list[str], args: argparse.Namespace) -> dict[str, float]:
    gens, wall = generate(model, tok, prompts, NO_STOP, max_new_tokens=args.new_tokens, batch_size=1,
                          max_prompt_tokens=128)
    tokens = sum(g.tokens for g in gens)
    return {"tokens_per_s": tokens / wall, "ttft_ms": 1000 * sum(g.timing.ttft_s for g in gens) / len(gens),
            "generated_tokens": tokens}


def measure_all(dirs: dict[str, Path], heldout: list[Record], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Quality once per model; speed in `rounds` interleaved rounds, keeping each model's fastest."""
    from transformers import AutoTokenizer

    models = {label: (load_variant(d), AutoTokenizer.from_pretrained(str(d))) for label, d in dirs.items()}
    out = {label: quality(m, tok, dirs[label], heldout, args) for label, (m, tok) in models.items()}
    prompts = [generation_prompt(r.signature) for r in heldout[: args.prompts]]
    for r in range(args.rounds):
        for label, (m, tok) in models.items():
            run = speed(m, tok, prompts, args)
            out[label].setdefault("rounds_tokens_per_s", []).append(round(run["tokens_per_s"], 2))
            if run["tokens_per_s"] > out[label].get("tokens_per_s", 0.0):
                out[label].update(run)
        print(f"speed round {r + 1}/{args.rounds}: " +
              ", ".join(f"{k} {v['rounds_tokens_per_s'][-1]}" for k, v in out.items()), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--mlp", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--distill-steps", type=int, default=60)
    p.add_argument("--bpc-docs", type=int, default=120)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds; each model keeps its fastest")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/bench_compress.py " + " ".join(sys.argv[1:])

    records = stdlib_records()
    train = [r for r in records if r.module not in HELDOUT]
    heldout = sorted((r for r in records if r.module in HELDOUT), key=lambda r: r.id)
    print(f"{len(train)} train docs, {len(heldout)} held-out docs", flush=True)
    cfg = CompressionConfig.model_validate({
        "finetune": {"seq_len": 128, "batch_size": 8, "lr": 3e-4, "bf16": True},
        "lowrank": {"mode": "budget", "param_budget": 0.5},
        "distill": {"num_layers": args.layers // 2, "steps": args.distill_steps, "temperature": 2.0, "alpha": 0.5},
    })
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        parent, train_s = build_parent(root / "parent", args, train, root / "shards")
        variants = {"int8": "int8", "bf16": "bf16", "lowrank50": "lowrank", "distill-half": "distill"}
        dirs, build_s = {"parent": parent}, {}
        for label, name in variants.items():
            start = time.perf_counter()
            dirs[label] = build_variant(name, parent, root / label, cfg, shard_dir=root / "shards")
            build_s[label] = round(time.perf_counter() - start, 1)
            print(f"built {label} in {build_s[label]} s", flush=True)
        results = measure_all(dirs, heldout, args)

    base = results["parent"]
    rows = []
    for label, m in results.items():
        m["speedup"] = m["tokens_per_s"] / base["tokens_per_s"]
        m["linear_shrink"] = base["linear_weight_bytes"] / m["linear_weight_bytes"]
        m["bpc_change_pct"] = 100 * (m["bpc"] / base["bpc"] - 1)
        rows.append((label, f"{m['params']:,}", f"{m['disk_bytes'] / 1e6:.1f}", f"{m['linear_weight_bytes'] / 1e6:.2f}",
                     f"{m['linear_shrink']:.2f}x", f"{m['tokens_per_s']:.1f}", f"{m['speedup']:.2f}x",
                     f"{m['ttft_ms']:.1f}", f"{m['bpc']:.4f}", f"{m['bpc_change_pct']:+.2f}%", build_s.get(label, "-")))
    i8 = results["int8"]
    targets = {
        "int8_speedup>=1.5": {"value": round(i8["speedup"], 3), "met": i8["speedup"] >= 1.5},
        "int8_linear_shrink>=3.5": {"value": round(i8["linear_shrink"], 3), "met": i8["linear_shrink"] >= 3.5},
        "int8_bpc_increase<=3%": {"value": round(i8["bpc_change_pct"], 3), "met": i8["bpc_change_pct"] <= 3.0},
        "lowrank50_bpc_change_pct": {"value": round(results["lowrank50"]["bpc_change_pct"], 3), "met": None},
        "distill_half_bpc_change_pct": {"value": round(results["distill-half"]["bpc_change_pct"], 3), "met": None},
    }
    for k, v in targets.items():
        print(f"{k}: {v['value']} " + ("" if v["met"] is None else ("MET" if v["met"] else "MISSED")))
    write_results("compress", {"results": results, "targets": targets, "parent_train_seconds": round(train_s, 1),
                               "build_seconds": build_s, "threads": torch.get_num_threads(), "args": vars(args),
                               "parent": "trained here briefly (see args.train_steps), not random"},
                  ["variant", "params", "disk MB", "Linear MB", "Linear shrink", "tok/s (batch 1)", "speedup",
                   "TTFT ms", "BPC", "ΔBPC", "build s"], rows, command=command)


if __name__ == "__main__":
    main()
