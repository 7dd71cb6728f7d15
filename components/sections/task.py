"""The [task] table: how a prompt is rendered, when generation stops and what is scored (components/serving/task.py).

    [task]
    kind = "chat"            # "completion", "chat", the demo's "docstring", or "auto" (default): what the data holds
    stop = ["\\n\\n"]          # stop sequences beyond eos
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ._base import Section


class TaskConfig(Section):
    """The task every stage renders, stops and scores the same way; it is recorded in the exported model's lmforge.json."""

    kind: Literal["auto", "completion", "chat", "docstring"] = Field(
        "auto", description="completion: the prompt as given, the whole completion scored; chat: messages through the "
                          "tokenizer's chat template, the assistant turn scored; docstring: the demo preset (a "
                          "signature, stop at the docstring close, first sentence scored). auto = from the data: "
                          "messages are chat, the built-in corpus is docstring, pairs and text are completion")
    stop: list[str] = Field(default_factory=list, description="stop sequences beyond eos (the docstring preset adds "
                                                              "its closing quotes)")

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("an empty stop sequence would end every generation at once; remove it")
        return v
