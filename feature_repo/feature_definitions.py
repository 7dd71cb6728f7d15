"""Feast objects for lmforge: the `document` entity, the `document_quality` view, two services.

    LMFORGE_HOME=$PWD/.lmforge feast -c feature_repo plan     # or apply
    # in code: components.features.store.apply_repo(ws, cfg) loads this file and applies it

Declarative only: `feast apply` imports every file in this folder, so this one imports
nothing heavier than `components.workspace`, which says where the offline data lives.

The offline source is a folder of Parquet files, one per dataset version
(`<workspace>/features/offline/document_quality/<version>.parquet`), written by
components.features.offline from each dataset's features.parquet. Keeping every version
gives the point-in-time join a history to choose from.

No on-demand view: the derived values (ratios, quality_score) are computed once by the
data stage, and an on-demand view would store a pickled Python function in the registry,
which lmforge never loads (stored artifacts never execute code).
"""

import os
from datetime import timedelta

from feast import Entity, FeatureService, FeatureView, Field, FileSource, ValueType
from feast.types import Float64, Int64, String

from lmforge.components.workspace import ENV_HOME, Workspace

if ENV_HOME not in os.environ:
    # feature_store.yaml reads its paths from the same variable; without it they would be literal.
    raise RuntimeError(f"{ENV_HOME} is not set: feature_store.yaml takes the workspace from it. "
                       f"Run e.g. `{ENV_HOME}=$PWD/.lmforge feast -c feature_repo plan`.")

OFFLINE_DIR = Workspace.from_env().features / "offline" / "document_quality"

# A document's features are valid for a year after they were computed: long enough for any
# re-selection of a dataset, short enough that a stale document stops being served.
TTL = timedelta(days=365)

document = Entity(
    name="document",
    join_keys=["doc_id"],
    value_type=ValueType.STRING,
    description="One kept document of a dataset (Record.id, a stable hash of source/module/qualname).",
)

document_source = FileSource(
    name="document_quality_source",
    path=str(OFFLINE_DIR),
    timestamp_field="event_timestamp",
    created_timestamp_column="created_timestamp",
    description="Per-document statistics from the data stage, one Parquet file per dataset version.",
)

document_quality = FeatureView(
    name="document_quality",
    entities=[document],
    ttl=TTL,
    schema=[
        Field(name="split", dtype=String),
        Field(name="module", dtype=String),
        Field(name="n_chars", dtype=Int64),
        Field(name="n_words", dtype=Int64),
        Field(name="n_lines", dtype=Int64),
        Field(name="alpha_ratio", dtype=Float64),
        Field(name="digit_ratio", dtype=Float64),
        Field(name="punct_ratio", dtype=Float64),
        Field(name="cluster_size", dtype=Int64),
        Field(name="quality_score", dtype=Float64),
    ],
    online=True,
    source=document_source,
    tags={"owner": "lmforge", "stage": "data"},
)

training_v1 = FeatureService(
    name="training_v1",
    features=[document_quality],
    description="Everything the training-set selection filters on (point-in-time, offline).",
)

serving_v1 = FeatureService(
    name="serving_v1",
    features=[document_quality[["quality_score", "split", "module"]]],
    description="What retrieval ranks and filters by at request time (online).",
)
