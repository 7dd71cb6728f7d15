"""Export a model folder to ONNX with a KV cache, and check the graph's logits against torch.

    report = export_onnx(Path("registry/lmforge-lm/3/hf"), Path("onnx/3"))   # model.onnx + tokenizer + onnx.json
    report.max_abs_diff, report.tolerance, report.kv_cache                   # 2e-7, 1e-3, True
    check_logits(model, OnnxForward("onnx/3/model.onnx"), tolerance=1e-3)   # LogitsMismatch when it differs

The graph comes from `torch.onnx.export(..., dynamo=True)` (torch.export, then onnxscript) of a
wrapper around the causal LM that takes and returns the KV cache as flat tensors: inputs
`input_ids`, `attention_mask`, `position_ids`, `past_key_<i>`/`past_value_<i>` per layer; outputs
`logits` and `present_key_<i>`/`present_value_<i>` (components/serving/onnxrun.py runs it). Batch,
sequence and past lengths are dynamic, so one graph serves the prefill (past of length 0) and
every decoding step (sequence 1). The model is exported in fp32.

The check runs the same inputs through torch (generation.torch_forward) and the graph
(onnxrun.OnnxForward): a left-padded batch of 2 for the prefill, then two decoding steps that feed
each side its own cache back, and a single row of one token. It compares logits at the positions
the attention mask keeps (a padding position's logits are never used) and fails with
LogitsMismatch, naming the case and the difference, when the largest absolute difference exceeds
the tolerance. The folder is written atomically: a failed export or check leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.serving.modelload import cache_shape
from lmforge.components.serving.onnxrun import GRAPH_FILE, INPUTS, OnnxForward, cache_names
from lmforge.components.workspace import atomic_dir, atomic_write_json, sha256_tree

ONNX_FILE = GRAPH_FILE
META_FILE = "onnx.json"
DEFAULT_TOLERANCE = 1e-3   # fp32 logits; the tiny model's graph differs by ~2e-7
WEIGHT_SUFFIXES = (".safetensors",)
WEIGHT_NAMES = ("model.safetensors.index.json",)


class LogitsMismatch(UserError):
    """The exported graph's logits differ from torch's by more than the tolerance."""


@dataclass
class OnnxReport:
    folder: str
    kv_cache: bool
    max_abs_diff: float
    tolerance: float
    checks: list[dict[str, Any]] = field(default_factory=list)
    export_s: float = 0.0
    source_sha256: str = ""
    onnx_sha256: str = ""
    versions: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _kv_model(model: Any) -> Any:
    """The causal LM as a module of flat tensors: (ids, mask, positions, *past) -> (logits, *present)."""
    import torch
    from transformers import DynamicCache

    layers = int(model.config.num_hidden_layers)

    class FlatCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, *past: Any) -> tuple[Any, ...]:
            cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(layers)])
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)
            present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *present)

    return FlatCache().eval()


def export_graph(model: Any, path: Path) -> None:
    """Write the KV-cache graph of `model` to `path` (dynamic batch, sequence and past length)."""
    import torch

    layers, kv, head_dim = cache_shape(model.config)
    batch, seq, past = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
    b, s, p = 2, 3, 4   # example sizes; none is 0 or 1, which torch.export would specialise on
    ids = torch.ones((b, s), dtype=torch.long)
    mask = torch.ones((b, p + s), dtype=torch.long)
    positions = torch.arange(p, p + s).expand(b, s).contiguous()
    cache = [torch.zeros((b, kv, p, head_dim)) for _ in range(2 * layers)]
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: torch.export.Dim.AUTO},
               "position_ids": {0: batch, 1: seq}, "past": tuple({0: batch, 2: past} for _ in cache)}
    names = cache_names(layers)
    program = torch.onnx.export(_kv_model(model), (ids, mask, positions, *cache), dynamo=True, dynamic_shapes=dynamic,
                                input_names=[*INPUTS, *names], verbose=False,
                                output_names=["logits", *(n.replace("past_", "present_", 1) for n in names)])
    program.save(str(path))


def check_logits(model: Any, graph: Any, *, tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> list[dict[str, Any]]:
    """Compare `graph` (a decode forward, e.g. OnnxForward) with torch on fixed inputs; the per-case differences.

    Raises LogitsMismatch when a case's largest absolute logit difference exceeds `tolerance`.
    """
    import torch

    from lmforge.components.serving.generation import torch_forward

    reference = torch_forward(model)
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (2, 7), generator=gen)
    mask = torch.ones((2, 7), dtype=torch.long)
    mask[0, :3] = 0                                         # row 0 is left-padded, as decode pads a batch
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    cases = [("prefill, batch 2, left-padded", ids, mask, positions, True)]
    for step in range(2):
        nxt = torch.randint(0, vocab, (2, 1), generator=gen)
        cases.append((f"decoding step {step + 1} with the cache", nxt, None, None, False))
    cases.append(("one row, one token, no cache", torch.randint(0, vocab, (1, 1), generator=gen),
                  torch.ones((1, 1), dtype=torch.long), torch.zeros((1, 1), dtype=torch.long), True))
    checks = []
    past_t = past_o = None
    for name, x, m, pos, fresh in cases:
        if fresh:
            past_t = past_o = None
            cur_mask, cur_pos = m, pos
        else:
            cur_mask = torch.cat([cur_mask, torch.ones_like(x)], dim=1)
            cur_pos = cur_pos[:, -1:] + 1
        with torch.inference_mode():
            want, past_t = reference(x, cur_mask, cur_pos, past_t)
        got, past_o = graph(x, cur_mask, cur_pos, past_o)
        if tuple(got.shape) != tuple(want.shape):
            raise LogitsMismatch("onnx graph", name, f"returned logits of shape {tuple(got.shape)}, torch "
                                 f"{tuple(want.shape)}", "Re-export the model: the graph does not fit it")
        keep = cur_mask[:, -x.shape[1]:].bool()
        diff = (got.float() - want.float()).abs()[keep]
        worst = float(diff.max()) if diff.numel() else 0.0
        if not worst == worst:  # NaN
            worst = float("inf")
        checks.append({"case": name, "shape": list(want.shape), "max_abs_diff": worst})
        if worst > tolerance:
            raise LogitsMismatch("onnx graph", name, f"has logits {worst:.3g} away from torch's, more than the "
                                 f"tolerance {tolerance:g}",
                                 "The export is wrong for this model: do not serve it. Re-export with the torch and "
                                 "transformers versions it was checked with, or raise deploy.onnx_tolerance if the "
                                 "difference is numerical noise")
    return checks


def export_onnx(model_dir: Path, out_dir: Path, *, tolerance: float = DEFAULT_TOLERANCE) -> OnnxReport:
    """Export the model folder to `out_dir` (model.onnx, tokenizer, config, onnx.json) after checking its logits."""
    import onnx
    import onnxruntime
    import torch
    import transformers

    from lmforge.components.registry.loading import check_model_dir
    from lmforge.components.serving import modelload

    model_dir = check_model_dir(Path(model_dir))
    kind = modelload.read_meta(model_dir).get("load", {}).get("kind", "hf")
    if kind != "hf":
        raise UserError("onnx export", model_dir,
                        f"is a compressed variant (load kind {kind}), whose layers torch.onnx cannot trace",
                        "Export the plain model version it was compressed from (its parent_version tag)")
    model = modelload.load_model(model_dir, dtype=torch.float32)
    start = time.perf_counter()
    with atomic_dir(Path(out_dir)) as tmp:
        try:
            export_graph(model, tmp / ONNX_FILE)
        except Exception as e:  # torch.export / onnxscript failures are long; the first line names the op
            raise UserError("onnx export", model_dir, f"torch.onnx.export failed: {type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
                            "Run with --debug for the whole trace; a model type torch.export cannot trace "
                            "serves with [deploy] format = \"torch\"") from e
        seconds = time.perf_counter() - start
        for item in model_dir.iterdir():   # tokenizer, config, lmforge.json: what the server loads beside the graph
            if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and item.name not in WEIGHT_NAMES:
                shutil.copy2(item, tmp / item.name)
        checks = check_logits(model, OnnxForward(tmp / ONNX_FILE), tolerance=tolerance)
        report = OnnxReport(folder=str(Path(out_dir)), kv_cache=True, tolerance=tolerance,
                            max_abs_diff=max(c["max_abs_diff"] for c in checks), checks=checks,
                            export_s=round(seconds, 2), source_sha256=sha256_tree(model_dir),
                            onnx_sha256=sha256_tree(tmp / ONNX_FILE),
                            versions={"torch": torch.__version__, "transformers": transformers.__version__,
                                      "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__})
        atomic_write_json(tmp / META_FILE, report.to_dict())
    return report


def read_report(folder: Path) -> OnnxReport | None:
    """The report an export wrote beside its graph; None when the folder holds no finished export."""
    path = Path(folder) / META_FILE
    if not path.is_file() or not (Path(folder) / ONNX_FILE).is_file():
        return None
    return OnnxReport(**json.loads(path.read_text()))


def is_onnx_dir(folder: Path) -> bool:
    return (Path(folder) / ONNX_FILE).is_file()


def check_onnx_dir(folder: Path) -> Path:
    """A finished, checked export (model.onnx, onnx.json, config.json), or UserError saying what is missing."""
    d = Path(folder)
    missing = [n for n in (ONNX_FILE, META_FILE, "config.json") if not (d / n).is_file()]
    if missing:
        raise UserError("onnx folder", d, f"has no {', '.join(missing)}",
                        "Export it with `lmforge export onnx` (it writes the graph, the tokenizer and the check's report)")
    return d
