"""The parameter-server family on 2 CPU ranks (rank 0 is the server and worker 0, rank 1 worker 1): ps-sync,
async-sgd, hogwild and easgd each train the tiny model below the unigram baseline on held-out tokens, export
the same Hugging Face folder as the DeepSpeed strategies, and log staleness and bytes that match the protocol.
In the async-sgd and hogwild runs rank 1 is slowed on purpose (protocol.STRAGGLER_ENV), so that staleness must
show: rank 0's updates land while rank 1 computes. tests/integration/test_ps_loops.py reads back from the weights
what each rank did (hogwild's shared weights, easgd's rounds, async-sgd's drops).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from lmforge.components.training.protocol import STRAGGLER_ENV
from lmforge.components.workspace import Workspace
from tests.integration.train_support import run_training, tiny_training

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

STRATEGIES = ("ps-sync", "async-sgd", "hogwild", "easgd")
STEPS = 100
SETTINGS = {"precision": "fp32", "max_steps": STEPS, "warmup_steps": 5, "lr": 0.01}
# Rank 1 sleeps this long each step (after its gradient, before it is applied), several of rank 0's steps: without
# it two equal workers interleave, and a run whose staleness is all 0 (a broken version count) would pass.
STRAGGLE = {"async-sgd": "1:0.1", "hogwild": "1:0.1"}


@pytest.fixture(scope="module")
def runs(ws):
    out = {}
    for s in STRATEGIES:
        with pytest.MonkeyPatch.context() as mp:
            if s in STRAGGLE:
                mp.setenv(STRAGGLER_ENV, STRAGGLE[s])  # the launcher hands its environment to the ranks
            cfg = tiny_training(**SETTINGS, parallel={"strategy": s, "async_sgd": {"max_staleness": 1}})
            out[s] = run_training(ws, s, cfg, timeout_s=300)
    return out


def _heldout_nats(ws: Workspace, export) -> tuple[float, float]:
    """(the exported model's, the unigram baseline's) mean nats per held-out token, on the same tokens.

    The unigram model is components/evaluation/baseline.py's (add-one counts of the train split), scored on
    token ids instead of text."""
    from transformers import AutoModelForCausalLM

    from lmforge.components.data.shards import open_shard, read_index
    from lmforge.components.evaluation.baseline import UnigramModel

    shards = ws.training_shards("testdata0001")
    vocab = read_index(shards)["vocab_size"]
    train = np.asarray(open_shard(shards, "train"), dtype=np.int64)
    held = np.asarray(open_shard(shards, "validation"), dtype=np.int64)
    counts = np.bincount(train, minlength=vocab)
    unigram = UnigramModel(log2_probs=np.log2((counts + 1.0) / (counts.sum() + vocab)))
    rows = torch.from_numpy(held[:(len(held) - 1) // 64 * 64 + 1])
    x, y = rows[:-1].reshape(-1, 64), rows[1:].reshape(-1, 64)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        logits = model(input_ids=x).logits
    ours = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    return ours, float(-unigram.log2_probs[y.reshape(-1).numpy()].mean() * math.log(2))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trains_below_the_unigram_baseline_and_exports(ws, runs, strategy):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    events, run_dir = runs[strategy]
    assert [e["step"] for e in events] == list(range(1, STEPS + 1))
    ours, unigram = _heldout_nats(ws, run_dir / "export")
    assert ours < unigram, f"{strategy}: held-out {ours:.3f} nats/token, unigram {unigram:.3f}"
    probe = load_file(str(run_dir / "probe.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(run_dir / "export").eval()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=probe["input_ids"]).logits, probe["logits"], atol=1e-5)
    meta = json.loads((run_dir / "export" / "lmforge.json").read_text())
    assert meta["parameter_server"]["strategy"] == strategy and meta["steps"] == STEPS
    assert events[-1]["ps"]["tokens"] == 2 * STEPS * 4 * 64  # both workers' windows: micro 4 x seq 64 a step


def test_bytes_and_staleness_follow_each_protocol(runs):
    n_bytes = json.loads((runs["ps-sync"][1] / "ps_stats.json").read_text())["weights_bytes"]
    header = 8 * 8
    stats = {s: json.loads((run_dir / "ps_stats.json").read_text()) for s, (_, run_dir) in runs.items()}
    # ps-sync: per step worker 1 sends a header and its gradient, the server sends the weights back; never stale.
    assert stats["ps-sync"]["bytes_sent"] == STEPS * (2 * n_bytes + header)
    assert stats["ps-sync"]["staleness_hist"] == {"0": 2 * STEPS}
    # async-sgd: the same plus the server's reply header, and one last "done" header; every push is counted. Rank 1,
    # slowed, sends gradients several server versions old: some past max_staleness = 1, and exactly those were dropped.
    a = stats["async-sgd"]
    assert a["bytes_sent"] == STEPS * (2 * n_bytes + 2 * header) + header
    assert sum(a["staleness_hist"].values()) == 2 * STEPS
    assert a["staleness_max"] > 1 and a["dropped"] > 0, a
    assert a["dropped"] == sum(n for k, n in a["staleness_hist"].items() if int(k) > 1)
    # hogwild: nothing crosses a network; both workers' updates are counted, and rank 0's updates landed in the
    # shared counter while the slowed rank 1 computed (staleness > 0: the ranks read one counter, in /dev/shm).
    h = stats["hogwild"]
    assert h["bytes_sent"] == 0 and sum(h["staleness_hist"].values()) == 2 * STEPS
    assert h["staleness_max"] > 0, h
    # easgd: a round every tau = 4 steps and one at the end; between rounds a worker is 0..3 steps from the center.
    rounds = math.ceil(STEPS / 4)
    assert stats["easgd"]["bytes_sent"] == rounds * 2 * (n_bytes + header)
    assert set(stats["easgd"]["staleness_hist"]) == {"0", "1", "2", "3"}
