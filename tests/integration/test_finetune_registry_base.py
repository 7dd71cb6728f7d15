"""A registered version as the base of a run: `training.model.init = "models:/<name>@<alias>"`.

Two versions of a tiny Qwen2 (other weights, one tokenizer) are registered; the alias points at
the first. The data stage resolves the alias once and pins that version in the dataset's manifest;
the alias then moves to the second version, and training still starts from the pinned one: the
export, the run's tags and the rank-side folder all name the reference, version 1 and its hash.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY_CONFIG

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
NAME = "bases"


@pytest.fixture
def registered(workspace, checkpoint, tmp_path):
    """Versions 1 and 2 of NAME (same tokenizer, other weights), alias `stable` on version 1."""
    from lmforge.components.registry import register_model, set_alias
    from lmforge.components.sections.registry import RegistryConfig
    from tests.checkpoints import make_checkpoint

    reg = RegistryConfig(model_name=NAME)
    first, second = checkpoint("qwen2"), make_checkpoint("qwen2", tmp_path / "other", seed=1)
    v1 = register_model(workspace, reg, first, metrics={}, tags={})
    v2 = register_model(workspace, reg, second, metrics={}, tags={})
    set_alias(workspace, NAME, "stable", v1, reason="test base")
    return {"v1": v1, "v2": v2, "first": first, "second": second}


def test_unknown_names_unset_aliases_and_missing_versions_are_refused_naming_the_fix(workspace, registered):
    from lmforge.components.errors import UserError
    from lmforge.components.registry.basesource import resolve_base

    fix = r"Run `lmforge registry list --model {}` to see its versions and aliases"
    with pytest.raises(UserError, match=r"training\.model\.init: models:/nope@stable names no registered model: there is "
                                        r"no model 'nope' in the registry\. " + fix.format("nope")):
        resolve_base(workspace, "models:/nope@stable")
    with pytest.raises(UserError, match=rf"models:/{NAME}@gone names alias 'gone', which is not set on {NAME} "
                                        rf"\(its aliases: stable -> {registered['v1']}\)\. " + fix.format(NAME)):
        resolve_base(workspace, f"models:/{NAME}@gone")
    with pytest.raises(UserError, match=rf"models:/{NAME}/9 names version 9, which {NAME} does not have "
                                        rf"\(its versions: 1, 2\)\. " + fix.format(NAME)):
        resolve_base(workspace, f"models:/{NAME}/9")
    # A dataset's pin to a version deleted since is refused with the data stage to re-run.
    with pytest.raises(UserError, match=r"was pinned to version 7 by the dataset's manifest.*Re-run the data stage"):
        resolve_base(workspace, f"models:/{NAME}@stable", pinned={"ref": f"models:/{NAME}@stable", "version": "7"})


def test_the_alias_is_pinned_by_the_data_stage_and_training_uses_that_version_after_it_moves(workspace, registered):
    from mlflow import MlflowClient

    from lmforge.components.config import load_config
    from lmforge.components.model.basemodel import tokenizer_hash
    from lmforge.components.registry import set_alias, version_tags
    from lmforge.components.tracking import use_workspace
    from lmforge.components.workspace import sha256_tree
    from lmforge.flows.data import data_flow
    from lmforge.flows.train import train_flow

    ref, v1, v2 = f"models:/{NAME}@stable", registered["v1"], registered["v2"]
    v1_sha = sha256_tree(registered["first"])
    assert v1_sha == version_tags(workspace, NAME, v1)["model_sha256"] != sha256_tree(registered["second"])
    cfg = load_config(TINY_CONFIG, [f"training.model.init={json.dumps(ref)}", "training.parallel.strategy=zero2",
                                    "training.max_steps=2", "training.save_every=2", "training.precision=fp32"])
    data = data_flow(cfg)
    dataset = workspace.dataset_dir(data["dataset_version"])
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["source"]["base"] == {"ref": ref, "version": v1}
    assert tokenizer_hash(dataset / "tokenizer") == tokenizer_hash(registered["first"])
    assert json.loads((dataset / "report.json").read_text())["tokenizer_from"] == ref

    set_alias(workspace, NAME, "stable", v2, reason="moved between data and train")
    out = train_flow(cfg)
    export = Path(out["export"])
    base = json.loads((export / "lmforge.json").read_text())["base"]
    assert (base["ref"], base["version"], base["sha256"]) == (ref, v1, v1_sha)
    assert Path(base["path"]).is_relative_to(workspace.root / "registry" / NAME / v1)
    # The ranks were handed version 1's downloaded folder, not the reference and not version 2's.
    request = json.loads((workspace.run_dir(out["run"]) / "request-0.json").read_text())
    assert request["training"]["model"]["init"] == base["path"]

    use_workspace(workspace)
    run = MlflowClient().get_run(out["mlflow_run_id"])
    tags = run.data.tags
    assert (tags["base.ref"], tags["base.version"], tags["base.sha256"]) == (ref, v1, v1_sha)
    assert run.data.params["model.init"] == ref

    # A dataset made after the move pins version 2: another dataset version, since the pin is part of it.
    again = data_flow(cfg)
    assert again["dataset_version"] != data["dataset_version"]
    manifest2 = json.loads((workspace.dataset_dir(again["dataset_version"]) / "manifest.json").read_text())
    assert manifest2["source"]["base"] == {"ref": ref, "version": v2}
