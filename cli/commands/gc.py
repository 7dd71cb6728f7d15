"""`lmforge gc`: remove what belongs only to dataset versions nothing refers to any more.

    lmforge gc --dry-run          # list what would go, and why the rest stays
    lmforge gc                    # remove it: dataset folders, .build step folders, feature files, collections
    lmforge gc --json

Kept: the version in datasets/LATEST, versions named by training runs (runs/*/ JSON files)
and versions any registered model version names, in the registry the runs go to
(MLFLOW_TRACKING_URI's server or store, else the workspace's): its `dataset` or
`dataset_version` tag, else its run's (components/registry/registered.py). A registry that cannot be
read stops gc before it removes anything.
See components/data/retention.py. Exit 0 on success, 1 when something could not be removed,
2 for a bad config.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

from lmforge.cli.commands import ConfigOpt, SetOpt
from lmforge.cli.output import emit_json
from lmforge.components.workspace import Workspace

err = Console(stderr=True)


def _collections(ws: Workspace, cfg: Any) -> tuple[Any, list[str]]:
    if cfg.vectors.url is None and not ws.qdrant.exists():
        return None, []
    from lmforge.components.vectors.index import qdrant_client

    client = qdrant_client(ws, cfg.vectors)
    prefix = cfg.vectors.collection_prefix + "_"
    return client, [c.name for c in client.get_collections().collections if c.name.startswith(prefix)]


def register(app: typer.Typer) -> None:
    @app.command()
    def gc(
        dry_run: Annotated[bool, typer.Option("--dry-run", help="list what would be removed; remove nothing")] = False,
        config: ConfigOpt = None,
        set_: SetOpt = None,
        as_json: Annotated[bool, typer.Option("--json", help="print only JSON on stdout")] = False,
    ) -> None:
        """Remove dataset versions (and their step folders, feature files, collections) nothing refers to."""
        from lmforge.cli.work import WorkFailed
        from lmforge.components.config import load_config
        from lmforge.components.data.retention import gc_plan, referenced_versions, remove
        from lmforge.components.registry.registered import registry_datasets

        cfg = load_config(config, set_ or [])
        ws = Workspace.from_env()
        refs = referenced_versions(ws, registry_versions=registry_datasets(ws))
        client, names = _collections(ws, cfg)
        plan = gc_plan(ws, refs, collections=names)
        result: dict[str, Any] = {"dry_run": dry_run, **plan}
        if not dry_run:
            result |= remove(plan)
            failed = []
            for name in plan["collections"]:
                try:
                    client.delete_collection(name)
                except Exception as e:  # one collection that will not go must not stop the rest
                    failed.append(f"{name}: {e}")
            if failed:
                raise WorkFailed(f"could not delete Qdrant collection(s): {'; '.join(failed)}")
        if as_json:
            emit_json(result)
            return
        verb = "would remove" if dry_run else "removed"
        for v, why in plan["keep"].items():
            err.print(f"keep {v}: {', '.join(why)}")
        err.print(f"{verb}: {len(plan['datasets'])} dataset version(s), {len(plan['build'])} step folder(s), "
                  f"{len(plan['features'])} feature file(s), {len(plan['collections'])} collection(s)"
                  + ("" if dry_run else f"; {result['bytes_freed'] / 2**20:.1f} MB freed"))
