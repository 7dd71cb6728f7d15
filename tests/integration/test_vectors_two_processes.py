"""Two processes, one workspace's embedded vector store (issue 44): one indexes and evaluates with RAG and lives on,
the next evaluates with RAG too, and both score it; a holder that never lets go fails the next one, within the wait
bound, with an error naming it, instead of an evaluation whose RAG is quietly "skipped".

Each role is a real process: `python -m tests.integration.test_vectors_two_processes <role> <model> <version>`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lmforge.components.workspace import Workspace

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 3.0


def evaluate_with_rag(model: str, version: str, wait_s: float) -> dict:
    """What the evaluate stage does for one model: RAG built from the workspace's store, then scored."""
    from lmforge.components.evaluation import evaluate_model_dir
    from lmforge.components.evaluation.rag import build_rag
    from lmforge.components.sections.evaluation import EvaluationConfig
    from lmforge.components.sections.features import FeaturesConfig
    from lmforge.components.sections.vectors import VectorsConfig

    ws = Workspace.from_env()
    vectors = VectorsConfig(embedder="hashing", hash_dim=64, lock_wait_s=wait_s)
    rag = build_rag(ws, vectors, FeaturesConfig(enabled=False), k=2, dataset_version=version)
    cfg = EvaluationConfig(max_examples=3, max_new_tokens=4, batch_size=3, bpc_max_docs=3)
    return evaluate_model_dir(Path(model), ws.dataset_dir(version), cfg, rag=rag).rag


def main(role: str, model: str, version: str) -> None:
    from lmforge.components.sections.vectors import VectorsConfig
    from lmforge.components.vectors.index import index_dataset, qdrant_client

    if role == "index-evaluate-stay":
        index_dataset(Workspace.from_env(), version, VectorsConfig(embedder="hashing", hash_dim=64))
    if role == "hold":
        held = qdrant_client(Workspace.from_env(), VectorsConfig()).session()   # never left: a holder that hangs
        held.__enter__()
        print(json.dumps({"held": True}), flush=True)
    else:
        print(json.dumps(evaluate_with_rag(model, version, WAIT_S)), flush=True)
    if role != "evaluate":
        time.sleep(120)   # lives on, as a notebook or a server would; the test kills it


def start(role: str, model: Path, version: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.integration.test_vectors_two_processes", role, str(model),
                             version], cwd=REPO, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def first_line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, f"{proc.args[3]} printed nothing: {proc.stderr.read() if proc.poll() is not None else '(alive)'}"
    return json.loads(line)


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


def test_two_processes_score_rag_one_after_the_other_and_a_holder_is_named(workspace, tiny_model_dir):
    from tests.integration.evalreg_support import make_eval_dataset

    version = make_eval_dataset(workspace, per_module=3)
    first = start("index-evaluate-stay", tiny_model_dir, version)
    try:
        assert first_line(first)["status"] == "ok"            # indexed and scored RAG; still alive
        second = start("evaluate", tiny_model_dir, version)
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
        rag = json.loads(out.splitlines()[-1])
        assert rag["status"] == "ok" and "rougeL" in rag["metrics"]
    finally:
        stop(first)
    holder = start("hold", tiny_model_dir, version)
    try:
        assert first_line(holder) == {"held": True}
        started = time.monotonic()
        third = start("evaluate", tiny_model_dir, version)
        _, err = third.communicate(timeout=120)
        took = time.monotonic() - started
    finally:
        stop(holder)
    assert third.returncode != 0 and "StoreBusy" in err
    assert f"is held by pid {holder.pid} (" in err and "hold" in err and "vectors.lock_wait_s" in err
    assert took < WAIT_S + 60   # the wait bound, plus starting Python and torch on a busy machine


if __name__ == "__main__":
    main(*sys.argv[1:])
