"""How lmforge commands write: `--json` prints one JSON document and nothing else on stdout.

    with json_mode(as_json):      # inside, print() and rich output go to stderr when as_json
        result = do_work()
    if as_json:
        emit_json(result)         # the only thing on stdout
    else:
        console.print(...)

Errors are not written here: cli/cli.py prints them on stderr as one line.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any


def emit_json(obj: Any) -> None:
    """One JSON document on stdout (values JSON cannot hold are written as strings)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def json_mode(as_json: bool) -> Iterator[None]:
    """While `as_json`, send what the work prints to stderr, so that stdout holds only the JSON."""
    if not as_json:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield
