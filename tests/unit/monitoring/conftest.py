"""Fixtures for the monitoring tests: a real small dataset with its serving featuriser, built once per module."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lmforge.components.workspace import Workspace
from tests.unit.monitoring.dataset import make_dataset


@dataclass(frozen=True)
class MonitorData:
    ws: Workspace           # holds the dataset; tests write their request logs elsewhere
    version: str
    featurize: Any          # monitoring.served.serving_featurizer over the dataset's tokenizer and rare ids


@pytest.fixture(scope="module")
def monitor_data(tmp_path_factory, tiny_model_dir) -> MonitorData:
    root = Path(tmp_path_factory.mktemp("monitor_data")) / "ws"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMFORGE_HOME", str(root))   # importing flows/ points Prefect at this workspace
        from lmforge.deploy.repository import rare_token_ids
        from lmforge.monitoring.served import serving_featurizer

        ws = Workspace(root).ensure()
        version = make_dataset(ws, tiny_model_dir)
        rare = frozenset(rare_token_ids(ws.training_shards(version), 2))
        return MonitorData(ws, version, serving_featurizer(ws.dataset_dir(version) / "tokenizer", rare))
