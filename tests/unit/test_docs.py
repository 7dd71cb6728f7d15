"""The documentation: the generated configuration reference covers every key, and the README stays short and linked.

The reference page is made by scripts/config_reference.py when the site is built (scripts/docs_hooks.py);
`make docs` builds the site with --strict, which fails on a broken link inside docs/.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from lmforge.components.config import PipelineConfig

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def _config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fields(model: type[BaseModel], path: str = "") -> list[tuple[str, str]]:
    """(section path, field name) for every field of `model` and of the sections nested in it, walked here, not
    with the generator's own walk."""
    out = []
    for name, field in model.model_fields.items():
        out.append((path, name))
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out += _fields(field.annotation, f"{path}.{name}" if path else name)
    return out


def _missing(markdown: str) -> list[str]:
    """The dotted keys of PipelineConfig with no row in their section's table of `markdown`."""
    rows: dict[str, set[str]] = {}
    section = None
    for line in markdown.splitlines():
        heading = re.match(r"## (?:`\[(.+?)\]`|(top level))", line)
        if heading:
            section = heading.group(1) or ""
            rows.setdefault(section, set())
        row = re.match(r"\| `([A-Za-z0-9_]+)` \|", line)
        if row and section is not None:
            rows[section].add(row.group(1))
    return [f"{path}.{name}" if path else name for path, name in _fields(PipelineConfig)
            if name not in rows.get(path, set())]


def test_every_field_of_every_section_is_in_the_configuration_reference():
    text = _config_reference().reference_markdown()
    assert len(_fields(PipelineConfig)) > 200      # the walk reached the nested sections
    assert _missing(text) == []


def test_the_check_notices_a_field_left_out_of_the_reference():
    text = _config_reference().reference_markdown()
    dropped = "\n".join(line for line in text.splitlines() if not line.startswith("| `nvme_path` |"))
    assert _missing(dropped) == ["training.parallel.nvme_path"]


def test_the_reference_gives_type_default_and_description():
    text = _config_reference().reference_markdown()
    assert "| field | type | default | description |" in text
    assert re.search(r"\| `max_steps` \| int, ≥ 1[^|]* \| `\d+` \| \S", text)
    assert '| `strategy` | "ddp" \\| "zero1"' in text      # a Literal lists its choices


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_the_readme_is_at_most_120_lines(readme):
    assert len(readme.splitlines()) <= 120


def test_the_readme_shows_make_demo_and_make_test_before_any_other_code(readme):
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", readme, flags=re.M | re.S)
    assert blocks, "the README has no code block"
    first = blocks[0]
    assert "make demo" in first and "make test" in first


def test_every_relative_link_in_the_readme_resolves(readme):
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    relative = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:|#", t)]
    assert relative                                    # the README does link into the repo
    missing = [t for t in relative if not (REPO / t).exists()]
    assert missing == []
