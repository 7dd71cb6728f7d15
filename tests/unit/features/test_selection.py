"""The quality filter's reasons, and removing a selection when the feature stage is turned off."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from lmforge.components.features.selection import clear_selection, quality_filter
from lmforge.components.sections.features import FeaturesConfig
from tests.unit.features.fakedata import make_dataset


def test_each_document_gets_its_first_failing_reason():
    df = pd.DataFrame({"quality_score": [0.9, 0.1, np.nan, 0.8, 0.05, 0.7],
                       "n_words": [50, 50, np.nan, 2, 2, 50],
                       "cluster_size": [1, 1, np.nan, 1, 1, 9]})
    reasons = quality_filter(df, FeaturesConfig(min_quality=0.3, min_words=3, max_cluster_size=4))
    assert list(reasons) == ["", "low_quality", "missing_features", "too_short", "low_quality", "large_cluster"]
    assert list(quality_filter(df, FeaturesConfig(min_quality=0.0))) == ["", "", "missing_features", "", "", ""]


def test_clearing_a_selection_returns_training_to_the_whole_split(workspace):
    version, _ = make_dataset(workspace)
    ds = workspace.dataset_dir(version)
    (ds / "selected" / "shards").mkdir(parents=True)
    (ds / "selected" / "shards" / "index.json").write_text("{}")
    assert workspace.training_shards(version) == ds / "selected" / "shards"
    assert clear_selection(workspace, version) and not clear_selection(workspace, version)
    assert workspace.training_shards(version) == ds / "shards" and not (ds / "selected").exists()
    assert json.loads((ds / "report.json").read_text())["feature_selection"] is None
    assert not [p for p in ds.iterdir() if p.name.startswith(".selected")]


def test_the_flow_retries_io_errors_but_not_user_errors(workspace):
    # Under `workspace`: the first import of `flows` points Prefect's home at LMFORGE_HOME.
    from prefect.states import Failed

    from lmforge.components.errors import UserError
    from lmforge.flows.features import _retry_unless_user_error

    assert _retry_unless_user_error(None, None, Failed(data=OSError("registry.db is busy")))
    assert not _retry_unless_user_error(None, None, Failed(data=UserError("dataset", None, "has no features.parquet")))
