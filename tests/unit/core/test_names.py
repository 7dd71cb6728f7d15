"""Config strings that become folders, file names or query strings are names: checked by pattern at load time."""

import pytest

from lmforge.components.config import load_config
from lmforge.components.errors import UserError
from lmforge.components.sections._base import NAME_PATTERN

# every key whose value names a folder, a file, an MLflow/Prefect/Triton/Qdrant object or goes into a query
NAME_KEYS = ["name", "registry.model_name", "deploy.model_name", "training.run_name", "compression.source_alias",
             "vectors.collection_prefix"]
BAD = ["../x", "..", ".", "/abs", "a/b", "a\\b", "it's", 'say"hi', "nul\x00byte", "", "a b", "x" * 65, "-flag",
       "ok\n"]


def _quoted(value: str) -> str:
    """The value as a TOML basic string, as --set would be given it."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\x00", "\\u0000").replace("\n", "\\n") + '"'


@pytest.mark.parametrize("key", NAME_KEYS)
@pytest.mark.parametrize("value", BAD)
def test_a_name_that_could_escape_a_folder_or_a_query_fails_at_load(key, value):
    with pytest.raises(UserError) as e:
        load_config("tiny", [f"{key}={_quoted(value)}"])
    assert e.value.what == key
    assert str(e.value).startswith(f"{key}: ")
    assert "letters, digits" in str(e.value)  # says what a name may hold


@pytest.mark.parametrize("key", ["monitoring.training_deployment"])
@pytest.mark.parametrize("value", ["../x", "a/..", "flow/it's", 'a/b"c', "a/b\x00", "/abs", "a/b/c", "no-slash"])
def test_a_prefect_deployment_is_two_names(key, value):
    with pytest.raises(UserError) as e:
        load_config("tiny", [f"{key}={_quoted(value)}"])
    assert e.value.what == key


@pytest.mark.parametrize("key, value", [("registry.model_name", "lmforge-lm"), ("registry.model_name", "my.model_2"),
                                        ("deploy.model_name", "lmforge"), ("training.run_name", "demo-20260101-120000"),
                                        ("compression.source_alias", "champion"), ("compression.source_alias", "3"),
                                        ("monitoring.training_deployment", "train-probe/on-demand"),
                                        ("registry.model_name", "x" * 64)])
def test_ordinary_names_still_load(key, value):
    cfg = load_config("tiny", [f"{key}={_quoted(value)}"])
    section, field = key.split(".")
    assert getattr(getattr(cfg, section), field) == value


@pytest.mark.parametrize("config", ["demo", "tiny", "scaleout.example"])
def test_packaged_configs_and_defaults_pass(config):
    import re

    cfg = load_config(config)
    for key in NAME_KEYS:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        assert value is None or re.fullmatch(NAME_PATTERN, value), (key, value)


def test_registry_filter_string_cannot_be_broken_out_of():
    """Defence in depth: the MLflow filter is built from a validated name and refuses anything else."""
    from lmforge.components.registry.store import name_filter

    assert name_filter("lmforge-lm") == "name='lmforge-lm'"
    for bad in ["x' OR name LIKE '%", "../x", "a\x00"]:
        with pytest.raises(UserError, match="is not a model name"):
            name_filter(bad)
