"""Package data is found through importlib.resources: packaged configs by name, the Feast repo, prefect.yaml."""

from __future__ import annotations

import subprocess

import pytest

from lmforge.components.config import load_config
from lmforge.components.errors import UserError
from lmforge.components.runtime import resources


def test_packaged_configs_load_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                      # no configs/ here
    assert {"demo", "tiny"} <= set(resources.packaged_configs())
    assert load_config("tiny").name == load_config("tiny.toml").name
    assert load_config("configs/tiny.toml").name == load_config(resources.packaged_config("tiny")).name
    assert load_config(None).name == load_config("demo").name


def test_a_file_in_the_current_folder_wins_over_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.toml").write_text('name = "mine"\n')
    assert load_config("configs/tiny.toml").name == "mine"


@pytest.mark.parametrize("value", ["nosuch", "configs/nosuch.toml", "/no/such/file.toml"])
def test_an_unknown_config_names_the_packaged_ones(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="demo, scaleout.example, tiny"):
        load_config(value)


def test_feature_repo_and_prefect_yaml_are_real_files():
    assert (resources.feature_repo_dir() / "feature_store.yaml").is_file()
    assert (resources.feature_repo_dir() / "feature_definitions.py").is_file()
    text = resources.prefect_yaml().read_text()
    assert "entrypoint: lmforge.flows.pipeline.pipeline_flow" in text and "flows/pipeline.py" not in text


def test_source_commit_is_the_checkouts_head():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=resources.feature_repo_dir(), capture_output=True,
                          text=True).stdout.strip()
    assert resources.source_commit() == head
