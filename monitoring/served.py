"""The model behind `production` and the request features its serving computes: what monitoring compares.

    served = served_model(ws, cfg)                       # Served(registry_model, version, model_dir, dataset_version)
    featurize = serving_featurizer(served.model_dir, rare_ids)
    featurize(["def f(x)"])                              # [{"prompt_chars": 8, "prompt_tokens": ..., "rare_token_rate": ...}]

Both the monitor flow and the retrain lifecycle (flows/retrain.py) ask this module, so neither
imports the other for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.components.config import PipelineConfig
from lmforge.components.errors import UserError
from lmforge.components.registry.gate import PRODUCTION
from lmforge.components.workspace import Workspace


def serving_featurizer(tokenizer_dir: Path, rare_ids: frozenset[int]) -> Any:
    """Request features of signatures, computed as deploy/model.py computes them for the request log."""
    from transformers import AutoTokenizer

    from lmforge.deploy import processing

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def featurize(signatures: list[str]) -> list[dict[str, float]]:
        ids = tok(list(signatures))["input_ids"] if signatures else []
        return [{"prompt_chars": len(sig), "prompt_tokens": len(i),
                 "rare_token_rate": processing.rare_token_rate(i, rare_ids, tok.unk_token_id)}
                for sig, i in zip(signatures, ids)]

    return featurize


@dataclass(frozen=True)
class Served:
    """The registry version behind `production`: what the request log's rows were answered by."""
    registry_model: str
    version: str               # the registry version, also Triton's version number in the request log
    model_dir: Path            # its Hugging Face folder: the tokenizer serving uses
    dataset_version: str       # the dataset it was trained on: the reference's prompts


def served_model(ws: Workspace, cfg: PipelineConfig) -> Served:
    """The production version, its folder and its training dataset; UserError when nothing is in production."""
    from lmforge.components.registry import current, download_model

    name = cfg.registry.model_name
    version = current(ws, name, PRODUCTION)
    if version is None:
        raise UserError("served model", f"{name}@{PRODUCTION}", "is not set: no version serves yet",
                        "Deploy one first: lmforge run deploy")
    model_dir = download_model(ws, name, version)
    meta = model_dir / "lmforge.json"
    dataset = json.loads(meta.read_text()).get("dataset_version") if meta.is_file() else None
    if not dataset or not (ws.dataset_dir(dataset) / "records").is_dir():
        raise UserError("served model", f"{name} v{version}", f"names no dataset in this workspace (dataset_version={dataset})",
                        "Monitor in the workspace that trained it, or re-run the data stage that made its dataset")
    return Served(registry_model=name, version=version, model_dir=model_dir, dataset_version=dataset)
