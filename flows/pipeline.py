"""The stages and the end-to-end pipeline that chains them.

    lmforge run data            # one stage
    lmforge run all             # every stage that exists, in order, as subflows

Stages hand each other nothing but the workspace: each reads its inputs from the
workspace's pointers (the latest dataset, the latest training run, registry aliases)
and returns a small JSON-able summary. So any stage can be re-run on its own, and a
pipeline re-run after a failure picks cached stages back up from Prefect's results.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from typing import Any

from prefect import flow

from components.config import PipelineConfig

# name -> "module:flow"; a stage is present when its module is.
STAGES: dict[str, str] = {
    "data": "flows.data:data_flow",
    "features": "flows.features:features_flow",
    "train": "flows.train:train_flow",
    "evaluate": "flows.evaluate:evaluate_flow",
    "compress": "flows.compress:compress_flow",
    "deploy": "flows.deploy:deploy_flow",
    "monitor": "flows.monitor:monitor_flow",
}


def available_stages() -> list[str]:
    return [name for name, target in STAGES.items() if importlib.util.find_spec(target.split(":")[0]) is not None]


def stage_flow(name: str) -> Any:
    module, attr = STAGES[name].split(":")
    return getattr(importlib.import_module(module), attr)


@flow(name="pipeline", log_prints=True)
def pipeline_flow(cfg: PipelineConfig, resume: bool = False) -> dict[str, Any]:
    """Run every available stage in order; return per-stage summaries and wall times."""
    summary: dict[str, Any] = {"stages": {}}
    for name in available_stages():
        start = time.perf_counter()
        kwargs = {"resume": resume} if name == "train" else {}
        result = stage_flow(name)(cfg, **kwargs)
        summary["stages"][name] = {"seconds": round(time.perf_counter() - start, 1), "result": result}
    return summary
