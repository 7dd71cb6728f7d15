"""The Feast store of a workspace: check feature_store.yaml, load the definitions, apply, materialise.

    store = open_store(ws, cfg)                 # a feast.FeatureStore on <ws>/features
    apply_repo(ws, cfg)                         # `feast apply` for feature_repo/feature_definitions.py
    materialize(ws, cfg, since=oldest_event)    # incremental: offline rows since the last run -> SQLite

feature_store.yaml takes its paths from $LMFORGE_HOME, so this module pins that variable to
the workspace it is given (and refuses a different one already set). A broken
feature_store.yaml is a UserError naming the file and the key.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from lmforge.components.errors import UserError
from lmforge.components.runtime.resources import feature_repo_dir
from lmforge.components.sections.features import FeaturesConfig
from lmforge.components.workspace import ENV_HOME, Workspace

REPO_DEFAULT = feature_repo_dir()  # the packaged feature_repo/ (package data of the wheel)
YAML_NAME = "feature_store.yaml"
DEFINITIONS = "feature_definitions.py"
VIEW = "document_quality"

_STORES: dict[tuple[str, str], Any] = {}


def repo_path(cfg: FeaturesConfig) -> Path:
    path = Path(cfg.repo).expanduser().resolve() if cfg.repo else REPO_DEFAULT
    if not (path / YAML_NAME).is_file():
        raise UserError("features.repo", path, f"has no {YAML_NAME}",
                        "Point it at a Feast feature repo folder, or unset it to use the project's feature_repo/")
    return path


def pin_workspace(ws: Workspace) -> None:
    """Make $LMFORGE_HOME name `ws`, the workspace feature_store.yaml and the definitions read."""
    current = os.environ.get(ENV_HOME)
    if current is not None and Path(current).expanduser().resolve() != ws.root:
        raise UserError(ENV_HOME, current, f"names a different workspace than the one in use ({ws.root})",
                        f"Unset {ENV_HOME} or point it at {ws.root}")
    os.environ[ENV_HOME] = str(ws.root)


def check_repo_config(yaml_file: Path) -> Any:
    """Parse and validate feature_store.yaml as Feast would; a problem names the file and the key."""
    from feast.repo_config import RepoConfig
    from pydantic import ValidationError

    text = os.path.expandvars(yaml_file.read_text(encoding="utf-8"))
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(str(yaml_file), None, f"is not valid YAML{where} ({getattr(e, 'problem', e)})",
                        "Fix the syntax there") from e
    if not isinstance(raw, dict):
        raise UserError(str(yaml_file), None, "is not a YAML mapping of Feast settings",
                        "Restore it from git: git checkout feature_repo/feature_store.yaml")
    for key, value in _leaves(raw):
        if isinstance(value, str) and re.search(r"\$\{\w+\}|\$[A-Z_][A-Z0-9_]*", value):
            raise UserError(f"{yaml_file}: {key}", value, "has an environment variable that is not set",
                            "Set it, or write the value out")
    try:
        return RepoConfig(**raw)
    except ValidationError as e:
        err = e.errors()[0]
        key = _full_key(raw, ".".join(str(p) for p in err["loc"])) or "(top level)"
        raise UserError(f"{yaml_file}: {key}", repr(err.get("input"))[:80], f"is invalid: {err['msg'].lower()}",
                        "Fix that key (see https://docs.feast.dev/reference/feature-repository/feature-store-yaml)") from e
    except Exception as e:  # Feast raises its own errors for unknown store types and the like
        raise UserError(str(yaml_file), None, f"is rejected by Feast: {e}", "Fix the key it names") from e


def open_store(ws: Workspace, cfg: FeaturesConfig, *, fresh: bool = False) -> Any:
    """The FeatureStore of `ws` (cached per workspace and repo; `fresh` builds a new one)."""
    from feast import FeatureStore

    repo = repo_path(cfg)
    key = (str(ws.root), str(repo))
    if not fresh and key in _STORES:
        return _STORES[key]
    pin_workspace(ws)
    ws.features.mkdir(parents=True, exist_ok=True)
    config = check_repo_config(repo / YAML_NAME)
    config.repo_path = repo
    store = FeatureStore(config=config)
    _STORES[key] = store
    return store


def load_definitions(ws: Workspace, cfg: FeaturesConfig) -> list[Any]:
    """The Feast objects defined in the repo's definitions file, in a stable order."""
    from feast import Entity, FeatureService, FeatureView

    pin_workspace(ws)
    path = repo_path(cfg) / DEFINITIONS
    if not path.is_file():
        raise UserError("features.repo", path.parent, f"has no {DEFINITIONS}", "Restore it from the project")
    module = _import_file(path)
    objects = [v for v in vars(module).values() if isinstance(v, (Entity, FeatureView, FeatureService))]
    order = {Entity: 0, FeatureView: 1, FeatureService: 2}
    objects.sort(key=lambda o: (next(r for t, r in order.items() if isinstance(o, t)), o.name))
    view = next((o for o in objects if isinstance(o, FeatureView) and o.name == VIEW), None)
    if view is None:
        raise UserError(str(path), None, f"defines no {VIEW!r} feature view, which lmforge selects and retrieves with",
                        "Start from the project's feature_repo/feature_definitions.py")
    source = Path(view.batch_source.path)
    if not source.is_relative_to(ws.root):
        raise UserError(f"{path}: {VIEW}", source, f"is read from outside the workspace {ws.root}, where lmforge publishes it",
                        "Build the source path from components.workspace.Workspace.from_env(), as the project's file does")
    return objects


def apply_repo(ws: Workspace, cfg: FeaturesConfig) -> dict[str, list[str]]:
    """`feast apply`: register the definitions and create the online tables. Returns the names applied."""
    from feast import Entity, FeatureService, FeatureView

    objects = load_definitions(ws, cfg)
    store = open_store(ws, cfg, fresh=True)
    store.apply(objects)
    return {
        "entities": [o.name for o in objects if isinstance(o, Entity)],
        "feature_views": [o.name for o in objects if isinstance(o, FeatureView)],
        "feature_services": [o.name for o in objects if isinstance(o, FeatureService)],
    }


def materialize(ws: Workspace, cfg: FeaturesConfig, *, end: datetime | None = None,
                since: datetime | None = None) -> dict[str, Any]:
    """Load offline rows newer than the last materialisation into the online store (incremental).

    Incremental materialisation starts where the last one ended, or at now - ttl the first
    time. An event time (a dataset version's time) can be older than that start; pass `since`
    (the dataset's oldest event time) and the gap [since, start) is loaded as well, before the
    incremental range, so that the newest value is the one written last.
    """
    store = open_store(ws, cfg)
    end = end or datetime.now(timezone.utc)
    view = store.get_feature_view(VIEW)
    start = view.most_recent_end_time
    if start is None:
        start = end - view.ttl
    start = start if start.tzinfo else start.replace(tzinfo=timezone.utc)
    report: dict[str, Any] = {"incremental_from": start.isoformat(), "materialized_until": end.isoformat(),
                              "backfilled_from": None}
    # The older range first: the online store keeps whatever was written last, so a backfill
    # after the incremental load would put an older value over a newer one.
    if since is not None and since < start:
        store.materialize(start_date=since, end_date=start, feature_views=[VIEW])
        report["backfilled_from"] = since.isoformat()
    store.materialize_incremental(end_date=end, feature_views=[VIEW])
    return report


def _import_file(path: Path) -> ModuleType:
    name = f"_lmforge_feature_repo_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def _full_key(raw: dict[str, Any], key: str) -> str:
    """Feast validates the store sections on their own, so pydantic's location loses its parent; find it."""
    if not key or key.split(".")[0] in raw:
        return key
    matches = [k for k, _ in _leaves(raw) if k.endswith("." + key) or ("." + key + ".") in k]
    return matches[0][: matches[0].index(key) + len(key)] if matches else key


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) for every scalar in a parsed YAML tree."""
    if not isinstance(node, dict):
        return [(prefix, node)]
    out: list[tuple[str, Any]] = []
    for k, v in node.items():
        out += _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    return out
