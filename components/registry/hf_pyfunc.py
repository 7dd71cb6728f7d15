"""The MLflow pyfunc model of a registered lmforge model ("models from code": no pickle).

MLflow stores this file's source beside the model and runs it on `mlflow.pyfunc.load_model`;
the weights are the registered model folder (artifact "hf"), read from safetensors, and
the code that loads and runs them is the model's own `lmforge_serving/` (code_paths):

    m = mlflow.pyfunc.load_model("models:/lmforge-lm@champion")
    m.predict(["Once upon a time"])                               # the continuations, under the model's task
    m.predict(["Once upon a time"], params={"max_new_tokens": 16, "temperature": 0.8, "seed": 7, "stop": ["."]})
    m.predict(['[{"role": "user", "content": "Hi"}]'])            # a chat task: a JSON list of messages
    m.predict(["def add(a, b):"], params={"output": "scored"})    # what evaluation scores (the preset: a summary)
    m.predict(["def add(a, b):"], params={"output": "token_ids"})   # ["17 402 9", ...]: the generated ids

A prompt is rendered, stopped and scored by the model's task (components/serving/task.py, recorded in
its lmforge.json). Loading and generation are lmforge_serving's modelload.py, task.py and
generation.py, the same code Triton's model runs and evaluation calls, so an int8 or low-rank
variant loads as what it is and the three give the same tokens. Greedy unless `temperature > 0`;
sampling with a `seed` (>= 0) is repeatable; the default seed -1 samples from torch's running random
stream (a different text each time). It imports only torch, transformers and mlflow, so it runs
where lmforge is not installed (an `mlflow models serve` container).
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
from mlflow.models import set_model

OUTPUTS = ("text", "scored", "token_ids")
PARAMS = {"max_new_tokens": 32, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": -1, "stop": [], "output": "text"}


def _runtime() -> tuple[Any, Any, Any]:
    """(modelload, generation, task): the copy stored with the model first, lmforge's own when there is none."""
    try:
        from lmforge_serving import generation, modelload, task  # type: ignore[import-not-found]
    except ImportError:
        from lmforge.components.serving import generation, modelload, task
    return modelload, generation, task


class LmforgeTextGenerator(mlflow.pyfunc.PythonModel):
    """Continuation of each prompt under lmforge's one generation path and the model's task."""

    def load_context(self, context: Any) -> None:
        modelload, self.gen, tasks = _runtime()
        path = context.artifacts["hf"]
        self.model = modelload.load_model(path)
        self.tokenizer = modelload.load_tokenizer(path)
        self.task = tasks.Task.load(path)

    # No type hints here: MLflow would derive a second signature from them; the logged one is the contract.
    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        p = {**PARAMS, **(params or {})}
        output = str(p["output"])
        if output not in OUTPUTS:
            raise ValueError(f"params.output is {output!r}; use one of {', '.join(OUTPUTS)}")
        if float(p["temperature"]) < 0 or not 0 < float(p["top_p"]) <= 1 or int(p["top_k"]) < 0:
            raise ValueError("params: temperature must be >= 0, top_p in (0, 1] and top_k >= 0")
        sampling = self.gen.Sampling(temperature=float(p["temperature"]), top_p=float(p["top_p"]),
                                     top_k=int(p["top_k"]), seed=int(p["seed"]) if int(p["seed"]) >= 0 else None)
        task_stops, ends = self.task.stops(self.tokenizer)
        stops = (*task_stops, *[str(s) for s in (p["stop"] or [])])
        rows = [self.gen.Row(self.task.encode(self.tokenizer, self.task.parse_prompt(s)), int(p["max_new_tokens"]),
                             sampling, stops) for s in _as_strings(model_input)]
        outs = self.gen.generate_rows(self.model, self.tokenizer, rows, ends=ends) if rows else []
        return [o.text if output == "text" else self.task.scored(o.text) if output == "scored"
                else " ".join(str(t) for t in o.token_ids) for o in outs]


def _as_strings(model_input: Any) -> list[str]:
    if hasattr(model_input, "iloc"):  # a pandas DataFrame or Series from the scoring server
        frame = model_input if model_input.ndim == 2 else model_input.to_frame()
        return [str(v) for v in frame.iloc[:, 0].tolist()]
    if isinstance(model_input, str):
        return [model_input]
    return [str(v) for v in model_input]


set_model(LmforgeTextGenerator())
