"""lmforge's per-machine cache: what is measured or built once per machine rather than once per workspace.

    machine_cache_dir() / "hardware.json"        # the CPU's bf16 probe (accelerator.py)
    machine_cache_dir() / "prefect-3.8.8.db"     # a migrated, empty Prefect database (flows/prefect_local.py)

~/.cache/lmforge, or $LMFORGE_CACHE_DIR. Torch-free, so that commands without a model can use it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "LMFORGE_CACHE_DIR"


def machine_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lmforge")
