"""Benchmark suites through EleutherAI's lm-evaluation-harness, on a model folder or on what is served.

    bench = BenchmarkConfig(tasks=["lmforge_heldout"])           # [evaluation.benchmarks]
    held = HeldOut(dataset_dir, "test", task)                    # what the shipped task lmforge_heldout is built from
    check_tasks(bench, held)                                     # UserError naming a task whose data is not here
    suite = on_folder(model_dir, bench, held)                    # the harness's HF model on lmforge's loaded model
    suite = on_model(model, tokenizer, bench, check_tasks(bench, held.metadata(model_dir)))   # a model already loaded
    suite = on_endpoint("http://127.0.0.1:9000/v1", "lmforge", bench, held, tokenizer_dir=model_dir)   # the gateway
    suite.metrics      # {"bench.<task>.<metric>": value, "bench.<task>.<metric>_stderr": its standard error}
    suite.results      # the harness's results JSON (results, n-samples, versions, configs, higher_is_better)
    table(suite.results)   # the harness's own markdown table

The scoring is the harness's (`lm_eval.simple_evaluate`), never a copy. The model folder is loaded by
lmforge (components/serving/modelload.py), so an int8 variant is scored as int8, on the device
components/runtime/accelerator.py picks for it, and handed to the harness's `HFLM` as a model object.
Tasks come from lmforge's shipped folder (`components/evaluation/tasks/`: `lmforge_heldout`), then the
user's `include_path`, then the harness's own (GLUE, SuperGLUE, ...; indexed only when a name needs them).

Nothing is downloaded: the Hugging Face datasets and hub libraries are put offline while a task loads and
while the harness runs (`offline()`, which puts the process's variables and the libraries' constants back
after), and every task's data is loaded before any model is, so a task whose data is not on this machine is a
UserError that names it and says how to provide it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.sections.evaluation import BenchmarkConfig
from lmforge.components.serving.task import Task
from lmforge.components.vectors.embed import hf_offline

SHIPPED = Path(__file__).with_name("tasks")   # lmforge's own task YAMLs (package data)
BOOTSTRAP_ITERS = 1000   # the harness's bootstrap for non-mean metrics' standard errors (its default, 100000, takes minutes)
CONFIG_KEY = "evaluation.benchmarks.tasks"


@dataclass(frozen=True)
class HeldOut:
    """The held-out split the shipped task `lmforge_heldout` is built from, rendered as the model's task renders it."""

    dataset_dir: Path
    split: str
    task: Task
    seed: int = 0

    def metadata(self, tokenizer_dir: Path) -> dict[str, Any]:
        """What the shipped task's loader (tasks/heldout.py) is called with (the harness's task metadata)."""
        return {"dataset_dir": str(self.dataset_dir), "split": self.split, "task": self.task.to_dict(),
                "tokenizer_dir": str(tokenizer_dir), "seed": self.seed}


@dataclass
class Suite:
    """One harness run: its flattened metrics and its results JSON."""

    metrics: dict[str, float]
    results: dict[str, Any] = field(repr=False)


def table(results: dict[str, Any]) -> str:
    """The harness's own markdown table of a results JSON (Suite.results, or the report's copy of it)."""
    from lm_eval.utils import make_table

    return make_table(results).strip()


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """No download while the harness runs, and the process as it was after: the hub and datasets libraries read
    their cache only (vectors.embed.hf_offline, scoped and restored). The harness's own warnings (about a model passed
    as an object, a task's loader taking metadata) are not the user's to act on: its errors still show; its logger's
    level is put back too."""
    harness = logging.getLogger("lm_eval")
    level = harness.level
    harness.setLevel(logging.ERROR)
    try:
        with hf_offline():
            yield
    finally:
        harness.setLevel(level)


def task_manager(cfg: BenchmarkConfig, metadata: dict[str, Any] | None = None) -> Any:
    """The harness's TaskManager over the shipped folder and `include_path`; with the harness's own tasks
    indexed too (seconds) only when a name is in neither."""
    from lm_eval.tasks import TaskManager

    paths = [str(SHIPPED)]
    if cfg.include_path:
        include = Path(cfg.include_path).expanduser()
        if not include.is_dir():
            raise UserError("evaluation.benchmarks.include_path", cfg.include_path, "is not a folder",
                            "Point it at the folder that holds your task YAMLs")
        paths.append(str(include))
    local = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    known = set(local.all_tasks)
    if all(name in known for name in cfg.tasks):
        return local
    return TaskManager(include_path=paths, include_defaults=True, metadata=metadata)


def check_tasks(cfg: BenchmarkConfig, metadata: dict[str, Any] | None = None) -> Any:
    """Load every task (and its data) offline, one by one; the TaskManager that found them. UserError naming the
    first task that is unknown or whose data is not on this machine. Runs before any model loads."""
    with offline():
        return _load_each(task_manager(cfg, metadata), cfg)


def _load_each(tm: Any, cfg: BenchmarkConfig) -> Any:
    """check_tasks' loop, offline: each task of cfg loaded by itself, so an error names the one that failed."""
    for name in cfg.tasks:
        try:
            tm.load([name])
        except KeyError as e:
            raise UserError(CONFIG_KEY, name, "is not a task or group the harness knows, nor one in lmforge's "
                            f"shipped tasks or include_path ({cfg.include_path or 'unset'})",
                            "Check the name (`lm-eval ls tasks` lists the harness's), or put its YAML in "
                            "evaluation.benchmarks.include_path") from e
        except (ConnectionError, FileNotFoundError, OSError, ValueError) as e:
            raise UserError(CONFIG_KEY, name, f"needs data that is not on this machine ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:300]}); nothing is downloaded at run time",
                            "Fill the Hugging Face datasets cache on a machine with network (python -c \"import "
                            "datasets; datasets.load_dataset('<its dataset_path>', '<its dataset_name>')\") and "
                            "point HF_DATASETS_CACHE (or HF_HOME) at it here, or give the task a local file "
                            "(dataset_path: json, data_files) in a YAML under evaluation.benchmarks.include_path") from e
    return tm


def on_folder(model_dir: Path, cfg: BenchmarkConfig, held: HeldOut | None = None) -> Suite:
    """The suite on a model folder, loaded as what it is, on the device its kernels allow (its tasks' data
    checked first)."""
    from lmforge.components.registry.loading import load_causal_lm
    from lmforge.components.runtime.accelerator import runnable_device

    tm = check_tasks(cfg, held.metadata(Path(model_dir)) if held else None)
    model, tokenizer = load_causal_lm(Path(model_dir))
    model.to(runnable_device(model).device)
    return on_model(model, tokenizer, cfg, tm)


def on_model(model: Any, tokenizer: Any, cfg: BenchmarkConfig, tm: Any) -> Suite:
    """The suite on a loaded model (where it is, in its dtype) with the TaskManager check_tasks returned."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size,
              max_length=getattr(model.config, "max_position_embeddings", None))
    return evaluate(lm, cfg, tm)


def on_endpoint(base_url: str, model: str, cfg: BenchmarkConfig, held: HeldOut | None = None, *,
                tokenizer_dir: Path | None = None) -> Suite:
    """The suite on an OpenAI-compatible server (`base_url` ends in /v1): the harness's local-completions model,
    text prompts, greedy. Log-likelihood tasks (multiple choice: lmforge_heldout, GLUE) are scored from the server's
    prompt log-probs (`echo` with `logprobs`, which lmforge's gateway answers); the harness counts each context's
    tokens with the served model's tokenizer, `tokenizer_dir` (its folder: the version's, or the model folder). Without
    one, generation tasks (output_type generate_until) only."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    tm = check_tasks(cfg, held.metadata(tokenizer_dir) if held and tokenizer_dir else None)
    if tokenizer_dir is None and (scored := output_types(tm, cfg.tasks) - {"generate_until"}):
        raise UserError(CONFIG_KEY, ", ".join(cfg.tasks), f"holds {', '.join(sorted(scored))} tasks, which the harness "
                        "scores on an endpoint only with the served model's tokenizer (it counts each context's tokens)",
                        "Pass tokenizer_dir: the served model's folder")
    lm = LocalCompletionsAPI(base_url=base_url.rstrip("/") + "/completions", model=model,
                             tokenizer_backend="huggingface" if tokenizer_dir else None,
                             tokenizer=str(tokenizer_dir) if tokenizer_dir else None, tokenized_requests=False,
                             batch_size=1, num_concurrent=cfg.batch_size, max_retries=1)
    return evaluate(lm, cfg, tm)


def output_types(tm: Any, names: Any) -> set[str]:
    """The output types of the tasks `names` load (a group's, of each of its tasks): generate_until,
    multiple_choice, loglikelihood, loglikelihood_rolling."""
    from lm_eval.tasks import get_task_dict

    with offline():
        return _leaf_types(get_task_dict(list(names), tm))


def _leaf_types(tasks: dict[Any, Any]) -> set[str]:
    def leaves(tasks: dict[Any, Any]) -> Any:
        for task in tasks.values():
            yield from leaves(task) if isinstance(task, dict) else [task.config.output_type]
    return set(leaves(tasks))


def evaluate(lm: Any, cfg: BenchmarkConfig, tm: Any) -> Suite:
    """The harness's simple_evaluate on `lm`, offline (its tasks' data is read again from the cache)."""
    import lm_eval

    with offline():
        out = lm_eval.simple_evaluate(model=lm, tasks=list(cfg.tasks), num_fewshot=cfg.num_fewshot, limit=cfg.limit,
                                      task_manager=tm, log_samples=False, bootstrap_iters=BOOTSTRAP_ITERS)
    results = {k: out[k] for k in ("results", "groups", "group_subtasks", "n-shot", "n-samples", "versions",
                                   "higher_is_better", "configs", "lm_eval_version") if k in out}
    return Suite(metrics=flatten(results["results"]), results=json_ready(results))


def flatten(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The harness's {task: {"acc,none": v, "acc_stderr,none": se, ...}} as {"bench.task.acc": v,
    "bench.task.acc_stderr": se}; a filter other than "none" stays in the name (bench.task.exact_match.strict-match).
    A value that is not a finite number (the harness's "N/A" standard error) is left out."""
    flat: dict[str, float] = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if not filt or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            name = metric if filt == "none" else f"{metric}.{filt}"
            flat[f"bench.{task}.{name}"] = float(value)
    return flat


def json_ready(obj: Any) -> Any:
    """The harness's results as plain JSON (its configs hold callables and NaNs)."""
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)
