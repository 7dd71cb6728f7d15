"""A dataset's task: the configured one or the one its records imply, checked against a tokenizer, and its
held-out prompts.

    task = dataset_task(cfg.task, ws.dataset_dir(version))   # components/task.py Task; saved in the export's lmforge.json
    configured_task(cfg.task)                                # the task [task] names, or None for "auto"
    check_task(task, tokenizer)                              # UserError: a chat task on a tokenizer with no chat template
    heldout_prompts(ws.dataset_dir(version), task, n=8)      # prompts as clients send them (a chat's as JSON)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.components.data.records import read_records
from lmforge.components.errors import UserError
from lmforge.components.sections.task import TaskConfig
from lmforge.components.task import Task, TaskError, infer_kind


def configured_task(cfg: TaskConfig) -> Task | None:
    """The task `cfg` names; None for kind "auto" (the data decides)."""
    return Task(kind=cfg.kind, stop=tuple(cfg.stop)) if cfg.kind != "auto" else None


def dataset_task(cfg: TaskConfig, dataset_dir: Path) -> Task:
    """`cfg`'s task; with kind "auto", the one the dataset's train records imply (task.infer_kind)."""
    if (task := configured_task(cfg)) is not None:
        return task
    path = Path(dataset_dir) / "records" / "train.jsonl"
    if not path.is_file():
        raise UserError("dataset", dataset_dir, "has no records/train.jsonl to tell its task from",
                        "Re-run the data stage (lmforge run data) or set task.kind to a kind")
    return Task(kind=infer_kind(read_records(path)), stop=tuple(cfg.stop))


def check_task(task: Task, tokenizer: Any) -> None:
    """UserError when the tokenizer cannot render the task's prompts (a chat task needs a chat template)."""
    try:
        task.uses_template(tokenizer)
    except TaskError as e:
        raise UserError("task.kind", task.kind, str(e)) from e


def heldout_prompts(dataset_dir: Path, task: Task, *, n: int) -> list[str]:
    """Up to n prompts of the task from the dataset's test split (then validation, then train), in id order, as text
    a client sends (Task.prompt_as_text); [] when the dataset has no records here."""
    for split in ("test", "validation", "train"):
        path = Path(dataset_dir) / "records" / f"{split}.jsonl"
        if not path.is_file():
            continue
        found = [ex[0] for r in sorted(read_records(path), key=lambda r: r.id) if (ex := task.example(r)) is not None]
        if found:
            return [task.prompt_as_text(p) for p in found[:n]]
    return []
