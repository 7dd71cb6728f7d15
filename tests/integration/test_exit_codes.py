"""Exit codes as documented: a UserError is exit 2 wherever it is raised, even once the work has started.

A layout error and a bad resume are both found inside the train flow (after Prefect has started and the
dataset has been read), so they reach the CLI through a flow run, not through config loading.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, TINY_CONFIG

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def lmforge(home, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LMFORGE_HOME": str(home), "COLUMNS": "400"}
    for var in ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH", "PREFECT_API_URL"):
        env.pop(var, None)   # the workspace's own embedded Prefect, not the test session's
    return subprocess.run([sys.executable, "-m", "lmforge.cli", *args, "-c", str(TINY_CONFIG)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("exit-codes")
    r = lmforge(home, "run", "data")
    assert r.returncode == 0, r.stderr
    return home


def test_a_layout_error_found_in_the_train_flow_exits_2(home):
    r = lmforge(home, "run", "train", "--set", "training.global_batch_size=999")
    assert r.returncode == 2, r.stderr
    assert "training.global_batch_size: 999 breaks the layout rule" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_a_resume_with_nothing_to_resume_exits_2(home):
    r = lmforge(home, "run", "train", "--resume")
    assert r.returncode == 2, r.stderr
    assert "--resume" in r.stderr and "Traceback" not in r.stdout + r.stderr
