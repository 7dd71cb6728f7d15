"""The base of every config section: unknown keys are errors, values are immutable; and the `Name` type.

    class RegistryConfig(Section):
        model_name: Name = Field("lmforge-lm", description="registered model name")

`Name` is for every config string that becomes a folder, a file name or part of a query
(MLflow filter strings, Triton model names, registry aliases, run folders): 1 to 64
letters, digits, '.', '_' or '-', starting with a letter or digit. So "..", "/abs",
"a/b", quotes and control characters fail at load time, naming the key, instead of
escaping the workspace or a quoted string later.
"""

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"  # whole string (re.fullmatch): a first character that is no dot
NAME_RULE = "1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"


def check_name(value: str) -> str:
    # fullmatch, not `^...$`: Python's $ also matches before a final newline
    if not re.fullmatch(NAME_PATTERN, value):
        raise PydanticCustomError("name", "not a name ({rule}): it becomes a folder and part of a query string",
                                  {"rule": NAME_RULE})
    return value


Name = Annotated[str, AfterValidator(check_name)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
