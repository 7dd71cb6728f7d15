"""Batched against one-at-a-time generation throughput, in one run, with evaluation's generator.

    .venv/bin/python benchmarks/bench_eval.py                       # ~1-2 min on 2 cores
    .venv/bin/python benchmarks/bench_eval.py --model-dir .lmforge/runs/<run>/export --batch-sizes 1 4 16

The model is a demo-sized LlamaForCausalLM (hidden 256, 4 layers, MLP 512, vocab 4096,
~5M parameters, random weights) with a byte-level BPE tokenizer trained here on
standard-library docstrings, unless --model-dir names a trained export. Prompts are
`generation_prompt(signature)` for standard-library signatures. Each prompt generates
up to --new-tokens tokens (no stop string; only eos ends a row early), greedy, through
components/evaluation/timed_generation.py's KV-cache loop with left padding. Throughput =
generated tokens / wall time; each configuration runs twice and the faster run is kept,
so a burst of background load on the shared machine does not decide the ratio. One torch
thread by default, as the demo config evaluates (--threads to change it).
Writes benchmarks/results/eval.json and eval.md.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402
from lmforge.components.evaluation.timed_generation import generate  # noqa: E402
from lmforge.components.registry.loading import load_causal_lm  # noqa: E402
from lmforge.components.serving.records import generation_prompt  # noqa: E402
from lmforge.components.serving.task import Task  # noqa: E402

# The prompts are already templated (generation_prompt): encoded as given, with no stop string, every row
# generates its whole new-token budget, so the timings compare like with like.
NO_STOP = Task("completion")

MODULES = ["json/__init__.py", "textwrap.py", "shutil.py", "pathlib.py", "argparse.py", "inspect.py", "typing.py"]


def stdlib_functions() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for rel in MODULES:
        for node in ast.walk(ast.parse((root / rel).read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and (doc := ast.get_docstring(node)):
                out.append((f"def {node.name}({ast.unparse(node.args)})", doc))
    return out


def build_model(out: Path, docs: list[str]) -> Path:
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=4096, min_frequency=2, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bpe.to_str()), pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (as [evaluation] threads in demo.toml)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert args.batch_sizes[0] == 1, "the baseline (first batch size) is one prompt at a time"

    funcs = stdlib_functions()
    prompts = [generation_prompt(sig) for sig, _ in funcs[: args.prompts]]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_model(Path(tmp) / "model", [d for _, d in funcs])
        model, tok = load_causal_lm(model_dir)
        params = sum(p.numel() for p in model.parameters())
        kw = dict(max_new_tokens=args.new_tokens, max_prompt_tokens=256)
        generate(model, tok, prompts[:4], NO_STOP, batch_size=4, **kw)  # warm-up: allocator, kernels
        measured = {}
        for bs in args.batch_sizes:
            best = None
            for _ in range(2):
                gens, wall = generate(model, tok, prompts, NO_STOP, batch_size=bs, **kw)
                tokens = sum(g.tokens for g in gens)
                run = {"batch_size": bs, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                       "ttft_ms": 1000 * sum(g.timing.ttft_s for g in gens) / len(gens),
                       "tpot_ms": 1000 * sum(g.timing.tpot_s or 0 for g in gens) / len(gens)}
                if best is None or run["tokens_per_s"] > best["tokens_per_s"]:
                    best = run
            measured[bs] = best
            print(f"batch {bs}: {best['tokens_per_s']:.1f} tokens/s", flush=True)

    base = measured[1]["tokens_per_s"]
    rows = [(bs, m["tokens"], f"{m['wall_s']:.2f}", f"{m['tokens_per_s']:.1f}", f"{m['tokens_per_s'] / base:.2f}x",
             f"{m['ttft_ms']:.1f}", f"{m['tpot_ms']:.2f}") for bs, m in measured.items()]
    results = {"model": str(args.model_dir or "random demo-sized Llama"), "parameters": params,
               "prompts": len(prompts), "new_tokens": args.new_tokens, "torch_threads": torch.get_num_threads(),
               "load_average_at_end": os.getloadavg(), "runs": measured,
               "speedup": {bs: m["tokens_per_s"] / base for bs, m in measured.items()}}
    write_results("eval", results, ["batch size", "tokens", "wall s", "tokens/s", "vs batch 1", "TTFT ms", "TPOT ms"],
                  rows, command=" ".join(["python benchmarks/bench_eval.py", *sys.argv[1:]]))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
