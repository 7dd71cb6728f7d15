"""The MLflow model registry: register without pickles, aliases with an audit trail, gated promotion.

    from lmforge.components.registry import register_model, download_model, set_alias, gate, rollback, history
    v = register_model(ws, cfg.registry, export_dir, metrics=result.metrics, tags={...})
    d = gate(ws, cfg.registry, v, result.metrics)           # challenger always; champion if the rules pass
    path = download_model(ws, cfg.registry.model_name, "champion")
    set_alias(ws, cfg.registry.model_name, production_alias(cfg.deploy.name), v, reason="rolled out")

Modules: store.py (log, register, read, download), aliases.py (moves, rollback), claim.py
(the store-granted claim that serialises alias moves), audit.py (the audit trail artifact),
gate.py (promotion rules; production_alias, the serving alias of a deployment target),
travel.py (the dataset bundle that travels with a version: records, token counts, the
evaluation set by hash), loading.py (safetensors-only loading), retry.py.
MLflow is imported inside the functions, so importing this package is cheap.
"""

from lmforge.components.registry.aliases import AliasMove, current, history, rollback, set_alias
from lmforge.components.registry.gate import Decision, decide, gate, production_alias
from lmforge.components.registry.loading import load_causal_lm
from lmforge.components.registry.store import (
    download_model,
    list_versions,
    register_model,
    resolve_version,
    version_metrics,
    version_tags,
)

__all__ = ["AliasMove", "Decision", "current", "decide", "download_model", "gate", "history", "list_versions",
           "load_causal_lm", "production_alias", "register_model", "resolve_version", "rollback", "set_alias",
           "version_metrics", "version_tags"]
