"""The MLflow pyfunc model of a registered lmforge model ("models from code": no pickle).

MLflow stores this file's source beside the model and runs it on `mlflow.pyfunc.load_model`;
the weights are the registered model folder (artifact "hf"), read from safetensors, and
the code that loads and runs them is the model's own `lmforge_runtime/` (code_paths):

    m = mlflow.pyfunc.load_model("models:/lmforge-lm@champion")
    m.predict(["def add(a, b):"])                              # ["Return a plus b.", ...]
    m.predict(["def add(a, b):"], params={"max_new_tokens": 16, "output": "completion"})
    m.predict(["def add(a, b):"], params={"output": "token_ids"})   # ["17 402 9", ...]: the generated ids

A prompt is a signature (or an already templated `generation_prompt`); the answer is the
summary that evaluation scores, or with `output = "completion"` the whole continuation.
Loading and generation are lmforge_runtime's modelload.py and generation.py, the same
code Triton's model runs and evaluation calls, so an int8 or low-rank variant loads as
what it is and the three give the same tokens. It imports only torch, transformers and
mlflow, so it runs where lmforge is not installed (an `mlflow models serve` container).
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
from mlflow.models import set_model

OUTPUTS = ("summary", "completion", "token_ids")


def _runtime() -> tuple[Any, Any]:
    """(modelload, generation): the copy stored with the model first, lmforge's own when there is none."""
    try:
        from lmforge_runtime import generation, modelload  # type: ignore[import-not-found]
    except ImportError:
        from lmforge.components import generation, modelload
    return modelload, generation


class LmforgeTextGenerator(mlflow.pyfunc.PythonModel):
    """Greedy continuation of each prompt under lmforge's one generation path."""

    def load_context(self, context: Any) -> None:
        modelload, self.gen = _runtime()
        path = context.artifacts["hf"]
        self.model = modelload.load_model(path)
        self.tokenizer = modelload.load_tokenizer(path)

    # No type hints here: MLflow would derive a second signature from them; the logged one is the contract.
    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        params = params or {}
        max_new = int(params.get("max_new_tokens", 32))
        output = str(params.get("output", "summary"))
        if output not in OUTPUTS:
            raise ValueError(f"params.output is {output!r}; use one of {', '.join(OUTPUTS)}")
        encoded = [self.gen.encode_prompt(self.tokenizer, p) for p in _as_strings(model_input)]
        outs = self.gen.generate(self.model, self.tokenizer, encoded, max_new_tokens=max_new) if encoded else []
        return [o.summary if output == "summary" else o.text if output == "completion"
                else " ".join(str(t) for t in o.token_ids) for o in outs]


def _as_strings(model_input: Any) -> list[str]:
    if hasattr(model_input, "iloc"):  # a pandas DataFrame or Series from the scoring server
        frame = model_input if model_input.ndim == 2 else model_input.to_frame()
        return [str(v) for v in frame.iloc[:, 0].tolist()]
    if isinstance(model_input, str):
        return [model_input]
    return [str(v) for v in model_input]


set_model(LmforgeTextGenerator())
