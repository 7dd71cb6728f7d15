"""Any task through every stage: data -> train -> evaluate (champion) -> deploy (Triton), for a chat task, a
completion task on prompt/completion pairs and a plain text corpus; none of them Python.

For each: Triton's generate endpoint answers `text_input` with `text_output` under the model's own task (no
docstring template, the task's stop rule), and its greedy answer equals the MLflow pyfunc's and the evaluation
stage's for the same held-out prompt; the champion's evaluation run has ROUGE-L on the task's own held-out
references and the number of examples it scored.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import TINY_CONFIG
from tests.integration.sft_support import NOUNS

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

# Learnable in a few dozen steps: the answer follows from the request's verb and noun.
ACTIONS = {"open": "The {} is open now.", "close": "The {} is closed now.", "paint": "The {} is painted blue.",
           "clean": "The {} is clean and dry."}
# A chat template whose turns end with the tokenizer's eos, as Llama/Qwen chat templates end theirs.
CHAT = ("{% for m in messages %}<bos>{{ m.role }}\n{{ m.content }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant\n{% endif %}")
MAX_TOKENS = 16
SFT = ["training.objective=sft", "training.lora.r=8", "training.lora.target_modules=[]", "training.lr=0.01",
       "training.warmup_steps=2", "training.precision=fp32", "training.seq_len=96", "training.micro_batch_size=8",
       "training.max_steps=40", "training.save_every=40", "data.max_docs=1000", "data.dedup.enabled=false"]
QUICK = [f"evaluation.max_new_tokens={MAX_TOKENS}", "evaluation.max_examples=8", "evaluation.rag=false",
         "deploy.validation_latency_ms=60000", f"deploy.max_new_tokens={MAX_TOKENS}"]


def chats(path: Path) -> Path:
    rows = [{"id": f"{a}-{n}", "module": f"{a}-{n}",
             "messages": [{"role": "system", "content": "You run the house."},
                          {"role": "user", "content": f"Please {a} the {n}."},
                          {"role": "assistant", "content": reply.format(n)}]}
            for a, reply in ACTIONS.items() for n in NOUNS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def pairs(path: Path) -> Path:
    rows = [{"prompt": f"Request: {a} the {n}.\nResult:", "completion": " " + reply.format(n), "module": f"{a}-{n}"}
            for a, reply in ACTIONS.items() for n in NOUNS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def texts(path: Path) -> Path:
    rows = [{"text": f"Yesterday we had to {a} the {n} before the guests came. " + reply.format(n) +
             f" Everyone agreed that the {n} looked better afterwards, and nobody asked us to {a} it again.",
             "module": f"{a}-{n}"} for a, reply in ACTIONS.items() for n in NOUNS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def chat_base(llama: Path, out: Path) -> Path:
    """The tiny llama with a chat template in its tokenizer: a chat model's folder."""
    from transformers import AutoTokenizer

    shutil.copytree(llama, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = CHAT
    tok.save_pretrained(out)
    return out


def run_stages(root: Path, settings: list[str]) -> dict:
    """data -> train -> evaluate -> deploy in workspace `root`; the stages' results and the config."""
    from lmforge.components.config import load_config
    from lmforge.flows.data import data_flow
    from lmforge.flows.deploy import deploy_flow
    from lmforge.flows.evaluate import evaluate_flow
    from lmforge.flows.train import train_flow

    cfg = load_config(TINY_CONFIG, [*settings, *QUICK])
    return {"cfg": cfg, "data": data_flow(cfg), "train": train_flow(cfg), "evaluate": evaluate_flow(cfg),
            "deploy": deploy_flow(cfg)}


@pytest.fixture(params=["chat", "pairs", "text"])
def served(request, tmp_path, checkpoint, monkeypatch):
    from lmforge.components.workspace import Workspace
    from lmforge.deploy import deployment

    root = tmp_path / "ws"
    monkeypatch.setenv("LMFORGE_HOME", str(root))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    kind = request.param
    if kind == "chat":
        base = chat_base(checkpoint("llama"), tmp_path / "chat-base")
        settings = ["task.kind=auto", f"data.source={json.dumps(str(chats(tmp_path / 'chats.jsonl')))}",
                    f"training.model.init={json.dumps(str(base))}", *SFT]
    elif kind == "pairs":
        settings = ["task.kind=auto", 'task.stop=["\\n"]', f"data.source={json.dumps(str(pairs(tmp_path / 'p.jsonl')))}",
                    f"training.model.init={json.dumps(str(checkpoint('llama')))}", *SFT]
    else:  # a text corpus, trained from scratch as a causal LM
        settings = ["task.kind=auto", f"data.source={json.dumps(str(texts(tmp_path / 't.jsonl')))}",
                    "training.max_steps=30", "training.save_every=30", "data.dedup.enabled=false"]
    ws = Workspace(root).ensure()
    try:
        yield kind, ws, run_stages(root, settings)
    finally:
        deployment.stop(ws)


def test_any_task_is_trained_scored_registered_and_served_the_same_way(served):
    import mlflow.pyfunc
    from mlflow import MlflowClient

    from lmforge.components.registry import current, download_model
    from lmforge.components.serving.task import Task
    from lmforge.components.tracking import use_workspace
    from lmforge.deploy import client
    from lmforge.deploy.server import running_server

    kind, ws, out = served
    cfg, ev = out["cfg"], out["evaluate"]
    name = cfg.registry.model_name
    assert current(ws, name, "champion") == ev["version"] == str(out["deploy"]["version"])

    # The task was inferred from the data, recorded with the model, and is what the registry serves.
    task = Task.load(download_model(ws, name, ev["version"]))
    assert task.kind == {"chat": "chat", "pairs": "completion", "text": "completion"}[kind]
    assert task.stop == (("\n",) if kind == "pairs" else ())

    # The champion's evaluation run: ROUGE-L on the task's own held-out references, and how many were scored.
    use_workspace(ws)
    run = MlflowClient().get_run(ev["eval_run_id"])
    report = json.loads(Path(MlflowClient().download_artifacts(run.info.run_id, "report/report.json",
                                                               str(ws.root / "dl"))).read_text())
    assert report["decision"]["promote"], report["decision"]["reason"]
    assert run.data.metrics["gen_examples"] == len(report["examples"]) == cfg.evaluation.max_examples
    assert 0.0 <= run.data.metrics["rougeL"] <= 1.0 and report["info"]["task"]["kind"] == task.kind
    held_out = report["examples"][0]
    if kind == "chat":
        assert json.loads(held_out["prompt"])[-1]["content"].startswith("Please ")   # the chat's own turns
    assert held_out["reference"] and '"""' not in held_out["reference"]

    # Triton's generate endpoint, the pyfunc and evaluation: the same greedy answer for the same held-out prompt.
    url = running_server(ws).url
    body = {"text_input": held_out["prompt"], "max_tokens": MAX_TOKENS}
    answer = client.generate_endpoint(url, cfg.deploy.model_name, body)
    pyfunc = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    (by_pyfunc,) = pyfunc.predict([held_out["prompt"]], params={"max_new_tokens": MAX_TOKENS})
    assert answer["text_output"] == by_pyfunc
    assert task.scored(answer["text_output"]) == held_out["prediction"]
    assert '"""' not in answer["text_output"] and "Result:" not in answer["text_output"]
    if kind != "text":   # a fine-tune learned to end its answers: by the task's stop rule, not the token limit
        assert answer["output_tokens"] < MAX_TOKENS and "\n" not in answer["text_output"], answer

    # A request's own stop sequence cuts the text before it; echoing puts the prompt first.
    cut = client.generate_endpoint(url, cfg.deploy.model_name, {**body, "stop": [" is"]})
    assert " is" not in cut["text_output"] and answer["text_output"].startswith(cut["text_output"])
    if kind != "chat":
        echoed = client.generate_endpoint(url, cfg.deploy.model_name, {**body, "exclude_input_in_output": False})
        assert echoed["text_output"] == held_out["prompt"] + answer["text_output"]
