"""The files lmforge ships as package data: configs, the Feast repo and prefect.yaml.

    packaged_config("demo")        # Path of lmforge/configs/demo.toml, installed or in a checkout
    resolve_config("tiny")         # a packaged name, or a path to a TOML file that exists
    feature_repo_dir()             # the folder holding feature_store.yaml + feature_definitions.py
    prefect_yaml()                 # the deployments file `lmforge prefect deploy` registers
    source_commit()                # the git commit of the checkout lmforge runs from; None for a wheel

They are found with importlib.resources, never through `__file__`, so a wheel installed
anywhere (not only an editable checkout) finds them. A wheel installs unzipped, so each
is a real file on disk, which Feast and `prefect deploy` need.
"""

from __future__ import annotations

import subprocess
from importlib.resources import files
from pathlib import Path

from lmforge.components.errors import UserError

CONFIGS_PACKAGE = "lmforge.configs"
FEATURE_REPO_PACKAGE = "lmforge.feature_repo"
FLOWS_PACKAGE = "lmforge.flows"


def _package_dir(package: str) -> Path:
    return Path(str(files(package)))


def packaged_configs() -> list[str]:
    """The names of the shipped configs (demo, tiny, ...), sorted."""
    return sorted(p.stem for p in _package_dir(CONFIGS_PACKAGE).glob("*.toml"))


def packaged_config(name: str) -> Path:
    """The shipped config called `name` ("demo" or "demo.toml")."""
    path = _package_dir(CONFIGS_PACKAGE) / f"{name.removesuffix('.toml')}.toml"
    if not path.is_file():
        raise UserError("--config", name, "is neither a file nor a packaged config",
                        f"Pass a TOML path, or one of: {', '.join(packaged_configs())}")
    return path


def resolve_config(value: str | Path | None) -> Path:
    """A config argument as a file: None is the packaged demo config; an existing path wins over a name.

    A bare name ("tiny") or the checkout-relative spelling ("configs/tiny.toml", what
    prefect.yaml and older docs use) names a packaged config when no such file is here.
    """
    if value is None:
        return packaged_config("demo")
    path = Path(value).expanduser()
    if path.is_file():
        return path
    text = str(value)
    if "/" not in text or (path.parent == Path("configs") and path.suffix == ".toml"):
        return packaged_config(path.name)
    raise UserError("--config", value, "does not exist",
                    f"Pass a TOML file, or a packaged config: {', '.join(packaged_configs())}")


def feature_repo_dir() -> Path:
    return _package_dir(FEATURE_REPO_PACKAGE)


def prefect_yaml() -> Path:
    return _package_dir(FLOWS_PACKAGE) / "prefect.yaml"


def source_commit() -> str | None:
    """HEAD of the git checkout the running lmforge is imported from (editable install), else None.

    An installed wheel lives in site-packages, which may itself sit inside some other
    repository (a venv in a checkout): only a checkout whose top level holds this very
    `flows/` folder counts.
    """
    flows = _package_dir(FLOWS_PACKAGE).resolve()
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=flows, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != flows.parent:
        return None
    return lines[1]
