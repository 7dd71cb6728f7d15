"""The pipeline's stages, by name, in the order they run, each with its flow: the one table of them.

    from lmforge.components.stages import STAGES, FLOWS, RETRAINED
    STAGES                  # ("data", "features", ..., "monitor")
    FLOWS["train"]          # "lmforge.flows.train:train_flow": where the stage's flow is (flows/pipeline.py stage_flow)
    RETRAINED               # the stages a retrain reruns, in order (flows/retrain.py)

flows/pipeline.py runs them in this order, `lmforge run <stage>` takes them as its
choices (with "all"), flows/retrain.py reruns a chain of them, and
scripts/draw_architecture.py draws one box per stage. This module imports nothing, and names each flow by its
module and function rather than importing it, so the CLI reads the choices without importing Prefect or the
flows, and a stage's flow is imported only when it runs.
"""

from __future__ import annotations

FLOWS: dict[str, str] = {
    "data": "lmforge.flows.data:data_flow",
    "features": "lmforge.flows.features:features_flow",
    "train": "lmforge.flows.train:train_flow",
    "evaluate": "lmforge.flows.evaluate:evaluate_flow",
    "compress": "lmforge.flows.compress:compress_flow",
    "deploy": "lmforge.flows.deploy:deploy_flow",
    "monitor": "lmforge.flows.monitor:monitor_flow",
}
STAGES: tuple[str, ...] = tuple(FLOWS)
# A retrain reruns the lifecycle of a model (data with the new domain through deploy): not the features (its
# training reads the shards) nor the monitor that started it.
RETRAINED: tuple[str, ...] = tuple(name for name in STAGES if name not in ("features", "monitor"))
