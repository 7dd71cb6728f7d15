"""A command that needs no model imports no torch: `lmforge --help`, `status` and `run data` stay light.

torch alone takes seconds to import on 2 cores (issue 36: `lmforge plan`, mounted with every command,
dragged it into all of them). Each check runs in a fresh interpreter, so nothing this test process
imported counts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "deepspeed")

CHECK = f"""
heavy = [m for m in {HEAVY!r} if m in sys.modules]
assert not heavy, f"imported {{heavy}}"
"""


def run_light(body: str, home) -> subprocess.CompletedProcess:
    env = {**os.environ, "LMFORGE_HOME": str(home)}
    return subprocess.run([sys.executable, "-c", f"import sys\n{body}\n{CHECK}"], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("body", [
    "import lmforge.cli.cli",
    # every command group mounted, as each `lmforge` command does; --help and status run
    "from lmforge.cli.cli import run_cli\nassert run_cli(['--help']) == 0\nassert run_cli(['status']) == 0",
    # what `lmforge run data` imports before and for its flow: the CLI with its command groups, then the flow
    "from lmforge.cli.cli import run_cli\nassert run_cli(['run', '--help']) == 0\n"
    "import lmforge.components.config, lmforge.components.data.ingest\n"
    "import lmforge.flows.pipeline, lmforge.flows.data, lmforge.flows.workspace_flow",
], ids=["cli", "help-and-status", "data-flow"])
def test_no_torch_without_a_model(body, tmp_path):
    r = run_light(body, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]


def test_plan_still_imports_what_it_needs(tmp_path):
    """The lazy import is where the plan is made: `lmforge plan` works and is the one that pays for torch."""
    r = run_light("from lmforge.cli.cli import run_cli\n"
                  "assert run_cli(['plan', '--model', 'tiny', '--devices', '1', '--json']) == 0\n"
                  "assert 'torch' in sys.modules\nsys.modules.pop('torch')\n"
                  "[sys.modules.pop(m) for m in list(sys.modules) if m.split('.')[0] in ('transformers', 'deepspeed')]",
                  tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"recommended"' in r.stdout
