"""benchmarks/bench_train.py runs: its CPU path end to end in a few steps (the plain loop, the HF Trainer and a
2-rank lmforge run, with the ratio), and its CUDA path refuses clearly where there is no GPU. The CUDA figures
themselves come from `python benchmarks/bench_train.py --device cuda` on a GPU (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train.py"


def test_the_cpu_path_measures_lmforge_against_the_plain_loop(tmp_path):
    subprocess.run([sys.executable, str(BENCH), "--steps", "4", "--warmup", "1", "--strategies", "ddp", "--bubble", "",
                    "--out", str(tmp_path)], check=True, timeout=800, capture_output=True)
    result = json.loads((tmp_path / "train.json").read_text())
    runs = {row["run"]: row for row in result["throughput"]}
    assert set(runs) == {"plain PyTorch (1 process)", "HF Trainer (1 process)", "ddp (2 ranks)"}
    assert runs["ddp (2 ranks)"]["vs_plain"] > 0 and all(row["tokens_per_s"] > 0 for row in runs.values())
    assert "| ddp (2 ranks) |" in (tmp_path / "train.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_the_cuda_path_says_there_is_no_gpu(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cuda", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no CUDA device here" in done.stderr
