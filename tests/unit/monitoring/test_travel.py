"""What travels with a registered version: its dataset bundle, read back where the dataset is not (real MLflow).

A version registered with its bundle is monitored from the registry once its dataset is gone from the
workspace: same records, same rare-token ids as the shards gave. A damaged download is refused by
hash; a version that carries no bundle and whose dataset is not here is refused with the fix. Each
deployment target names its own serving alias.
"""

from __future__ import annotations

import shutil

import pytest

from lmforge.components.config import load_config
from lmforge.components.errors import UserError
from tests.conftest import TINY_CONFIG
from tests.unit.monitoring.dataset import make_dataset, serve


def test_each_deployment_target_names_its_own_alias():
    from lmforge.components.registry.gate import production_alias
    from lmforge.components.sections.deploy import DeployConfig

    assert production_alias(DeployConfig().name) == "production"    # registries made before names keep theirs
    assert production_alias(DeployConfig(name="eu-1").name) == "production-eu-1"
    with pytest.raises(ValueError, match="name"):
        DeployConfig(name="eu.1")                                       # an MLflow alias holds no dot


def test_a_version_is_monitored_from_what_travelled_once_its_dataset_is_gone(workspace, tiny_model_dir):
    from lmforge.components.registry import register_model, set_alias
    from lmforge.components.registry.travel import check_bundle, fetch_dataset_bundle, log_dataset_bundle
    from lmforge.components.tracking import start_run
    from lmforge.deploy.deployment import shards_for
    from lmforge.deploy.repository import rare_ids_from, rare_token_ids
    from lmforge.monitoring.served import served_model, served_rare_ids

    cfg = load_config(TINY_CONFIG, ["deploy.name=eu"])
    version = make_dataset(workspace, tiny_model_dir)
    rare = frozenset(rare_token_ids(workspace.training_shards(version), cfg.deploy.rare_token_min_count))
    records = (workspace.dataset_dir(version) / "records" / "validation.jsonl").read_text()
    src = workspace.root / "model"
    shutil.copytree(tiny_model_dir, src)
    (src / "lmforge.json").write_text(f'{{"dataset_version": "{version}"}}')
    with start_run(workspace, "evaluation"):
        ref = log_dataset_bundle(workspace, version, eval_split="test")
        v = register_model(workspace, cfg.registry, src, metrics={}, tags={})
    set_alias(workspace, cfg.registry.model_name, "production-eu", v, reason="test: serving on eu")

    here = served_model(workspace, cfg)
    assert here.source == "workspace" and served_rare_ids(workspace, here, cfg.deploy.rare_token_min_count) == rare
    shutil.rmtree(workspace.dataset_dir(version))           # as in a workspace that never made it
    away = served_model(workspace, cfg)
    assert (away.source, away.dataset_version, away.version) == ("registry", version, v)
    assert (away.records / "validation.jsonl").read_text() == records
    assert served_rare_ids(workspace, away, cfg.deploy.rare_token_min_count) == rare
    source = shards_for(workspace, away.model_dir, cfg.registry.model_name, int(v))   # what Triton's list is built from
    assert source == away.travelled and rare_ids_from(source, cfg.deploy.rare_token_min_count) == sorted(rare)
    assert check_bundle(away.travelled, "v")["eval_set_sha256"] == ref["eval_set_sha256"]

    assert fetch_dataset_bundle(workspace, cfg.registry.model_name, v) == away.travelled   # the cached copy
    variant = register_model(workspace, cfg.registry, src, metrics={}, tags={}, parent_version=v)   # no bundle
    assert fetch_dataset_bundle(workspace, cfg.registry.model_name, variant) == away.travelled  # its parent's
    (away.records / "test.jsonl").write_text("{}\n")        # a damaged copy is refused by its hash, with the fix
    with pytest.raises(UserError, match=f"hashes to .* Delete {away.travelled}"):
        served_model(workspace, cfg)


def test_a_version_with_no_dataset_here_and_none_travelled_is_refused_with_the_fix(workspace, tiny_model_dir):
    from lmforge.monitoring.served import served_model

    cfg = load_config(TINY_CONFIG)
    serve(workspace, tiny_model_dir, "elsewhere", model_name=cfg.registry.model_name)   # no bundle logged
    with pytest.raises(UserError, match="none travelled") as e:
        served_model(workspace, cfg)
    assert "dataset_version=elsewhere" in str(e.value) and "lmforge run evaluate" in str(e.value)


def test_gating_on_the_champions_set_refuses_a_champion_that_carries_none(workspace, tiny_model_dir):
    from lmforge.components.registry import set_alias
    from lmforge.flows.evaluate import on_champion_set

    cfg = load_config(TINY_CONFIG, ["evaluation.gate_set=champion"])
    assert on_champion_set(workspace, cfg, tiny_model_dir, 64) is None          # no champion: nothing to compare
    v = serve(workspace, tiny_model_dir, "elsewhere", model_name=cfg.registry.model_name)   # registered, no bundle
    set_alias(workspace, cfg.registry.model_name, "champion", v, reason="test: champion without a set")
    with pytest.raises(UserError, match=f"champion v{v}'s evaluation set, and none travelled") as e:
        on_champion_set(workspace, cfg, tiny_model_dir, 64)
    assert 'evaluation.gate_set = "candidate"' in str(e.value)
