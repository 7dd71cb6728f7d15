"""Benchmark suites in the evaluate stage and the gate: lm-evaluation-harness on a task folder the test writes.

The task is multiple choice over characters that never occur in the held-out split (so BPC cannot see them), and
its gold answer is the one the champion prefers (champion acc = 1). The candidate is the champion with the input
embeddings of those characters' tokens shuffled among themselves: its BPC is the champion's to the bit (the
held-out text never reads those rows), so only a benchmark rule can refuse it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.conftest import TINY_CONFIG
from tests.integration.evalreg_support import make_eval_dataset, make_run

pytestmark = [pytest.mark.integration]

TASK = "unseen_mc"
CHARS = "αβγδεζηθικλμνξπρστυφχψωЖЩЮЯ€£¥§¶©®"


def unseen_chars(ws, version: str, tok) -> tuple[list[str], set[int]]:
    """Characters whose tokens the split's records never contain, and those token ids."""
    seen: set[int] = set()
    for line in (ws.dataset_dir(version) / "records" / "test.jsonl").read_text().splitlines():
        r = json.loads(line)
        for text in (r.get("text", ""), r.get("signature", ""), r.get("docstring", "")):
            seen.update(tok(text, add_special_tokens=False)["input_ids"])
    chars = [c for c in CHARS if not set(tok(c, add_special_tokens=False)["input_ids"]) & seen]
    ids = {i for c in chars for i in tok(c, add_special_tokens=False)["input_ids"]}
    assert len(chars) >= 8, f"too few unseen characters: {chars}"
    return chars, ids


def loglikelihood(model, tok, context: str, continuation: str) -> float:
    """log p(continuation | context), tokenized as the harness does (the whole, then the context's share off)."""
    import torch

    ctx = tok(context, add_special_tokens=False)["input_ids"]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    return float(sum(logp[i - 1, whole[i]] for i in range(len(ctx), len(whole))))


def write_task(folder: Path, model_dir: Path, chars: list[str], n: int = 40) -> Path:
    """The task YAML and its JSONL: gold = the choice the model in `model_dir` prefers by a clear margin."""
    from lmforge.components.serving import modelload

    model, tok = modelload.load_model(model_dir), modelload.load_tokenizer(model_dir)
    rng, rows = random.Random(0), []
    while len(rows) < n:
        context = "".join(rng.choices(chars, k=6))
        choices = ["".join(rng.choices(chars, k=3)) for _ in range(4)]
        scores = sorted(((loglikelihood(model, tok, context, c), i) for i, c in enumerate(choices)), reverse=True)
        if len(set(choices)) == 4 and scores[0][0] - scores[1][0] > 1e-3:
            rows.append({"context": context, "choices": choices, "gold": scores[0][1]})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "unseen.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    (folder / "unseen.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'unseen.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return folder


def shuffled_embeddings(src: Path, dest: Path, ids: set[int]) -> Path:
    """A copy of `src` whose input embeddings of `ids` are shuffled among themselves."""
    import shutil

    import torch

    from lmforge.components.serving import modelload

    shutil.copytree(src, dest, dirs_exist_ok=True)
    model = modelload.load_model(src)
    order = sorted(ids)
    moved = order[1:] + order[:1]
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[order] = emb[moved].clone()
    model.save_pretrained(dest, safe_serialization=True)
    return dest


def test_benchmarks_are_logged_and_a_stricter_gate_refuses_the_candidate_that_regresses_them(
        workspace, tiny_model_dir, tmp_path):
    from mlflow import MlflowClient

    from lmforge.components.config import load_config
    from lmforge.components.registry import set_alias
    from lmforge.components.serving import modelload
    from lmforge.flows.evaluate import evaluate_flow

    version = make_eval_dataset(workspace, per_module=8)
    champion_run = make_run(workspace, tiny_model_dir, version, name="run-a")
    chars, ids = unseen_chars(workspace, version, modelload.load_tokenizer(tiny_model_dir))
    tasks = write_task(tmp_path / "tasks", tiny_model_dir, chars)
    bench = [f'evaluation.benchmarks.tasks=["{TASK}"]', f'evaluation.benchmarks.include_path="{tasks}"',
             "registry.bpc_margin=0", "registry.rougeL_tolerance=1.0"]

    first = evaluate_flow(load_config(TINY_CONFIG, bench))
    name = load_config(TINY_CONFIG).registry.model_name
    client = MlflowClient()
    run = client.get_run(first["eval_run_id"])
    assert run.data.metrics[f"bench.{TASK}.acc"] == 1.0 and f"bench.{TASK}.acc_stderr" in run.data.metrics
    files = {f.path for f in client.list_artifacts(run.info.run_id, "report")}
    assert "report/benchmarks.json" in files
    results = json.loads(Path(client.download_artifacts(run.info.run_id, "report/benchmarks.json", str(tmp_path)))
                         .read_text())
    assert results["results"][TASK]["acc,none"] == 1.0 and results["n-samples"][TASK]["effective"] == 40
    set_alias(workspace, name, "champion", first["version"], reason="test setup")

    shuffled_embeddings(workspace.run_dir(champion_run) / "export", workspace.run_dir("run-b") / "export", ids)
    strict = evaluate_flow(load_config(TINY_CONFIG, [*bench, f'registry.gate_benchmarks=[{{task="{TASK}"}}]']))
    d = strict["decision"]
    assert d["candidate"]["bpc"] == d["champion"]["bpc"], "the shuffled rows must be invisible to BPC"
    assert d["candidate"][f"bench.{TASK}.acc"] < 0.8 and not d["promote"], d
    assert f"benchmark {TASK} acc" in d["reason"] and "more than the allowed" in d["reason"], d["reason"]

    lenient = evaluate_flow(load_config(TINY_CONFIG, [*bench, f'registry.gate_benchmarks=[{{task="{TASK}", margin=1.0}}]']))
    assert lenient["decision"]["promote"], lenient["decision"]["reason"]   # the same candidate: only the rule decided


def test_a_task_whose_data_is_not_here_fails_before_any_model_loads(workspace, tiny_model_dir, tmp_path, monkeypatch):
    from lmforge.components.config import load_config
    from lmforge.components.errors import UserError
    from lmforge.components.evaluation import evaluate_model
    from lmforge.flows.evaluate import evaluate_flow

    version = make_eval_dataset(workspace, per_module=4)
    make_run(workspace, tiny_model_dir, version)
    loaded = []
    monkeypatch.setattr(evaluate_model, "load_causal_lm", lambda *a, **k: loaded.append(a) or pytest.fail("model loaded"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(UserError) as e:
        evaluate_flow(load_config(TINY_CONFIG, ['evaluation.benchmarks.tasks=["boolq"]']))
    message = str(e.value)
    assert "boolq" in message and "not on this machine" in message and "HF_DATASETS_CACHE" in message, message
    assert not loaded
