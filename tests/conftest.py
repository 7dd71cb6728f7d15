"""Shared fixtures: an isolated workspace per test, and a tiny real model folder.

    def test_x(workspace, tiny_model_dir): ...

`tiny_model_dir` is a real Hugging Face folder (a byte-level BPE tokenizer trained on a
few standard-library docstrings, and a randomly initialised 2-layer LlamaForCausalLM in
safetensors), built once per session, for stages downstream of training.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from lmforge.components.runtime.cpus import cpu_share, usable_cpus
from lmforge.components.runtime.ports import free_port  # noqa: F401  (tests import it from here)
from tests.checkpoints import train_tokenizer

# Under `make test`'s xdist workers, a worker's own torch work (the in-process flows: evaluation, compression, data)
# and the child processes it starts get the worker's share of the cores as threads. Left at torch's default, one
# thread per core, two workers ran 2 x 2 OpenMP threads on 2 cores, whose barriers wait on descheduled threads.
# DeepSpeed ranks are unaffected: the launcher sets their OMP_NUM_THREADS itself.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(cpu_share(int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# Before anything imports `lmforge.flows` (which chooses the Prefect to report to, see
# flows/prefect_env.py): a session workspace of its own, and none of the user's Prefect
# settings or profiles, so tests use the embedded home there and never a real .lmforge/ or
# the user's Prefect server or Cloud workspace.
os.environ["LMFORGE_HOME"] = tempfile.mkdtemp(prefix="lmforge-tests-")
for _var in ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH", "PREFECT_API_URL", "PREFECT_PROFILE", "MLFLOW_TRACKING_URI"):
    os.environ.pop(_var, None)
os.environ["PREFECT_PROFILES_PATH"] = os.path.join(os.environ["LMFORGE_HOME"], "no-profiles.toml")

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO / "configs" / "tiny.toml"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


RANK_RSS_BYTES = 0.7e9   # a tiny-model CPU rank's resident set, read from a training run's memory rows
MOST_RANKS = 8           # the most ranks one test starts (tests/integration/test_train_3d.py)
MAX_WORKERS = 4          # each worker also starts its own Prefect server; past 4 the longest file bounds the time


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (`make test`): one worker per CPU this process may use (its affinity, not the machine's count),
    no more than memory holds if every worker ran the largest test at once, and at most MAX_WORKERS."""
    import psutil

    cpus = usable_cpus()
    by_memory = int(psutil.virtual_memory().total // (RANK_RSS_BYTES * MOST_RANKS))
    return max(1, min(cpus, by_memory, MAX_WORKERS))


def pytest_sessionfinish(session, exitstatus):
    """Send Prefect's queued logs and events, then stop its temporary API server, while pytest still
    captures output: stopped at exit instead, its "Stopping temporary server" line goes to a
    closed stream and prints a logging error."""
    import sys

    if "prefect.server.api.server" in sys.modules:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker
        from prefect.server.api.server import SubprocessASGIServer

        APILogWorker.drain_all(timeout=10)  # what is still queued for the server goes to it first
        EventsWorker.drain_all(timeout=10)
        SubprocessASGIServer().stop()  # the temporary server is the instance without a fixed port


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A fresh workspace: LMFORGE_HOME points at it for the test and its subprocesses."""
    from lmforge.components.workspace import Workspace

    root = tmp_path / "ws"
    monkeypatch.setenv("LMFORGE_HOME", str(root))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return Workspace(root).ensure()


@pytest.fixture
def tiny_config():
    from lmforge.components.config import load_config

    return load_config(TINY_CONFIG)


def build_tiny_model(out: Path, *, vocab_size: int = 512, hidden: int = 64, layers: int = 2, heads: int = 4,
                     mlp: int | None = None, context: int = 256, seed: int = 0,
                     source: str = "tests/conftest.py:build_tiny_model") -> Path:
    """Tokenizer + random Llama (tiny unless told a shape; MLP width 2 x hidden by default) saved as a Hugging Face
    folder (safetensors); benchmarks/serve_models.py builds its larger ones with it."""
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_tokenizer(vocab_size)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=mlp or hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=context, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "lmforge.json").write_text(json.dumps({"source": source, "seed": seed}))
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "model")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(kind) -> a tiny random `kind` model folder (llama, qwen2, mistral, gpt2, gpt_neox, phi3; see
    tests/checkpoints.py), built once per session and kind."""
    from tests.checkpoints import make_checkpoint

    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_checkpoint(kind, tmp_path_factory.mktemp(f"checkpoint_{kind}") / "model")
        return made[kind]
    return get
