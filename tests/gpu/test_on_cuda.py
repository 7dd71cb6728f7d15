"""On one CUDA device: every strategy trains 5 steps and exports; BPC and fine-tuning run on the GPU.

    pytest -m gpu tests/gpu          # skipped (not failed) where CUDA is missing

Each run goes through lmforge's real launcher (deepspeed --include localhost:<id>, NCCL), with
`num_ranks` unset, so it also checks that the default takes the one visible GPU. The logged MFU
is checked against an independent figure: torch's FlopCounterMode on one forward + backward of
the same model and micro-batch, over the logged step time, against the datasheet peak. The logged
step time itself is checked against a clock the rank does not own: the test times the same model's
training step (forward, backward, fused AdamW, compiled, same precision and micro-batch) with CUDA
events, and the rank's step can be no faster than that bare step, nor more than twice as slow.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from lmforge.components.workspace import Workspace
from tests.integration.train_support import make_ws, run_training, tiny_training

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEP_OVER_BARE = 2.0   # a rank's logged step is at most this many bare steps
STRATEGIES = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "zero2-offload": {"strategy": "zero2", "offload_optimizer": True},
}


# NVIDIA datasheet dense FLOP/s, written down here rather than read from components/training/perf.py,
# so that a wrong figure there shows. fp32 training runs its matmuls as TF32 (the rank turns it on).
SXM_H100_H200 = {"bf16": 989.4e12, "fp32": 494.7e12}
A100 = {"bf16": 312e12, "fp32": 156e12}


def independent_peak(precision: str) -> float | None:
    name = torch.cuda.get_device_name()
    if re.search(r"\bH[12]00\b", name) and not re.search(r"PCIe|NVL", name):
        return SXM_H100_H200[precision]
    if re.search(r"\bA100\b", name):
        return A100[precision]
    return None


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return make_ws(tmp_path_factory, "gpu")


def counted_flops_per_token(ws: Workspace, cfg) -> float:
    """torch's own count of one training step's work (forward + backward) of the run's model, per token.

    FlopCounterMode counts what runs: every matmul and, on CUDA, the SDPA kernels (full
    seq x seq, as the formula does). It shares no code with train_flops_per_token.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from lmforge.components.training.model import build_model, load_tokenizer
    from lmforge.components.training.pipeline_model import lm_loss

    tok = load_tokenizer(ws.dataset_dir("testdata0001") / "tokenizer")
    model = build_model(cfg.model, tok, seq_len=cfg.seq_len, seed=cfg.seed).cuda()
    x = torch.randint(0, len(tok), (cfg.micro_batch_size, cfg.seq_len), device="cuda")
    with FlopCounterMode(display=False) as counter, torch.autocast("cuda", torch.bfloat16):
        lm_loss(model(input_ids=x).logits, x).backward()
    return counter.get_total_flops() / x.numel()


def time_bare_step(ws: Workspace, precision: str, *, steps: int = 20) -> float:
    """Seconds per training step of the runs' model in a bare compiled loop, timed with CUDA events.

    The same model, micro-batch, sequence length and precision as the runs below; no DeepSpeed, no data loading,
    no logging: a lower bound on what a rank's step of this work can take.
    """
    from lmforge.components.training.model import build_model, load_tokenizer
    from lmforge.components.training.pipeline_model import lm_loss

    cfg = tiny_training()
    tok = load_tokenizer(ws.dataset_dir("testdata0001") / "tokenizer")
    torch.backends.cuda.matmul.allow_tf32 = True    # as the rank does for fp32
    model = build_model(cfg.model, tok, seq_len=cfg.seq_len, seed=cfg.seed).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    compiled = torch.compile(model)
    x = torch.randint(0, len(tok), (cfg.micro_batch_size, cfg.seq_len), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16, enabled=precision == "bf16"):
            loss = lm_loss(compiled(input_ids=x).logits, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):   # compile and warm up
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


@pytest.fixture(scope="module")
def bare_step_s(ws: Workspace) -> float:
    return time_bare_step(ws, "bf16" if torch.cuda.is_bf16_supported() else "fp32")


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_trains_on_one_gpu_and_exports(ws, name, monkeypatch, bare_step_s):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cfg = tiny_training(max_steps=5, warmup_steps=2, save_every=5, parallel=STRATEGIES[name])
    assert cfg.num_ranks is None  # the default: every visible GPU, here one
    events, run_dir = run_training(ws, f"gpu-{name}", cfg, timeout_s=900)
    hw = json.loads((run_dir / "request-0.json").read_text())["hardware"]
    assert hw["device"] == "cuda" and hw["gpus"] == ["0"] and hw["compile"] is True
    assert hw["precision"] == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    losses = [e["loss"] for e in events]
    assert [e["step"] for e in events] == [1, 2, 3, 4, 5] and all(math.isfinite(x) for x in losses)
    # One GPU, no pipeline or TP: one data-parallel rank, so a step is micro x accum windows.
    tokens_per_step = cfg.micro_batch_size * cfg.grad_accum_steps * cfg.seq_len
    counted = counted_flops_per_token(ws, cfg)
    peak = independent_peak(hw["precision"]) or events[0]["peak_flops"]  # a GPU not listed above: its logged peak
    for e in events:
        assert 0 < e["mfu"] < 1, e
        # Not the rank's own formula again: the counter's FLOPs over the step time the rank measured.
        # They should differ by ~2% on the tiny model: torch counts SDPA's backward as 5 matmuls (flash
        # attention recomputes QKᵀ) where the formula counts 4, a +17% on the attention term, which is
        # ~12% of the FLOPs at hidden 64, seq 64; the formula counts the RMSNorm weights the counter
        # does not (-0.2%). 10% leaves room for that and still fails on a term as big as the output
        # head (25% of this model's FLOPs) or a peak of the wrong precision (2x).
        independent = counted * tokens_per_step / e["step_s"] / peak
        assert e["mfu"] == pytest.approx(independent, rel=0.10), (e, counted, peak)
        assert e["memory"][0]["device_peak"] > 0
    # The logged step time against the bare step timed above with CUDA events (not the rank's own clock): a
    # rank step does that work and more (ZeRO bookkeeping, the engine's clipping, data, logging), so it is no
    # faster (a step_s counted too small would report an MFU no run reaches), and no more than twice as slow (a
    # window counted twice, or the engine's overhead grown to the size of the step, fails; issue 44: the bound was
    # 1000x, which no such error reaches). Steps 1-2 compile; their times are not compared.
    # With the optimizer offloaded, its step runs on the CPU (DeepSpeedCPUAdam, after a copy of every gradient to
    # the host), work the bare GPU step does not do: that run is held to the lower bound only.
    bare = bare_step_s
    over = math.inf if STRATEGIES[name].get("offload_optimizer") else STEP_OVER_BARE
    for e in events[2:]:
        assert bare * 0.9 <= e["step_s"] <= bare * over, (e["step_s"], bare)
        assert e["mfu"] <= counted * tokens_per_step / bare / peak * 1.1, (e, bare)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "export").eval()
    probe = load_file(str(run_dir / "probe.safetensors"))
    with torch.no_grad():
        ours = model(input_ids=probe["input_ids"]).logits.float()
    assert torch.allclose(ours, probe["logits"], atol=5e-2, rtol=5e-2), (ours - probe["logits"]).abs().max()


def test_bpc_on_the_gpu_matches_the_cpu(tiny_model_dir):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from lmforge.components.evaluation.bpc import bits_per_character

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    texts = ["Return the number of items in the container.", "Open a file and return a stream object."] * 4
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].device.type), with_kwargs=True)
    on_gpu = bits_per_character(model, tok, texts, start_id=tok.eos_token_id, context_length=32, batch_size=4)
    on_cpu = bits_per_character(model, tok, texts, start_id=tok.eos_token_id, context_length=32, batch_size=4, device="cpu")
    assert seen[0] == "cuda" and seen[-1] == "cpu"
    assert on_gpu.bpc == pytest.approx(on_cpu.bpc, rel=1e-3) and on_gpu.tokens == on_cpu.tokens


def test_finetune_runs_on_the_gpu(ws, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from lmforge.components.compression.finetune import Finetuner, lm_loss
    from lmforge.components.sections.compression import FinetuneConfig

    tuner = Finetuner(FinetuneConfig(seq_len=32, batch_size=4, lr=1e-3), shard_dir=ws.training_shards("testdata0001"))
    assert tuner.device.type == "cuda"
    seen = []

    def loss_fn(model, x, y):
        seen.append(next(model.parameters()).device.type)
        return lm_loss(model, x, y)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(512)
    losses = tuner.run(model, steps=3, loss_fn=loss_fn)
    assert seen == ["cuda"] * 3 and all(math.isfinite(x) for x in losses)
    assert next(model.parameters()).device.type == "cpu"
