"""What the registry the runs go to holds, read the same way by status, the run summary and gc.

    models = registered_models(ws)   # or registered_models(ws, "lmforge-tiny"): that one only
                                     # [{"model": "lmforge-tiny", "aliases": {"champion": "3"},
                                     #   "versions": [{"version": "3", "aliases": ["champion"], "tags": {...},
                                     #                 "run_id": "..."}, ...]}]   newest version first
    registry_datasets(ws)            # [("lmforge-tiny/3", "3f2a9c1b7d0e"), ...]: the dataset of every version

Alias claims (registered models named `<model>.alias-claim`, registry/claim.py) are left out.
The registry is the one components/tracking.py resolves: the server or store
MLFLOW_TRACKING_URI names, else the workspace's SQLite store (none yet: nothing registered).
A registry that cannot be read raises a UserError naming it; a caller that deletes on the
strength of what it read (gc) must not go on as if nothing were registered.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.registry.claim import BREAK_INFIX, CLAIM_SUFFIX
from lmforge.components.registry.store import aliases_by_version
from lmforge.components.tracking import registry_client, registry_label
from lmforge.components.workspace import Workspace

# Where a version names the dataset it was trained on, first match wins: its own tags, then the
# tags and params of the run it was logged in, then those of its training run.
DATASET_KEYS = ("dataset", "dataset_version")
TRAINING_RUN_TAG = "training_run_id"
PAGE = 200


def _pages(search: Any, **kwargs: Any) -> Iterator[Any]:
    """Every result of an MLflow search, page by page (one page holds at most PAGE)."""
    token = None
    while True:
        page = search(max_results=PAGE, page_token=token, **kwargs)
        yield from page
        token = page.token
        if not token:
            return


def _read(ws: Workspace, what: str, read: Any) -> Any:
    try:
        return read()
    except UserError:
        raise
    except Exception as e:
        raise UserError("registry", registry_label(ws), f"could not be read ({what}: {type(e).__name__}: {e})",
                        "Check that the server is up and MLFLOW_TRACKING_URI names it, or unset MLFLOW_TRACKING_URI "
                        "to use the workspace's own store") from e


def _name_is(name: str) -> str:
    quote = '"' if "'" in name else "'"   # a shared registry may hold names lmforge's config would refuse
    return f"name={quote}{name}{quote}"


def _versions(client: Any, name: str) -> list[Any]:
    return sorted(_pages(client.search_model_versions, filter_string=_name_is(name)), key=lambda mv: -int(mv.version))


def registered_models(ws: Workspace, name: str | None = None) -> list[dict[str, Any]]:
    """Every registered model (or only `name`) with its aliases and versions (newest first); [] when there is
    no registry yet."""
    client = registry_client(ws)
    if client is None:
        return []

    def read() -> list[dict[str, Any]]:
        out = []
        found = _pages(client.search_registered_models, **({"filter_string": _name_is(name)} if name else {}))
        for rm in sorted(found, key=lambda m: m.name):
            if rm.name.endswith(CLAIM_SUFFIX) or CLAIM_SUFFIX + BREAK_INFIX in rm.name:
                continue   # an alias move's claim (registry/claim.py), not a model: `lmforge registry claims` lists them
            aliases = {a: str(v) for a, v in (rm.aliases or {}).items()}
            by_version = aliases_by_version(aliases)
            versions = [{"version": str(mv.version), "aliases": sorted(by_version.get(str(mv.version), [])),
                         "tags": dict(mv.tags or {}), "run_id": mv.run_id} for mv in _versions(client, rm.name)]
            out.append({"model": rm.name, "aliases": aliases, "versions": versions})
        return out

    return _read(ws, "registered models", read)


def _named(data: Any) -> str | None:
    for source in (data.tags, data.params):
        for key in DATASET_KEYS:
            if source.get(key):
                return str(source[key])
    return None


def dataset_of(client: Any, tags: dict[str, str], run_id: str | None) -> str | None:
    """The dataset version a registered version was trained on: its tags, else its run's, else its training run's."""
    for key in DATASET_KEYS:
        if tags.get(key):
            return str(tags[key])
    for rid in (run_id, tags.get(TRAINING_RUN_TAG)):
        if not rid:
            continue
        try:
            found = _named(client.get_run(rid).data)
        except Exception as e:
            if getattr(e, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                continue   # a run deleted for good names nothing; any other failure is the registry's, raised
            raise
        if found:
            return found
    return None


def registry_datasets(ws: Workspace) -> list[tuple[str, str]]:
    """("model/version", dataset version) for every registered version that names its dataset."""
    client = registry_client(ws)
    models = registered_models(ws)

    def read() -> list[tuple[str, str]]:
        out = []
        for m in models:
            for v in m["versions"]:
                dataset = dataset_of(client, v["tags"], v["run_id"])
                if dataset:
                    out.append((f"{m['model']}/{v['version']}", dataset))
        return out

    return _read(ws, "the runs of registered versions", read) if models else []
