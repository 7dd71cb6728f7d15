"""User errors print one line and exit 2 with no traceback; --debug shows the traceback."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def lmforge(*args, env_home):
    import os

    env = dict(os.environ, LMFORGE_HOME=str(env_home))
    return subprocess.run([sys.executable, "-m", "lmforge.flows.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_bad_override_is_one_line_exit_2(tmp_path):
    r = lmforge("run", "data", "--set", "data.max_docs=zero", env_home=tmp_path)
    assert r.returncode == 2
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.max_docs"), r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_debug_shows_the_traceback(tmp_path):
    r = lmforge("--debug", "run", "data", "--set", "data.max_docs=zero", env_home=tmp_path)
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_unknown_stage(tmp_path):
    r = lmforge("run", "nosuchstage", env_home=tmp_path)
    assert r.returncode == 2 and "is not a stage" in r.stdout


def test_status_on_an_empty_workspace(tmp_path):
    r = lmforge("status", env_home=tmp_path)
    assert r.returncode == 0 and "datasets: none" in r.stdout
