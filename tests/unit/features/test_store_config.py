"""A broken feature_store.yaml, a missing repo or a conflicting LMFORGE_HOME is a one-line UserError."""

from __future__ import annotations

import shutil

import pytest

from lmforge.components.errors import UserError
from lmforge.components.features.store import REPO_DEFAULT, YAML_NAME, check_repo_config, pin_workspace, repo_path
from lmforge.components.sections.features import FeaturesConfig

GOOD = (REPO_DEFAULT / YAML_NAME).read_text()


def broken_repo(tmp_path, text: str):
    repo = tmp_path / "repo"
    shutil.copytree(REPO_DEFAULT, repo, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / YAML_NAME).write_text(text)
    return repo / YAML_NAME


def test_the_projects_yaml_is_valid(workspace):
    pin_workspace(workspace)
    config = check_repo_config(REPO_DEFAULT / YAML_NAME)
    assert config.project == "lmforge"
    assert config.registry.path == f"{workspace.root}/features/registry.db"
    assert config.online_store.path == f"{workspace.root}/features/online_store.db"


@pytest.mark.parametrize("edit, key", [
    (("type: sqlite", "type: sqlite\n  bogus_option: 1"), "online_store.bogus_option"),
    (("entity_key_serialization_version: 3", "entity_key_serialization_version: banana"), "entity_key_serialization_version"),
    (("provider: local", "provider: [local"), "line"),
    (("${LMFORGE_HOME}/features/online_store.db", "${NO_SUCH_LMFORGE_VAR}/x.db"), "online_store.path"),
])
def test_a_broken_yaml_names_the_file_and_the_key(workspace, tmp_path, edit, key):
    pin_workspace(workspace)
    path = broken_repo(tmp_path, GOOD.replace(*edit))
    with pytest.raises(UserError) as err:
        check_repo_config(path)
    message = str(err.value)
    assert str(path) in message and key in message and "\n" not in message


def test_a_repo_without_yaml_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="features.repo"):
        repo_path(FeaturesConfig(repo=str(tmp_path)))


def test_lmforge_home_naming_another_workspace_is_refused(workspace, monkeypatch, tmp_path):
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "elsewhere"))
    with pytest.raises(UserError, match="LMFORGE_HOME"):
        pin_workspace(workspace)


def test_definitions_refuse_to_guess_the_workspace(monkeypatch):
    from lmforge.components.features.store import DEFINITIONS, _import_file

    monkeypatch.delenv("LMFORGE_HOME", raising=False)
    with pytest.raises(RuntimeError, match="LMFORGE_HOME is not set"):
        _import_file(REPO_DEFAULT / DEFINITIONS)


def test_definitions_without_the_quality_view_are_a_user_error(workspace, tmp_path):
    from lmforge.components.features.store import load_definitions

    repo = broken_repo(tmp_path, GOOD).parent
    (repo / "feature_definitions.py").write_text(
        "from feast import Entity, ValueType\n"
        "document = Entity(name='document', join_keys=['doc_id'], value_type=ValueType.STRING)\n")
    with pytest.raises(UserError, match="defines no 'document_quality' feature view"):
        load_definitions(workspace, FeaturesConfig(repo=str(repo)))
