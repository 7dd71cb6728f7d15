"""Evaluate one model folder on one dataset: the entry point other stages call.

    result = evaluate_model_dir(ws.run_dir(run) / "export", ws.dataset_dir(v), cfg.evaluation)   # the model's task
    result.metrics["bpc"], result.metrics["rougeL"], result.metrics["tokens_per_s"]
    result.examples[0].prediction
    result.to_dict()                       # JSON-able; EvalResult.from_dict reads it back

Metrics (all floats): bpc, perplexity (bpc.py, on up to `bpc_max_docs` documents of the
split), unigram_bpc (the trivial baseline of baseline.py, on the same tokens),
rouge1/rouge2/rougeL/bleu/exact_match (text_metrics.py, on up to `max_examples` held-out
prompt→reference examples of the task; `gen_examples` says how many were scored),
ttft_ms/tpot_ms/tokens_per_s (latency.py). The task (components/serving/task.py) is the one saved with
the model (its lmforge.json), or for a folder that records none (a base model) `default_task`, else
the one the dataset implies: it renders the prompts,
stops the generations and says what of each is scored. A split whose records give the task no
reference scores no generation and says so in `info["generation"]`. With `rag` (a `rag.Rag` or
a prompt→prompt callable), the generation task runs again on retrieval-augmented prompts (string
prompts only); `result.rag` holds those scores and the difference, or why RAG was skipped.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.evaluation import benchmarks
from lmforge.components.evaluation.baseline import UnigramModel
from lmforge.components.evaluation.bpc import bits_per_character
from lmforge.components.evaluation.latency import summarize
from lmforge.components.evaluation.rag import Rag, held, store_busy
from lmforge.components.evaluation.text_metrics import score_texts
from lmforge.components.evaluation.timed_generation import generate
from lmforge.components.registry.loading import load_causal_lm
from lmforge.components.sections.evaluation import EvaluationConfig
from lmforge.components.serving.records import Record
from lmforge.components.serving.task import Task, TaskError, infer_kind

GEN_METRICS = ("rouge1", "rouge2", "rougeL", "bleu", "exact_match")


@dataclass(frozen=True)
class Example:
    id: str
    prompt: str
    reference: str
    prediction: str
    rougeL: float
    rouge1: float
    tokens: int
    rag_prediction: str | None = None
    rag_rougeL: float | None = None


@dataclass
class EvalResult:
    metrics: dict[str, float]
    examples: list[Example]
    rag: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"metrics": self.metrics, "examples": [asdict(e) for e in self.examples], "rag": self.rag, "info": self.info}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EvalResult":
        return cls(metrics=dict(d["metrics"]), examples=[Example(**e) for e in d["examples"]],
                   rag=dict(d.get("rag", {})), info=dict(d.get("info", {})))


def read_split(dataset_dir: Path, split: str) -> list[Record]:
    path = Path(dataset_dir) / "records" / f"{split}.jsonl"
    if not path.is_file():
        raise UserError("dataset", dataset_dir, f"has no records/{split}.jsonl", "Run the data stage first: lmforge run data")
    with open(path, encoding="utf-8") as f:
        records = [Record.from_dict(json.loads(line)) for line in f if line.strip()]
    return sorted(records, key=lambda r: r.id)


def evaluate_model_dir(model_dir: Path, dataset_dir: Path, cfg: EvaluationConfig, *,
                       rag: Rag | Callable[[str], str] | None = None, default_task: Task | None = None) -> EvalResult:
    import torch

    from lmforge.components.runtime.accelerator import runnable_device

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    heldout = read_split(dataset_dir, cfg.split)
    if not heldout:
        raise UserError("dataset", dataset_dir, f"has an empty {cfg.split} split",
                        "Use more documents (data.max_docs) or another split")
    train = read_split(dataset_dir, "train")
    task = Task.load(model_dir, default=default_task or Task(infer_kind(train + heldout)))
    suites = None
    if cfg.benchmarks.tasks:   # every benchmark task's data is checked before the model loads
        held = benchmarks.HeldOut(Path(dataset_dir), cfg.split, task, seed=cfg.seed)
        suites = benchmarks.check_tasks(cfg.benchmarks, held.metadata(Path(model_dir)))
    model, tokenizer = load_causal_lm(Path(model_dir))
    # BPC, generation and latency all run where the model is: the GPU when there is one, unless the
    # folder is an int8 variant, whose kernels are CPU-only. In fp32 on every device, so that the
    # gate compares scores taken on different machines.
    where = runnable_device(model)
    device = where.device
    model.to(device)
    start_id = tokenizer.eos_token_id
    assert start_id is not None, "the tokenizer defines an eos token"
    context, trained = scored_context(Path(model_dir), cfg, model.config)
    rng = random.Random(cfg.seed)

    bpc_docs = sample_records(heldout, cfg.bpc_max_docs, rng)
    texts = [r.text for r in bpc_docs]
    b = bits_per_character(model, tokenizer, texts, start_id=start_id, context_length=context, batch_size=cfg.bpc_batch_size,
                           device=device)
    unigram_bpc = UnigramModel.fit(tokenizer, [r.text for r in train]).bits_per_character(tokenizer, texts)

    examples = task_examples(heldout, task, cfg.max_examples, rng)
    prompts, refs = [p for _, p, _ in examples], [ref for _, _, ref in examples]
    gen_kwargs = dict(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                      max_prompt_tokens=max(1, context - cfg.max_new_tokens), temperature=cfg.temperature, seed=cfg.seed)
    try:
        gens, wall = generate(model, tokenizer, prompts, task, **gen_kwargs)
    except TaskError as e:
        raise UserError("task", task.kind, str(e)) from e
    preds = [task.scored(g.text) for g in gens]
    scores = score_texts(preds, refs)
    latency = summarize([g.timing for g in gens], wall_s=wall)   # NaN (not logged) when nothing was generated

    metrics = {"bpc": b.bpc, "perplexity": b.perplexity, "unigram_bpc": unigram_bpc,
               **scores.metrics(), **latency, "gen_examples": float(len(gens)),
               "eval_tokens": float(b.tokens), "eval_chars": float(b.chars)}
    rag_info, rag_preds, rag_pairs = _run_rag(rag, model, tokenizer, prompts, refs, task, gen_kwargs, scores.metrics())
    metrics.update({f"rag_{k}": v for k, v in rag_info.get("metrics", {}).items()})
    metrics.update({f"rag_delta_{k}": v for k, v in rag_info.get("delta", {}).items()})
    suite = benchmarks.on_model(model, tokenizer, cfg.benchmarks, suites) if suites is not None else None
    metrics.update(suite.metrics if suite else {})

    out = [Example(id=r.id, prompt=task.prompt_as_text(p), reference=ref, prediction=pred, rougeL=s["rougeL"],
                   rouge1=s["rouge1"], tokens=g.tokens, rag_prediction=rag_preds[i] if rag_preds else None,
                   rag_rougeL=rag_pairs[i]["rougeL"] if rag_pairs else None)
           for i, ((r, p, ref), pred, s, g) in enumerate(zip(examples, preds, scores.per_pair, gens))]
    info = {"model_dir": str(model_dir), "dataset_dir": str(dataset_dir), "split": cfg.split, "bpc_docs": b.docs,
            "examples": len(out), "task": task.to_dict(),
            "generation": "ok" if out else f"no record of the {cfg.split} split gives the {task.kind} task a "
                                           "prompt and a reference: no generation was scored",
            "device": str(device), "device_reason": where.reason, "context_length": context,
            "trained_context": trained, "baseline": "unigram, add-one smoothed, fit on the train split",
            "parameters": sum(p.numel() for p in model.parameters()), "seconds": round(time.perf_counter() - started, 2),
            "benchmarks": suite.results if suite else None}
    return EvalResult(metrics=metrics, examples=out, rag=rag_info, info=info)


def trained_context(model_dir: Path) -> int | None:
    """The sequence length the model was trained at (lmforge.json `seq_len`), or None when not recorded."""
    meta = Path(model_dir) / "lmforge.json"
    seq_len = json.loads(meta.read_text()).get("seq_len") if meta.is_file() else None
    return int(seq_len) if seq_len else None


def scored_context(model_dir: Path, cfg: EvaluationConfig, model_config: Any) -> tuple[int, int | None]:
    """(tokens per scored window and prompt, trained context): never beyond what the model was trained on.

    The configured `context_length` (else the model's max_position_embeddings, which the
    training stage sets to at least 256) is capped at the trained `seq_len`: positions past
    it were never trained, so scoring them would measure extrapolation, not the model.
    """
    context = cfg.context_length or int(getattr(model_config, "max_position_embeddings", 512))
    trained = trained_context(model_dir)
    return (min(context, trained) if trained else context), trained


def task_examples(records: list[Record], task: Task, n: int | None,
                  rng: random.Random) -> list[tuple[Record, Any, str]]:
    """(record, prompt, reference) of up to n records that give the task an example, in a seeded choice."""
    found = {r.id: ex for r in records if (ex := task.example(r)) is not None}
    return [(r, *found[r.id]) for r in sample_records([r for r in records if r.id in found], n, rng)]


def sample_records(records: list[Record], n: int | None, rng: random.Random) -> list[Record]:
    """A seeded choice of n records in id order (all of them when there are no more): the same for every model."""
    if n is None or len(records) <= n:
        return list(records)
    return sorted(rng.sample(records, n), key=lambda r: r.id)


def _run_rag(rag: Rag | Callable[[str], str] | None, model: Any, tokenizer: Any, prompts: list[Any], refs: list[str],
             task: Task, gen_kwargs: dict[str, Any],
             plain: dict[str, float]) -> tuple[dict[str, Any], list[str], list[dict[str, float]]]:
    if rag is None:
        return {"status": "off", "reason": "no retrieval was given to the evaluation"}, [], []
    if not prompts or not all(isinstance(p, str) for p in prompts):
        return {"status": "skipped", "reason": f"retrieval augments string prompts; the {task.kind} task's held-out "
                                               "prompts are messages or none"}, [], []
    augment = rag.augment if isinstance(rag, Rag) else rag
    if augment is None:
        return {"status": "skipped", "reason": rag.reason}, [], []  # type: ignore[union-attr]
    try:
        with held():   # one hold of the store for the batch, not one shard load per prompt
            rag_prompts = [augment(task.plain(p)) for p in prompts]
    except Exception as e:  # a store that breaks mid-run is reported, never scored as RAG; a held one is an error
        if store_busy(e):
            raise
        return {"status": "skipped", "reason": f"retrieval failed: {type(e).__name__}: {e}"}, [], []
    gens, _ = generate(model, tokenizer, rag_prompts, task, **gen_kwargs)
    preds = [task.scored(g.text) for g in gens]
    scores = score_texts(preds, refs)
    m = scores.metrics()
    return {"status": "ok", "metrics": m, "delta": {k: m[k] - plain[k] for k in GEN_METRICS}}, preds, scores.per_pair
