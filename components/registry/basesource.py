"""Where a training base comes from: a local folder, or a registered version (`[training.model] init`).

    base = resolve_base(ws, "/models/qwen2-0.5b")             # a folder: check_base (components/model/basemodel.py)
    base = resolve_base(ws, "models:/lmforge-lm@champion")    # the version the alias holds now, downloaded and checked
    base.ref, base.version, base.path       # "models:/lmforge-lm@champion", "3", <ws>/registry/lmforge-lm/3/<hf>
    base.pin()                              # {"ref": ..., "version": "3"}: what the dataset's manifest records
    base = resolve_base(ws, init, pinned=manifest["source"].get("base"))   # the version that dataset was made for

This is the one place a registry reference becomes a folder: the alias (or the version) is
looked up with the registry's resolve_version, the version is downloaded into the workspace's
cache with download_model (`<ws>/registry/<name>/<version>/`, reused on later runs), and that
folder is checked like any other base (safetensors only, no remote code: loading never runs
code stored with the model). Its content must equal the version's registered `model_sha256`.

Pinning: an alias may move while a pipeline runs. The data stage resolves it once and records
the version in the dataset's manifest (`source.base`, which also makes the dataset version
depend on it); training reads its dataset's manifest and passes that record as `pinned`, so
the weights trained are the version whose tokenizer made the dataset, wherever the alias is now.

(This is not in basemodel.py because the registry package imports components/data, which
imports basemodel: basemodel importing the registry would close a cycle.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from lmforge.components.errors import UserError
from lmforge.components.model.basemodel import KEY, BaseCheckpoint, check_base
from lmforge.components.registry.store import download_model, list_versions, resolve_version, version_tags
from lmforge.components.sections.training import REGISTRY_SHAPES, parse_registry_ref
from lmforge.components.workspace import Workspace


def resolve_base(ws: Workspace, init: str | Path, *, pinned: Mapping[str, str] | None = None,
                 key: str = KEY) -> BaseCheckpoint:
    """The checked base `init` names: a folder as it is, or a registered version downloaded into the workspace.

    `pinned` is a dataset's record of the base it was made for ({"ref", "version"}, BaseCheckpoint.pin): when it
    is for this same reference, its version is used and the alias is not read again.
    """
    ref = parse_registry_ref(str(init))
    if ref is None:
        return check_base(init, key=key)
    shown = str(ref)
    if pinned is not None and pinned.get("ref") == shown:
        selector = str(pinned["version"])
    else:
        selector = ref.selector
    try:
        version = resolve_version(ws, ref.name, selector)
    except UserError:
        if selector != ref.selector:  # the dataset's pin names a version deleted since
            raise UserError(key, shown, f"was pinned to version {selector} by the dataset's manifest, and {ref.name} "
                            "no longer has that version", "Re-run the data stage to pin the alias again: "
                            f"lmforge run data --set {KEY}={shown}") from None
        raise UserError(key, shown, _missing(ws, ref.name, ref.alias, selector),
                        f"Run `lmforge registry list --model {ref.name}` to see its versions and aliases, and set init "
                        f"to one of them ({REGISTRY_SHAPES}) or to a local folder") from None
    folder = download_model(ws, ref.name, version)
    base = check_base(folder, key=f"{key} {shown} (version {version})")
    registered = version_tags(ws, ref.name, version).get("model_sha256")
    if registered and registered != base.sha256:
        raise UserError(key, shown, f"version {version}'s download {folder} does not hold the registered content "
                        f"(sha256 {base.sha256[:12]}, registered {registered[:12]})",
                        f"Delete {folder.parent} (lmforge downloads it again) and re-run")
    return dataclasses.replace(base, ref=shown, version=version)


def _missing(ws: Workspace, name: str, alias: str | None, selector: str) -> str:
    """Why the registry has no version for `selector`: the name, the alias or the version is not there."""
    rows = list_versions(ws, name)
    if not rows:
        return f"names no registered model: there is no model {name!r} in the registry"
    if alias is not None:
        held = ", ".join(f"{a} -> {r['version']}" for r in rows for a in r["aliases"]) or "none"
        return f"names alias {alias!r}, which is not set on {name} (its aliases: {held})"
    known = ", ".join(r["version"] for r in reversed(rows))
    return f"names version {selector}, which {name} does not have (its versions: {known})"
