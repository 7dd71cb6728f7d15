"""lmforge's serving runtime: what a process that serves a model imports, and nothing else of lmforge.

    engine.py        continuous batching with token streaming (transformers' manager), and Batcher (ONNX)
    vllm_engine.py   vLLM's async engine in this process ([deploy] engine = "vllm")
    triton_model.py  the Triton python-backend model (NVIDIA's LLM tensors, decoupled, streaming)
    processing.py    a request's inputs parsed and checked against the model's limits
    generation.py    the one generation path: sampling, stopping rule, incremental text, scoring
    task.py          how a model's task renders a prompt and where its answer stops
    records.py       the records a task renders (docstring, chat, completion, pairs)
    modelload.py     any lmforge model folder loaded as what it is (safetensors only)
    onnxrun.py       an exported ONNX graph's forward pass on onnxruntime
    requestlog.py    one line per served request (the monitoring stage reads them)

Its modules import each other relatively and nothing of lmforge outside this package (import-linter checks it),
so the package is copied whole (`copy_whole`) where lmforge is not installed: a Triton model version folder
(deploy/repository.py) and an MLflow model's code (components/registry/store.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

COPY_NAME = "lmforge_serving"   # the package's name where it is copied whole


def copy_whole(parent: Path) -> Path:
    """Copy this package, every module of it, to `parent`/lmforge_serving (replacing one there); return that path."""
    dest = Path(parent) / COPY_NAME
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(Path(__file__).parent, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest
