"""The pipeline's stages, by name, in the order they run: the one list of them.

    from lmforge.components.stages import STAGES    # ("data", "features", ..., "monitor")

flows/pipeline.py runs them in this order, `lmforge run <stage>` takes them as its
choices (with "all"), flows/retrain.py reruns a chain of them, and
scripts/draw_architecture.py draws one box per stage. This module imports nothing, so the
CLI reads the choices without importing Prefect or the flows.
"""

from __future__ import annotations

STAGES: tuple[str, ...] = ("data", "features", "train", "evaluate", "compress", "deploy", "monitor")
