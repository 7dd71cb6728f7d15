"""A dataset's task: the configured one or the one its records imply, checked against a tokenizer, and its
held-out prompts.

    task = dataset_task(cfg.task, ws.dataset_dir(version))   # components/serving/task.py Task; saved in the export's lmforge.json
    configured_task(cfg.task)                                # the task [task] names, or None for "auto"
    check_task(task, tokenizer)                              # UserError: a chat task on a tokenizer with no chat template
    check_fit(cfg.task, record_shapes(paths), base=recorded_task(base_dir), base_name=init)   # UserError: kind vs data
    heldout_prompts(ws.dataset_dir(version), task, n=8)      # prompts as clients send them (a chat's as JSON)
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.sections.task import TaskConfig
from lmforge.components.serving.records import read_records
from lmforge.components.serving.task import META_FILE, Task, TaskError, infer_kind, misfit, record_shape, shapes_kind


def configured_task(cfg: TaskConfig) -> Task | None:
    """The task `cfg` names; None for kind "auto" (the data decides)."""
    return Task(kind=cfg.kind, stop=tuple(cfg.stop)) if cfg.kind != "auto" else None


def dataset_task(cfg: TaskConfig, dataset_dir: Path) -> Task:
    """`cfg`'s task; with kind "auto", the one the dataset's train records imply (task.infer_kind). A declared kind
    that does not fit the train records is a UserError (check_fit), as it is in the data stage."""
    path = Path(dataset_dir) / "records" / "train.jsonl"
    if (task := configured_task(cfg)) is not None:
        if path.is_file():
            check_fit(cfg, record_shapes([path]), where=str(dataset_dir))
        return task
    if not path.is_file():
        raise UserError("dataset", dataset_dir, "has no records/train.jsonl to tell its task from",
                        "Re-run the data stage (lmforge run data) or set task.kind to a kind")
    return Task(kind=infer_kind(read_records(path)), stop=tuple(cfg.stop))


def record_shapes(paths: Iterable[Path]) -> Counter[str]:
    """How many records of each shape (task.SHAPES) the records files hold."""
    shapes: Counter[str] = Counter()
    for path in paths:
        shapes.update(record_shape(r) for r in read_records(path))
    return shapes


def recorded_task(model_dir: Path) -> Task | None:
    """The task a model folder records (an lmforge export or a registered version: lmforge.json), or None for a
    base with no lmforge record (a Hugging Face folder)."""
    return Task.load(model_dir) if (Path(model_dir) / META_FILE).is_file() else None


def check_fit(cfg: TaskConfig, shapes: dict[str, int], *, where: str = "the data", base: Task | None = None,
              base_name: str = "") -> None:
    """UserError when the declared task.kind does not fit the records' shapes, or, under "auto", when the base's
    recorded task does not (a declared kind that fits the data is the way to retrain a base for another task)."""
    fits = shapes_kind(shapes)
    if cfg.kind != "auto" and (why := misfit(cfg.kind, shapes)):
        raise UserError("task.kind", json.dumps(cfg.kind), f"{why} (in {where})",
                        f'Set task.kind = "auto" to follow the data, or task.kind = "{fits}"')
    if cfg.kind == "auto" and base is not None and (why := misfit(base.kind, shapes)):
        raise UserError("training.model.init", base_name, f"was trained for the {base.kind} task, which {why} (in "
                        f"{where})", f'Start from a base trained for {fits}, point data.source at {base.kind} data, '
                        f'or set task.kind = "{fits}" to retrain it for {fits}')


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
