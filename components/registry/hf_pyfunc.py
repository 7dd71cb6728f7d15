"""The MLflow pyfunc model of a registered lmforge model ("models from code": no pickle).

MLflow stores this file's source beside the model and runs it on `mlflow.pyfunc.load_model`;
the weights are the registered Hugging Face folder (artifact "hf"), read from safetensors:

    m = mlflow.pyfunc.load_model("models:/lmforge-lm@champion")
    m.predict([generation_prompt("def add(a, b)")])   # ["Return a plus b.", ...]

It imports only torch, transformers and mlflow, so it runs where lmforge is not installed
(an `mlflow models serve` container). lmforge's own loaders read the same folder directly
(components/registry/store.py `download_model`) and never run this file.
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
from mlflow.models import set_model

DOC_CLOSE = '"""'


class LmforgeTextGenerator(mlflow.pyfunc.PythonModel):
    """Greedy continuation of each prompt, cut at the docstring close."""

    def load_context(self, context: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = context.artifacts["hf"]
        self.model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, trust_remote_code=False,
                                                          dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    # No type hints here: MLflow would derive a second signature from them; the logged one is the contract.
    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        import torch

        prompts = _as_strings(model_input)
        max_new = int((params or {}).get("max_new_tokens", 32))
        tok, eos = self.tokenizer, self.tokenizer.eos_token_id
        rows = [[eos, *tok(p, add_special_tokens=False)["input_ids"]] for p in prompts]
        width = max((len(r) for r in rows), default=0)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                      pad_token_id=tok.pad_token_id, eos_token_id=eos)
        texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
        return [t.split(DOC_CLOSE, 1)[0] for t in texts]


def _as_strings(model_input: Any) -> list[str]:
    if hasattr(model_input, "iloc"):  # a pandas DataFrame or Series from the scoring server
        frame = model_input if model_input.ndim == 2 else model_input.to_frame()
        return [str(v) for v in frame.iloc[:, 0].tolist()]
    if isinstance(model_input, str):
        return [model_input]
    return [str(v) for v in model_input]


set_model(LmforgeTextGenerator())
