"""The loader the harness imports beside lmforge_heldout.yaml (`custom_dataset: !function heldout.load`)."""

from lmforge.components.evaluation.heldout_task import load

__all__ = ["load"]
