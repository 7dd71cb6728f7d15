"""A small real dataset for training tests: a BPE tokenizer and shards, built without the data stage.

    version = make_dataset(ws)        # writes datasets/<v>/{tokenizer,shards,manifest.json}, sets LATEST
    ws = make_ws(tmp_path_factory, "name")   # a fresh workspace holding that dataset (the `ws` fixture)

Standard-library docstrings (read with ast, never imported) give real English text; the
format is exactly what components/data/shards.py writes and the data stage produces.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from lmforge.components.data.shards import write_shards
from lmforge.components.serving.records import Record
from lmforge.components.workspace import Workspace, atomic_write_json

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
MODULES = ["json/__init__.py", "argparse.py", "textwrap.py", "shutil.py", "pathlib.py", "inspect.py", "typing.py"]


def stdlib_records(limit: int = 600) -> list[Record]:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[Record] = []
    for rel in MODULES:
        tree = ast.parse((root / rel).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node):
                sig = f"def {node.name}(...)" if isinstance(node, ast.FunctionDef) else f"class {node.name}"
                out.append(Record.from_parts(source="stdlib", module=rel, qualname=node.name, signature=sig,
                                             docstring=ast.get_docstring(node) or ""))
    return out[:limit]


def make_dataset(ws: Workspace, *, vocab_size: int = 512, version: str = "testdata0001") -> str:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    records = stdlib_records()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([r.text for r in records], vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")
    d = ws.dataset_dir(version)
    tok.save_pretrained(d / "tokenizer")
    ids = [tok(r.text)["input_ids"] + [tok.eos_token_id] for r in records]
    n_val = max(2, len(ids) // 10)
    write_shards(d / "shards", {"train": ids[n_val:], "validation": ids[:n_val], "test": ids[:n_val]}, vocab_size=len(tok))
    atomic_write_json(d / "manifest.json", {"version": version, "vocab_size": len(tok),
                                            "counts": {"train": len(ids) - n_val, "validation": n_val}})
    ws.set_latest_dataset(version)
    return version


def make_ws(tmp_path_factory, name: str, **dataset_kwargs) -> Workspace:
    """A fresh workspace in a temporary folder named `name`, holding make_dataset(ws, **dataset_kwargs).

    The module-scoped `ws` fixture (tests/integration/conftest.py) is this, once per test file;
    a file that needs other dataset options overrides `ws` with a one-line fixture that calls it.
    """
    ws = Workspace(tmp_path_factory.mktemp(name) / "ws").ensure()
    make_dataset(ws, **dataset_kwargs)
    return ws


if __name__ == "__main__":
    import sys

    print(make_dataset(Workspace(Path(sys.argv[1])).ensure()))
    index = Workspace(Path(sys.argv[1])).dataset_dir("testdata0001") / "shards" / "index.json"
    print(json.dumps(json.loads(index.read_text())))


def tiny_training(**overrides: object):
    """configs/tiny.toml's [training] table with `overrides` merged in (nested dicts merge)."""
    import tomllib

    from lmforge.components.sections.training import TrainingConfig

    repo = Path(__file__).resolve().parents[2]
    raw = tomllib.loads((repo / "configs" / "tiny.toml").read_text())["training"]

    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
        return out

    return TrainingConfig.model_validate(merge(raw, overrides))


def run_training(ws: Workspace, name: str, cfg, *, resume: bool = False, version: str = "testdata0001", timeout_s: float = 300,
                 master_port: int | None = None, on_event=None):
    """Prepare and launch one job the way flows/train.py does; returns (events, run_dir)."""
    import dataclasses

    from lmforge.components.training.job import prepare_job
    from lmforge.components.training.launcher import launch

    run_dir = ws.run_dir(name)
    job = prepare_job(cfg, shards=ws.training_shards(version), tokenizer=ws.dataset_dir(version) / "tokenizer",
                      run_dir=run_dir, resume=resume, meta={"run_name": name, "dataset_version": version}, timeout_s=timeout_s)
    result = launch(dataclasses.replace(job.launch, master_port=master_port or job.launch.master_port),
                    on_line=lambda rank, line: None, on_event=on_event)
    return result.events, run_dir
