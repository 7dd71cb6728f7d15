"""`lmforge export onnx`: a registered version as an ONNX graph, checked against torch, recorded as its lineage.

    lmforge export onnx                        # the [deploy] alias's version (champion by default)
    lmforge export onnx 3 --tolerance 1e-4     # a version number or an alias; the logits check's bound
    lmforge export onnx challenger --json      # {"model", "version", "folder", "max_abs_diff", "artifact_uri", ...}

The graph (torch.onnx.export, dynamo=True, dynamic batch and sequence, KV cache in and out) is
written to <workspace>/onnx/<model>/<version>/ with its tokenizer and the check's report, logged
as an artifact of the version's MLflow run and tagged on the version (deploy/onnx.py). A graph whose
logits differ from torch's by more than the tolerance is an error (exit 2) and is not kept.
`[deploy] format = "onnx"` serves it (lmforge run deploy).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from lmforge.cli.commands import ConfigOpt, JsonOpt, SetOpt
from lmforge.cli.output import emit_json
from lmforge.components.workspace import Workspace

app = typer.Typer(no_args_is_help=True, help="Export a registered model to another format.")
console = Console()


@app.command("onnx")
def onnx(
    version: Annotated[str | None, typer.Argument(help="a version number or alias (default: deploy.alias)")] = None,
    tolerance: Annotated[float | None, typer.Option(
        help="largest absolute logit difference from torch (default: deploy.onnx_tolerance)")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Export the version to ONNX, check its logits against torch, and register the graph as its lineage."""
    from lmforge.components.config import load_config
    from lmforge.components.errors import UserError
    from lmforge.deploy.onnx import ensure_onnx

    cfg = load_config(config, set_ or [])
    if tolerance is not None and not 0 < tolerance <= 1:
        raise UserError("--tolerance", tolerance, "is not in (0, 1]", "Give an absolute logit difference, e.g. 1e-3")
    tol = cfg.deploy.onnx_tolerance if tolerance is None else tolerance
    ws = Workspace.from_env().ensure()
    out = ensure_onnx(ws, cfg.registry.model_name, version or cfg.deploy.alias, tolerance=tol)
    r = out.report
    if as_json:
        emit_json({"model": out.model, "version": out.version, "folder": str(out.folder), "reused": out.reused,
                   "kv_cache": r.kv_cache, "max_abs_diff": r.max_abs_diff, "tolerance": r.tolerance, "checks": r.checks,
                   "artifact_uri": out.artifact_uri, "versions": r.versions})
        return
    console.print(f"{out.model} v{out.version}: {'reused' if out.reused else 'exported'} {out.folder / 'model.onnx'} "
                  f"(KV cache in and out, dynamic batch and sequence)")
    console.print(f"logits within {r.max_abs_diff:.3g} of torch (tolerance {r.tolerance:g}) over {len(r.checks)} "
                  f"checks; lineage: {out.artifact_uri} (version tags onnx_*)")
