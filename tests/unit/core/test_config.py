"""The config loads, overrides take precedence, and every bad key or value fails at load time."""

from pathlib import Path

import pytest

from lmforge.components.config import PipelineConfig, as_config, config_hash, load_config
from lmforge.components.errors import UserError

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", ["demo.toml", "tiny.toml"])
def test_shipped_configs_load(name):
    cfg = load_config(REPO / "configs" / name)
    assert isinstance(cfg, PipelineConfig)


def test_override_beats_file_and_is_typed(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[data]\nmax_docs = 10\n")
    cfg = load_config(f, ["data.max_docs=20", "data.include_site_packages=true", "data.source=/x/y.jsonl"])
    assert cfg.data.max_docs == 20
    assert cfg.data.include_site_packages is True
    assert cfg.data.source == "/x/y.jsonl"


def test_unknown_key_names_the_key_and_the_known_ones(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[data]\nmax_dox = 10\n")
    with pytest.raises(UserError) as e:
        load_config(f)
    msg = str(e.value)
    assert "data.max_dox" in msg and "max_docs" in msg and str(f) in msg


def test_bad_value_names_key_value_and_expectation(tmp_path):
    with pytest.raises(UserError) as e:
        load_config(REPO / "configs" / "tiny.toml", ["data.max_docs=-1"])
    msg = str(e.value)
    assert "data.max_docs" in msg and "-1" in msg and "greater than or equal to 1" in msg


def test_unknown_section_is_an_error():
    with pytest.raises(UserError, match="trainnig"):
        load_config(REPO / "configs" / "tiny.toml", ["trainnig.max_steps=3"])


def test_malformed_override_and_missing_file():
    with pytest.raises(UserError, match="section.key=value"):
        load_config(REPO / "configs" / "tiny.toml", ["data.max_docs"])
    with pytest.raises(UserError, match="does not exist"):
        load_config("/no/such/config.toml")


def test_config_hash_is_stable_and_sensitive():
    a = load_config(REPO / "configs" / "tiny.toml")
    b = load_config(REPO / "configs" / "tiny.toml")
    c = load_config(REPO / "configs" / "tiny.toml", ["data.seed=7"])
    assert config_hash(a.data) == config_hash(b.data)
    assert config_hash(a.data) != config_hash(c.data)


def test_as_config_accepts_path_model_and_none():
    cfg = load_config(REPO / "configs" / "tiny.toml")
    assert as_config(cfg) is cfg
    assert as_config(str(REPO / "configs" / "tiny.toml")) == cfg
    assert as_config(None).name == "demo"
