"""The configuration reference page, generated from the pydantic sections (components/sections/*.py).

    from config_reference import reference_markdown, sections
    text = reference_markdown()          # markdown: one table per section, nested sections included
    [(path, model) for path, model in sections()]   # ("", PipelineConfig), ("task", TaskConfig), ...

scripts/docs_hooks.py puts the text into the MkDocs site as reference/configuration.md when the
site is built; tests/unit/test_docs.py checks that every field of every section is in it.
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from lmforge.components.config import PipelineConfig
from lmforge.components.sections._base import check_name

PAGE_TITLE = "Configuration reference"


def is_section(annotation: Any) -> bool:
    """True when a field's annotation is a nested section (a pydantic model): it gets a table of its own."""
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def sections(model: type[BaseModel] = PipelineConfig, path: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """Every section under `model`, depth first, with its dotted TOML path ("" for the root)."""
    yield path, model
    for name, field in model.model_fields.items():
        if is_section(field.annotation):
            yield from sections(field.annotation, f"{path}.{name}" if path else name)


def table_name(path: str) -> str:
    """How the section is written in a TOML file: `[training.parallel]`; the root's keys sit above every table."""
    return f"`[{path}]`" if path else "top level"


def anchor(path: str) -> str:
    """The heading id of a section's table (set explicitly, so links do not depend on the slugifier)."""
    return "cfg-" + (path.replace(".", "-").replace("_", "-") if path else "root")


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        base, *meta = typing.get_args(annotation)
        if any(getattr(m, "func", None) is check_name for m in meta):
            return "name"
        return _type_name(base)
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(f'"{m.value}"' for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", "≥"), (annotated_types.Lt, "lt", "<"),
           (annotated_types.Le, "le", "≤"), (annotated_types.MinLen, "min_length", "length ≥"))


def field_type(field: FieldInfo) -> str:
    """The field's type as a reader writes it in TOML, with its bounds: `int, ≥ 1, ≤ 256`; `name` for a Name."""
    if any(getattr(m, "func", None) is check_name for m in field.metadata):
        text = "name"
    else:
        text = _type_name(field.annotation)
    bounds = []
    for meta in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                bounds.append(f"{sign} {getattr(meta, attr)}")
        pattern = getattr(meta, "pattern", None)
        if pattern:
            bounds.append(f"matches `{pattern}`")
    return ", ".join([text, *bounds])


def field_default(field: FieldInfo) -> str:
    """The default as TOML would spell it; `unset` for None, `required` when there is none."""
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list | tuple):
        return "`[" + ", ".join(f'"{v}"' if isinstance(v, str) else repr(v) for v in value) + "]`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v!r}" for k, v in value.items()) + "}`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def section_markdown(path: str, model: type[BaseModel]) -> str:
    """One section: a heading naming its TOML table, its docstring's first paragraph, and a field table."""
    doc = inspect.cleandoc(model.__doc__ or "").split("\n\n")[0]
    lines = [f"## {table_name(path)} {{ #{anchor(path)} }}", "", f"`{model.__name__}` ({model.__module__}). {_cell(doc)}", "",
             "| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if is_section(field.annotation):
            child = f"{path}.{name}" if path else name
            lines.append(f"| `{name}` | table | see [{table_name(child)}](#{anchor(child)}) | "
                         f"{_cell(field.description or inspect.cleandoc(field.annotation.__doc__ or '').split(chr(10))[0])} |")
        else:
            lines.append(f"| `{name}` | {_cell(field_type(field))} | {_cell(field_default(field))} | "
                         f"{_cell(field.description or '')} |")
    return "\n".join(lines)


def reference_markdown() -> str:
    """The whole page: an introduction, then one table per section of PipelineConfig, nested sections included."""
    intro = [
        f"# {PAGE_TITLE}",
        "",
        "Generated when the site is built (`scripts/config_reference.py`, called by the MkDocs hook",
        "`scripts/docs_hooks.py`) from the pydantic models in `components/sections/*.py`, which",
        "`components/config.py` assembles into `PipelineConfig`. So it lists exactly the keys a config",
        "file may hold; an unknown key is an error at load time.",
        "",
        "One TOML table per section. A nested section is a sub-table, written `[training.parallel]`",
        "or as dotted keys (`parallel.strategy = \"zero3\"` under `[training]`). On the command line any",
        "key is `--set section.key=value`, which wins over the file, which wins over the defaults below.",
        "",
        "Sections: " + ", ".join(f"[{table_name(p)}](#{anchor(p)})" for p, _ in sections()) + ".",
    ]
    return "\n\n".join(["\n".join(intro), *(section_markdown(p, m) for p, m in sections())]) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
