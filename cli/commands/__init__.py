"""CLI command groups, one module each; `cli/cli.py` mounts them. The options they share live here.

    from lmforge.cli.commands import ConfigOpt, JsonOpt, SetOpt
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", help="pipeline TOML file, or a packaged config: demo (the default) or tiny")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="override: section.key=value (repeatable)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print only JSON on stdout")]
