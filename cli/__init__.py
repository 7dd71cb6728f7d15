"""The `lmforge` command line: `cli.py` (the app and its conventions), `commands/` (command groups),
`output.py` (--json), `summary.py` (what a run printed), `status.py` (`lmforge status`).

It drives the flows in `lmforge.flows`; nothing under `lmforge.flows` imports it back.

    python -m lmforge.cli run all --config tiny
"""
