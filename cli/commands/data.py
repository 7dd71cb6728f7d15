"""`lmforge data replay`: re-ingest quarantined records after a person fixed them.

    lmforge data replay .lmforge/datasets/<version>/quarantine.jsonl   # fixed copy or the file itself
    lmforge data replay fixed.jsonl --config configs/demo.toml --set data.source=corpus.jsonl --json

Each entry of the quarantine file is read back through the parser of its format (a JSONL
line, a CSV row, a Parquet row, a docstring, a .txt or .py file) from its `raw` (or
`raw_b64`) field, which is what a person edits. The data stage then runs on the configured
source plus these records, and a new dataset version is published. Entries that are still
bad are quarantined again, with their reason. Exit 0 when every entry was taken, 1 when
some are still bad (the dataset is published all the same), 2 for a bad file or config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from lmforge.cli.commands import ConfigOpt, JsonOpt, SetOpt
from lmforge.cli.output import emit_json, json_mode
from lmforge.components.errors import UserError
from lmforge.components.workspace import Workspace

app = typer.Typer(no_args_is_help=True, help="Data stage tools: replay fixed quarantined records.")
err = Console(stderr=True)



def replayed_counts(quarantine_file: Path, dataset_quarantine: Path) -> dict[str, int]:
    """How many entries of `quarantine_file` came back clean, judged by the new dataset's quarantine."""
    from lmforge.components.data.quarantine import iter_quarantine

    entries = sum(1 for _ in iter_quarantine(quarantine_file))
    still_bad = sum(1 for q in iter_quarantine(dataset_quarantine) if q.origin.startswith("replay:"))
    return {"entries": entries, "still_quarantined": still_bad, "taken": entries - still_bad}


@app.command()
def replay(
    quarantine_file: Annotated[Path, typer.Argument(help="a quarantine.jsonl whose 'raw' fields were fixed")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run the data stage on the source plus the fixed quarantined records; publish the new version."""
    from lmforge.components.config import load_config
    from lmforge.components.data.ingest import check_source
    from lmforge.components.data.quarantine import read_quarantine

    path = quarantine_file.expanduser()
    if not path.is_file():
        raise UserError("quarantine file", path, "does not exist",
                        "Pass the quarantine.jsonl of a dataset (datasets/<version>/quarantine.jsonl) or a fixed copy of it")
    entries = read_quarantine(path)  # a malformed file fails here, in one line, before Prefect starts
    if not entries:
        raise UserError("quarantine file", path, "holds no entries", "Nothing to replay")
    cfg = load_config(config, set_ or [])
    check_source(cfg.data.source)
    from lmforge.cli.work import WorkFailed, start_work, the_work

    ws = Workspace.from_env()
    start_work(ws)
    from lmforge.flows.data import data_flow

    with json_mode(as_json):
        with the_work():
            result = data_flow(cfg, replay=[str(path.resolve())])
    counts = replayed_counts(path, ws.dataset_dir(result["dataset_version"]) / "quarantine.jsonl")
    out = {"dataset_version": result["dataset_version"], "replay": counts, "summary": result["summary"]}
    if as_json:
        emit_json(out)
    else:
        err.print(f"replayed {counts['taken']} of {counts['entries']} quarantined records into dataset "
                  f"{result['dataset_version']}; {counts['still_quarantined']} still quarantined")
    if counts["still_quarantined"]:
        raise WorkFailed(f"{counts['still_quarantined']} of {counts['entries']} replayed records are still bad: "
                         f"see {ws.dataset_dir(result['dataset_version']) / 'quarantine.jsonl'} (origins start with 'replay:')")
