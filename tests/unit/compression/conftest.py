"""Fixtures for the compression tests: training shards tokenized with the tiny model's tokenizer.

    def test_x(tiny_model_dir, tiny_shards, tuner): ...
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_shards(tiny_model_dir, tmp_path_factory) -> Path:
    """A train split of real docstring text in the shard format, for the short fine-tunes."""
    import textwrap

    from transformers import PreTrainedTokenizerFast

    from lmforge.components.data.shards import write_shards

    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    texts = [ast.get_docstring(n) for n in ast.walk(ast.parse(inspect.getsource(textwrap)))
             if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(n)]
    docs = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    out = tmp_path_factory.mktemp("shards")
    write_shards(out, {"train": docs * 3, "validation": docs[:2], "test": docs[:2]}, vocab_size=len(tok))
    assert json.loads((out / "index.json").read_text())["splits"]["train"]["tokens"] > 512
    return out


@pytest.fixture
def tuner(tiny_shards):
    from lmforge.components.compression.finetune import Finetuner
    from lmforge.components.sections.compression import FinetuneConfig

    return Finetuner(FinetuneConfig(seq_len=32, batch_size=4, lr=1e-3, bf16=False), shard_dir=tiny_shards, seed=0)


@pytest.fixture
def ids():
    import torch

    return torch.randint(4, 500, (2, 24), generator=torch.Generator().manual_seed(1))
