"""The wheel, installed (not editable), runs a stage from an empty folder with a packaged config.

The wheel is built from this checkout and installed with --no-deps into a fresh venv of this
Python (3.11 in the project's .venv) whose dependencies come from this environment through a
.pth line: fast and offline, and the venv holds no source tree, so configs/, feature_repo/
and prefect.yaml must come from the wheel's package data. The same run checks that the
console is quiet and that `lmforge run --json` prints one JSON document.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOISE = ["Loading weights", "Writing model shards", "Downloading artifacts", "Add type hints", "You are using a model of type",
         "Setting accelerator to CPU", "Traceback", "distributed.scheduler", "Starting temporary server"]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
                   check=True, capture_output=True, text=True, timeout=300)
    return next(out.glob("lmforge-*.whl"))


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A venv with the wheel installed and this environment's site-packages (minus the editable lmforge) on its path."""
    root = tmp_path_factory.mktemp("venv") / "v"
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # A plain path line: the editable install's own .pth in that folder is not processed from here.
    (Path(purelib) / "zz_project_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return root


def test_the_wheel_carries_configs_feature_repo_and_prefect_yaml(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ("lmforge/configs/demo.toml", "lmforge/configs/tiny.toml", "lmforge/feature_repo/feature_store.yaml",
                 "lmforge/feature_repo/feature_definitions.py", "lmforge/flows/prefect.yaml", "lmforge/cli/cli.py"):
        assert path in names, path
    assert not [n for n in names if n.split("/")[0] in ("components", "flows", "deploy", "monitoring")]
    prefect_yaml = zipfile.ZipFile(wheel).read("lmforge/flows/prefect.yaml").decode()
    assert "entrypoint: lmforge.flows.pipeline.pipeline_flow" in prefect_yaml   # the file, not a link to it


def test_lmforge_run_data_from_an_empty_folder(installed, tmp_path):
    cwd = tmp_path / "empty"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LMFORGE_", "PYTHON"))}
    env["HOME"] = str(tmp_path / "home")   # no Prefect profile of the user's: the embedded home in ./.lmforge
    python, lmforge = installed / "bin" / "python", installed / "bin" / "lmforge"

    where = subprocess.run([str(python), "-c", "import lmforge.cli.cli, lmforge.configs as c; print(c.__file__)"],
                           cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout
    assert where.startswith(str(installed)), f"lmforge imported from {where}, not from the installed wheel"

    r = subprocess.run([str(lmforge), "run", "data", "--config", "tiny", "--json"], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["stage"] == "data" and result["result"]["dataset_version"]
    assert (cwd / ".lmforge" / "datasets" / result["result"]["dataset_version"] / "manifest.json").is_file()
    assert "prefect: embedded home" in r.stderr
    assert [n for n in NOISE if n in r.stderr] == [], r.stderr[-3000:]
