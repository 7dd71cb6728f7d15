"""User-facing errors.

    raise UserError("data.source", "/no/such/path", "does not exist",
                    "Point it at a JSONL/Parquet/CSV file or a folder of .txt files.")

A `UserError` is a problem the person running lmforge can fix (a bad path, a bad
config value, a missing checkpoint). The CLI prints it on one line and exits 2,
with no traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the input, named so that a person can act on it."""

    def __init__(self, what: str, value: object | None = None, problem: str = "", fix: str = "") -> None:
        self.what, self.value, self.problem, self.fix = what, value, problem, fix
        parts = [f"{what}: "]
        if value is not None:
            parts.append(f"{value} ")
        parts.append(problem or "is invalid")
        msg = "".join(parts).rstrip() + "."
        if fix:
            msg += " " + fix.rstrip(".") + "."
        super().__init__(msg)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # Pickled by its parts, not its message: it crosses into and out of Dask workers and ranks, and
        # Exception's default (cls(*args)) would make the whole message the `what` of a new one.
        return type(self), (self.what, self.value, self.problem, self.fix)
