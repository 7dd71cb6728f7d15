"""Run an exported causal LM graph (deploy/onnx_export.py) with onnxruntime, as generation.decode's forward.

    fwd = OnnxForward("export/model.onnx", threads=2)
    outs = generation.decode(fwd, tokenizer, [ids], max_new_tokens=32)     # greedy, with the graph's KV cache
    logits, cache = fwd(input_ids, attention_mask, position_ids, None)     # one call: LongTensors in, logits out

The graph's contract (written by onnx_export.export_onnx, read back from the graph itself):
inputs `input_ids`, `attention_mask`, `position_ids` (int64) and `past_key_<i>`, `past_value_<i>`
(float [batch, kv_heads, past, head_dim]) for each layer; outputs `logits` and `present_key_<i>`,
`present_value_<i>` (the cache with this call's tokens appended). Batch, sequence and past
lengths are dynamic; the first call passes a past of length 0.

Imports numpy, onnxruntime and torch (the loop's tensors) and the standard library only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

GRAPH_FILE = "model.onnx"
INPUTS = ("input_ids", "attention_mask", "position_ids")
PAST, PRESENT = "past_", "present_"


def cache_names(layers: int) -> list[str]:
    """past_key_0, past_value_0, past_key_1, ...: the cache inputs in the graph's order."""
    return [f"{PAST}{kind}_{i}" for i in range(layers) for kind in ("key", "value")]


def runtime_version() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)


def session(path: str | Path, *, threads: int = 0) -> Any:
    """An onnxruntime CPU session on the graph at `path` (threads 0 = onnxruntime's choice)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


class OnnxForward:
    """generation.decode's forward function over an onnxruntime session of the exported graph."""

    def __init__(self, path: str | Path, *, threads: int = 0) -> None:
        self.session = session(path, threads=threads)
        inputs = {i.name: i for i in self.session.get_inputs()}
        missing = [n for n in INPUTS if n not in inputs]
        if missing:
            raise ValueError(f"{path} is not an lmforge causal LM graph: it has no input {', '.join(missing)}")
        self.past_names = [n for n in inputs if n.startswith(PAST)]
        if self.past_names != cache_names(len(self.past_names) // 2):
            raise ValueError(f"{path}: cache inputs {self.past_names} are not past_key_<i>, past_value_<i> per layer")
        first = inputs[self.past_names[0]].shape if self.past_names else None
        self.kv_heads, self.head_dim = (int(first[1]), int(first[3])) if first else (0, 0)
        self.outputs = ["logits", *(n.replace(PAST, PRESENT, 1) for n in self.past_names)]

    def empty_cache(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), dtype=np.float32) for _ in self.past_names]

    def __call__(self, input_ids: Any, attention_mask: Any, position_ids: Any, past: Any) -> tuple[Any, Any]:
        import torch

        ids = np.ascontiguousarray(input_ids.cpu().numpy(), dtype=np.int64)
        cache = self.empty_cache(ids.shape[0]) if past is None else past
        feed = {"input_ids": ids, "attention_mask": np.ascontiguousarray(attention_mask.cpu().numpy(), dtype=np.int64),
                "position_ids": np.ascontiguousarray(position_ids.cpu().numpy(), dtype=np.int64),
                **dict(zip(self.past_names, cache))}
        logits, *present = self.session.run(self.outputs, feed)
        return torch.from_numpy(logits), present
