"""Load a Hugging Face model folder from safetensors only: no stored pickle is ever executed.

    model, tokenizer = load_causal_lm(path)          # eval mode, CPU, the stored dtype (fp32 for an export)

Any lmforge folder loads as what it is (components/serving/modelload.py): a plain export or a
cast with `from_pretrained`, an int8 variant as int8, a low-rank variant with its factors.

A folder is accepted only when its weights are safetensors (`model.safetensors` or a
`model.safetensors.index.json` with its shards). Pickle-format files that happen to sit
beside them (`pytorch_model.bin`, `*.pkl`, ...) are never opened: transformers is told
`use_safetensors=True` and `trust_remote_code=False`, so it neither falls back to a
pickle nor imports code shipped inside the folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def has_safetensors(model_dir: Path) -> bool:
    d = Path(model_dir)
    return (d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()


def pickle_files(model_dir: Path) -> list[Path]:
    """Files in the folder that are pickle formats (which lmforge never loads)."""
    return sorted(p for p in Path(model_dir).rglob("*") if p.is_file() and p.suffix in PICKLE_SUFFIXES)


def check_model_dir(model_dir: Path) -> Path:
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise UserError("model folder", d, "has no config.json",
                        "Point it at a Hugging Face folder, e.g. <workspace>/runs/<run>/export")
    if not has_safetensors(d):
        raise UserError("model folder", d, "has no safetensors weights (model.safetensors)",
                        "Re-export the model with save_pretrained(..., safe_serialization=True); "
                        "pickled weights are never loaded")
    return d


def load_causal_lm(model_dir: Path, *, dtype: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) of any lmforge model folder, as the server and the pyfunc load it."""
    from lmforge.components.serving import modelload

    d = check_model_dir(model_dir)
    return modelload.load_model(d, dtype=dtype), modelload.load_tokenizer(d)
