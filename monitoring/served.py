"""The model behind the deployment's serving alias (`production`, or `production-<deploy.name>`) and the request
features its serving computes: what monitoring compares.

    served = served_model(ws, cfg)        # Served(registry_model, version, model_dir, dataset_version, records, ...)
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
from lmforge.components.registry.gate import production_alias
from lmforge.components.workspace import Workspace


def serving_featurizer(tokenizer_dir: Path, rare_ids: frozenset[int]) -> Any:
    """Request features of signatures, computed as components/serving/triton_model.py computes them for the request log."""
    from transformers import AutoTokenizer

    from lmforge.components.serving import processing

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def featurize(signatures: list[str]) -> list[dict[str, float]]:
        ids = tok(list(signatures))["input_ids"] if signatures else []
        return [{"prompt_chars": len(sig), "prompt_tokens": len(i),
                 "rare_token_rate": processing.rare_token_rate(i, rare_ids, tok.unk_token_id)}
                for sig, i in zip(signatures, ids)]

    return featurize


@dataclass(frozen=True)
class Served:
    """The registry version behind this deployment's serving alias: what the request log's rows were answered by."""
    registry_model: str
    version: str               # the registry version, also Triton's version number in the request log
    model_dir: Path            # its Hugging Face folder: the tokenizer serving uses
    dataset_version: str       # the dataset it was trained on: the reference's prompts
    records: Path              # that dataset's records/ folder: this workspace's, or the copy that travelled
    travelled: Path | None = None   # the version's dataset bundle (components/registry/travel.py) when records came from it

    @property
    def source(self) -> str:
        return "registry" if self.travelled is not None else "workspace"


def served_model(ws: Workspace, cfg: PipelineConfig) -> Served:
    """The version serving on this deployment target ([deploy] name), its folder and its training dataset.

    The dataset is this workspace's when it has it; otherwise the copy that travelled with the version
    (components/registry/travel.py), so a workspace can monitor what another one trained and deployed.
    UserError when nothing serves, or when the dataset is neither here nor in the registry.
    """
    from lmforge.components.registry import current, download_model
    from lmforge.components.registry.travel import fetch_dataset_bundle

    name, alias = cfg.registry.model_name, production_alias(cfg.deploy.name)
    version = current(ws, name, alias)
    if version is None:
        raise UserError("served model", f"{name}@{alias}", "is not set: no version serves yet",
                        f"Deploy one first: lmforge run deploy (deploy.name = {cfg.deploy.name!r})")
    model_dir = download_model(ws, name, version)
    meta = model_dir / "lmforge.json"
    dataset = json.loads(meta.read_text()).get("dataset_version") if meta.is_file() else None
    if dataset and (ws.dataset_dir(dataset) / "records").is_dir():
        return Served(registry_model=name, version=version, model_dir=model_dir, dataset_version=dataset,
                      records=ws.dataset_dir(dataset) / "records")
    bundle = fetch_dataset_bundle(ws, name, version)
    if bundle is None:
        raise UserError("served model", f"{name} v{version}",
                        f"names no dataset in this workspace (dataset_version={dataset}), and none travelled with "
                        "it in the registry (it was registered before datasets travelled with versions)",
                        "Monitor in the workspace that trained it, or register it again with lmforge run evaluate")
    ref = json.loads((bundle / "dataset.json").read_text())
    return Served(registry_model=name, version=version, model_dir=model_dir, dataset_version=ref["dataset_version"],
                  records=bundle / "records", travelled=bundle)


def served_rare_ids(ws: Workspace, served: Served, min_count: int) -> frozenset[int]:
    """The rare-token ids serving uses for the served version: from this workspace's training shards, or from
    the token counts that travelled with it."""
    from lmforge.deploy.repository import rare_ids_from

    return frozenset(rare_ids_from(served.travelled or ws.training_shards(served.dataset_version), min_count))
