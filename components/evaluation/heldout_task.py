"""The shipped harness task `lmforge_heldout` (tasks/lmforge_heldout.yaml): which of four held-out answers follows
this prompt? Multiple choice, scored by the harness on the model's log-likelihoods (acc, acc_norm).

    load(dataset_dir=".../datasets/<v>", split="test", task={"kind": "docstring"}, tokenizer_dir=".../export")

Built from any task's held-out split (components/serving/task.py `Task.example`): the prompt is rendered as the model
reads it (its chat template, or an eos then the prompt, as lmforge serves it), the choices are the record's own
reference and three others drawn from the split with `seed`. No data leaves the machine or comes into it. The
harness calls this through the YAML's `custom_dataset` with the task's metadata (benchmarks.HeldOut.metadata).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.serving.records import read_records
from lmforge.components.serving.task import Task

CHOICES = 4


def load(*, dataset_dir: str | None = None, split: str = "test", task: dict[str, Any] | None = None,
         tokenizer_dir: str | None = None, seed: int = 0, **_: Any) -> Any:
    """A datasets.DatasetDict with one split, "test": rows of {context, choices, gold}."""
    import datasets

    from lmforge.components.serving.modelload import load_tokenizer

    if not dataset_dir or not tokenizer_dir or not task:
        raise UserError("benchmark task", "lmforge_heldout", "is built from a workspace's held-out split and runs "
                        "inside lmforge's evaluate stage (it needs the dataset, task and tokenizer)",
                        "Run it through lmforge (evaluation.benchmarks.tasks = [\"lmforge_heldout\"])")
    path = Path(dataset_dir) / "records" / f"{split}.jsonl"
    if not path.is_file():
        raise UserError("dataset", dataset_dir, f"has no records/{split}.jsonl", "Run the data stage first")
    rows = questions(read_records(path), Task.from_dict(task), load_tokenizer(tokenizer_dir), seed=seed)
    if not rows:
        raise UserError("dataset", path, f"has fewer than {CHOICES} held-out examples with distinct answers",
                        "Use more documents (data.max_docs) or another split")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def questions(records: list[Any], task: Task, tokenizer: Any, *, seed: int) -> list[dict[str, Any]]:
    """One multiple-choice row per held-out example whose answer is unique in the split, in record-id order."""
    examples = [ex for r in sorted(records, key=lambda r: r.id) if (ex := task.example(r)) is not None and ex[1].strip()]
    answers = sorted({ref for _, ref in examples})
    if len(answers) < CHOICES:
        return []
    rng = random.Random(seed)
    sep = " " if task.kind == "completion" else ""   # the continuation after a plain prompt starts at a word
    rows, seen = [], set()
    for prompt, ref in examples:
        if ref in seen:
            continue
        seen.add(ref)
        choices = [ref, *rng.sample([a for a in answers if a != ref], CHOICES - 1)]
        rng.shuffle(choices)
        rows.append({"context": context(task, tokenizer, prompt), "choices": [sep + c for c in choices],
                     "gold": choices.index(ref)})
    return rows


def context(task: Task, tokenizer: Any, prompt: Any) -> str:
    """The prompt as the model reads it: its chat template's rendering, or an eos then the prompt."""
    text = task.text(tokenizer, prompt)
    return text if task.uses_template(tokenizer) else tokenizer.eos_token + text
