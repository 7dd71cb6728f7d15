"""The pipeline config: one TOML table per stage, read into pydantic models.

    cfg = load_config("configs/demo.toml", ["training.max_steps=20", "data.source=/corpus.jsonl"])
    cfg = load_config("tiny")  # a config shipped with lmforge (components/runtime/resources.py); None is "demo"
    cfg.data.source            # the [data] table is a DataConfig
    config_hash(cfg.training)  # stable hash of one section, recorded on every artifact it makes

Precedence: `--set section.key=value` > file > the models' defaults. A value in `--set`
is read as a TOML value when it parses as one (`3`, `0.5`, `true`, `[1, 2]`, `"x"`), and
as a plain string otherwise. Any unknown key or bad value fails here, at load time,
with the key, the value and what was expected.

Each section's model lives in `components/sections/<stage>.py`, one file per table, so
that a stage's options are read in one screen.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from lmforge.components.errors import UserError
from lmforge.components.runtime.resources import resolve_config
from lmforge.components.sections._base import Name, Section
from lmforge.components.sections.compression import CompressionConfig
from lmforge.components.sections.data import DataConfig
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.sections.evaluation import EvaluationConfig
from lmforge.components.sections.features import FeaturesConfig
from lmforge.components.sections.monitoring import MonitoringConfig
from lmforge.components.sections.registry import RegistryConfig
from lmforge.components.sections.task import TaskConfig
from lmforge.components.sections.training import TrainingConfig
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.workspace import sha256_json


class PipelineConfig(Section):
    """The root: one field per stage table."""

    name: Name = Field("lmforge", description="a label for runs and reports; it names training run folders")
    task: TaskConfig = TaskConfig()
    data: DataConfig = DataConfig()
    features: FeaturesConfig = FeaturesConfig()
    vectors: VectorsConfig = VectorsConfig()
    training: TrainingConfig = TrainingConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    registry: RegistryConfig = RegistryConfig()
    compression: CompressionConfig = CompressionConfig()
    deploy: DeployConfig = DeployConfig()
    monitoring: MonitoringConfig = MonitoringConfig()

    @model_validator(mode="after")
    def _gated_benchmarks_are_run(self) -> "PipelineConfig":
        missing = [r.task for r in self.registry.gate_benchmarks if r.task not in self.evaluation.benchmarks.tasks]
        if missing:
            raise ValueError(f"registry.gate_benchmarks names {', '.join(missing)}, which evaluation.benchmarks.tasks "
                             "does not run; add it there, or remove the rule")
        return self


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Read `path` (a TOML file or a packaged config name; default: the packaged demo), apply `overrides`, validate."""
    path = resolve_config(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UserError(str(path), None, f"is not valid TOML ({e})", "Fix the syntax at that line") from e
    for item in overrides:
        _apply_override(raw, item)
    return validate_config(raw, source=str(path))


def as_config(cfg: "PipelineConfig | str | Path | dict[str, Any] | None") -> PipelineConfig:
    """What a flow parameter may hold: a config, a TOML path or packaged name, a dict, or None for the demo config.

    Prefect deployments pass a path (`--param cfg=configs/tiny.toml`); Python callers pass the model.
    """
    if isinstance(cfg, PipelineConfig):
        return cfg
    if isinstance(cfg, dict):
        return validate_config(cfg)
    return load_config(cfg)


def validate_config(raw: dict[str, Any], *, source: str = "<config>") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise UserError(*_describe(e, raw, source)) from e


def config_hash(section: Section) -> str:
    """A short, stable hash of a config section (its JSON form, keys sorted)."""
    return sha256_json(section.model_dump(mode="json"))[:16]


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError("--set", item, "is not of the form section.key=value", "Write it like --set training.max_steps=20")
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"--set {key}", text, f"cannot be set because {part} is a value, not a table")
        node = child
    node[parts[-1]] = _parse_value(text.strip())


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _describe(e: ValidationError, raw: dict[str, Any], source: str) -> tuple[str, Any, str, str]:
    """Turn pydantic's first error into (key, value, problem, fix) for a one-line message."""
    err = e.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    value = err.get("input")
    if err["type"] == "extra_forbidden":
        known = _known_keys(err["loc"][:-1])
        return (key, None, f"is not a known option (in {source})",
                f"Known keys here: {', '.join(known)}" if known else "Remove it")
    return (key, repr(value), f"is invalid: {_lower_first(err['msg'])} (in {source})",
            "Change the value in the file or with --set")


def _lower_first(msg: str) -> str:
    """pydantic's "Input should be ..." reads as "input should be ..." mid-sentence; the rest (a pattern) stays as it is."""
    return msg[:1].lower() + msg[1:]


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[Section] = PipelineConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, Section)):
            return []
        model = field.annotation
    return sorted(model.model_fields)
