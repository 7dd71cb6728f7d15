"""training.model.init as a registry reference: the shapes accepted and refused at config load, and what a
registered base adds to the lineage. Resolving against a real registry: tests/integration/test_finetune_registry_base.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.components.config import load_config
from lmforge.components.errors import UserError
from lmforge.components.model.basemodel import BaseCheckpoint, check_base
from lmforge.components.sections.training import RegistryRef, parse_registry_ref
from tests.conftest import TINY_CONFIG


@pytest.mark.parametrize("init, ref", [
    ("models:/lmforge-lm@champion", RegistryRef(name="lmforge-lm", alias="champion")),
    ("models:/lmforge-lm/3", RegistryRef(name="lmforge-lm", version="3")),
    ("models:/a.b_c-1@prod-2", RegistryRef(name="a.b_c-1", alias="prod-2")),
    ("/models/qwen2", None),            # a folder
    ("models/qwen2", None),             # a relative folder that merely starts like one
])
def test_references_parse_and_folders_are_left_alone(init, ref):
    assert parse_registry_ref(init) == ref
    if ref is not None:
        assert str(ref) == init


@pytest.mark.parametrize("init, problem", [
    ("models:/lmforge-lm", "names no alias or version"),
    ("models:/lmforge-lm/0", "version '0', which is not a positive integer"),
    ("models:/lmforge-lm/latest", "version 'latest', which is not a positive integer"),
    ("models:/lmforge-lm/3/x", r"version '3/x', which is not a positive integer"),
    ("models:/../2", r"model name '\.\.', which is not a name"),
    ("models:/a'b@x", r"model name \"a'b\", which is not a name"),
    ("models:/@champion", "model name '', which is not a name"),
    ("models:/lmforge-lm@", "alias '', which is not an alias name"),
    ("models:/lmforge-lm@a/b", "alias 'a/b', which is not an alias name"),
    ("models:/lmforge-lm@3", "alias '3', which is a number: for a version write models:/lmforge-lm/3"),
])
def test_a_bad_reference_is_refused_at_load_naming_the_key_and_the_shapes(init, problem):
    with pytest.raises(UserError, match=rf"training\.model\.init: .* is invalid: a registry reference that .*{problem}"):
        load_config(TINY_CONFIG, [f"training.model.init={json.dumps(init)}"])


def test_a_good_reference_loads_and_keeps_the_size_rules():
    cfg = load_config(TINY_CONFIG, ['training.model.init="models:/lmforge-lm@champion"'])
    assert cfg.training.model.init == "models:/lmforge-lm@champion"
    with pytest.raises(UserError, match="cannot be set together with init"):
        load_config(TINY_CONFIG, ['training.model.init="models:/lmforge-lm/2"', "training.model.hidden_size=32"])


def test_check_base_sends_a_reference_to_resolve_base():
    with pytest.raises(UserError, match=r"models:/m@champion is a registry reference, not a folder.*resolve_base"):
        check_base("models:/m@champion")


def test_a_registered_base_names_its_reference_and_version_in_the_lineage(tmp_path):
    folder = BaseCheckpoint(path=Path(tmp_path), model_type="qwen2", architecture="Qwen2ForCausalLM",
                            tokenizer_sha256="t" * 64, vocab_size=8)
    (tmp_path / "config.json").write_text("{}")
    assert "ref" not in folder.lineage() and folder.pin() is None and folder.named == str(tmp_path)
    registered = BaseCheckpoint(path=Path(tmp_path), model_type="qwen2", architecture="Qwen2ForCausalLM",
                                tokenizer_sha256="t" * 64, vocab_size=8, ref="models:/m@champion", version="3")
    lineage = registered.lineage()
    assert (lineage["ref"], lineage["version"], lineage["sha256"]) == ("models:/m@champion", "3", folder.sha256)
    assert registered.pin() == {"ref": "models:/m@champion", "version": "3"} and registered.named == "models:/m@champion"
