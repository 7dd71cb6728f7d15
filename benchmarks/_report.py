"""What every benchmark writes: the machine, the versions, the command, a JSON file and a markdown table.

    write_results("pipeline", results, ["measure", "value"], rows, command="python benchmarks/bench_pipeline.py")
    # -> benchmarks/results/pipeline.json, benchmarks/results/pipeline.md, and the table on stdout (out=: elsewhere)
"""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from lmforge.components.runtime.accelerator import cpu_model

RESULTS = Path(__file__).resolve().parent / "results"
PACKAGES = ("torch", "deepspeed", "prefect", "mlflow", "feast", "qdrant-client", "whylogs", "transformers", "tritonclient")


def machine_info() -> dict[str, Any]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {"nproc": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version(), "versions": versions,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def markdown_table(headers: list[str], rows: list[tuple[Any, ...]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(name: str, results: dict[str, Any], headers: list[str], rows: list[tuple[Any, ...]], *,
                  command: str, notes: str = "", out: Path = RESULTS) -> str:
    info = results.setdefault("machine", machine_info())
    results["command"] = command
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    md = (f"### {name}\n\n{markdown_table(headers, rows)}\n\n{notes + chr(10) * 2 if notes else ''}"
          f"Machine: {info['nproc']} cores, {info['cpu']}; Python {info['python']}; {versions}. {info['date']}.\n"
          f"Command: `{command}`\n")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.json.tmp"
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    tmp.replace(out / f"{name}.json")
    (out / f"{name}.md").write_text(md)
    print(md)
    return md
