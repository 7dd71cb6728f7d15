"""The MFU's parts are honest: the FLOP count agrees with torch's own count, the CPU peak counts
physical cores, and the pipeline's idle clock waits for a GPU before reading the time."""

from __future__ import annotations

import pytest
import torch

from lmforge.components.runtime import accelerator
from lmforge.components.sections.training import ModelConfig
from lmforge.components.training import perf
from lmforge.components.training.model import build_model, param_count, train_flops_per_token
from lmforge.components.training.pipeline_model import IdleClock, lm_loss

VOCAB, SEQ = 512, 32


class Tok:
    """What build_model reads of a tokenizer."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __len__(self) -> int:
        return VOCAB


def tiny(**kw) -> ModelConfig:
    return ModelConfig.model_validate({"preset": "tiny", **kw})


def test_the_head_costs_flops_whether_or_not_its_weight_is_tied():
    tied, untied = tiny(tie_embeddings=True), tiny(tie_embeddings=False)
    assert param_count(tied, vocab_size=VOCAB) < param_count(untied, vocab_size=VOCAB)  # tying saves memory...
    def flops(cfg: ModelConfig, vocab: int = VOCAB) -> float:
        return train_flops_per_token(cfg, vocab_size=vocab, seq_len=SEQ)

    assert flops(tied) == flops(untied)
    # ...and the head's term is 6 x hidden x vocab per token (2 forward, 4 backward), tied or not.
    for cfg in (tied, untied):
        assert flops(cfg, VOCAB + 100) - flops(cfg) == 6 * cfg.sizes()["hidden_size"] * 100


@pytest.mark.parametrize("tie", [False, True])
def test_the_flop_formula_agrees_with_torchs_flop_counter(tie):
    """One forward + backward of the real model under torch's FlopCounterMode, against the formula.

    FlopCounterMode counts matmuls (and, on CUDA, its SDPA kernels), nothing elementwise. On the
    CPU it has no formula for SDPA's CPU kernel, so the model is counted with eager attention:
    QKᵀ and AV become plain matmuls over the full seq x seq matrix, as the formula's attention
    term (12 x layers x hidden x seq) assumes. What the formula counts and the counter does not
    are the RMSNorm weights (6 x 5 x hidden per token here, ~0.2%), hence the 1% tolerance.
    """
    from torch.utils.flop_counter import FlopCounterMode

    cfg = tiny(tie_embeddings=tie)
    model = build_model(cfg, Tok(), seq_len=SEQ, seed=0)
    model.set_attn_implementation("eager")
    x = torch.randint(0, VOCAB, (2, SEQ))
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(input_ids=x).logits, x).backward()
    counted = counter.get_total_flops() / x.numel()
    assert counted == pytest.approx(train_flops_per_token(cfg, vocab_size=VOCAB, seq_len=SEQ), rel=0.01)


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(accelerator.CACHE_ENV, str(tmp_path / "cache"))


def test_the_cpu_peak_counts_physical_cores_not_smt_siblings(monkeypatch, own_cache):
    import psutil

    monkeypatch.setattr(perf, "matmul_flops", lambda dtype, *, n, device, seconds: (10e9, 0.001))
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16 if logical else 8)
    peak = perf.measured_peak("fp32", torch.device("cpu"))
    assert peak.flops == 10e9 * 8 and "x 8 physical cores" in peak.source


def test_the_cpu_peak_counts_only_the_cpus_this_process_may_use(monkeypatch, own_cache):
    import psutil

    monkeypatch.setattr(perf, "matmul_flops", lambda dtype, *, n, device, seconds: (10e9, 0.001))
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16 if logical else 8)
    monkeypatch.setattr(perf.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(perf.os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)   # taskset -c 0-3
    peak = perf.measured_peak("fp32", torch.device("cpu"))
    assert peak.flops == 10e9 * 2 and "the 4 of 16 CPUs this process may use" in peak.source


def test_the_cpu_peak_falls_back_to_logical_cpus_and_says_so(monkeypatch, own_cache):
    import psutil

    monkeypatch.setattr(perf, "matmul_flops", lambda dtype, *, n, device, seconds: (10e9, 0.001))
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 6 if logical else None)
    monkeypatch.setattr(perf.os, "cpu_count", lambda: 6)
    monkeypatch.setattr(perf.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    peak = perf.measured_peak("fp32", torch.device("cpu"))
    assert peak.flops == 10e9 * 6 and "logical CPUs (physical cores unknown)" in peak.source


class FakePipeEngine:
    """The two things IdleClock reads of a deepspeed PipelineEngine: its instruction table and device."""

    def __init__(self, device: str) -> None:
        from deepspeed.runtime.pipe import schedule

        self.device = torch.device(device)
        self.ran: list[str] = []
        type(self)._INSTRUCTION_MAP = {
            schedule.ForwardPass: lambda self, **kw: self.ran.append("forward"),
            schedule.OptimizerStep: lambda self, **kw: self.ran.append("step"),
            schedule.LoadMicroBatch: lambda self, **kw: self.ran.append("load"),
            schedule.ReduceTiedGrads: lambda self, **kw: self.ran.append("reduce tied"),
        }


@pytest.mark.parametrize("device, synced", [("cuda:1", True), ("cpu", False)])
def test_the_idle_clock_waits_for_the_gpu_before_reading_the_time(monkeypatch, device, synced):
    from deepspeed.runtime.pipe import schedule

    syncs: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: syncs.append(d))
    engine = FakePipeEngine(device)
    IdleClock.attach(engine)
    for instruction in (schedule.ForwardPass, schedule.OptimizerStep):
        engine._INSTRUCTION_MAP[instruction](engine)
    assert engine.ran == ["forward", "step"]
    # Before and after each timed instruction, on the engine's own device; never on a CPU engine.
    assert syncs == ([torch.device("cuda:1")] * 4 if synced else [])
    engine._INSTRUCTION_MAP[schedule.LoadMicroBatch](engine)  # not timed: no wait
    assert len(syncs) == (4 if synced else 0)


def test_the_wait_for_the_last_stage_is_idle_not_outside(monkeypatch):
    """The stages meet at a barrier before the end-of-batch instructions: a stage that finished early waits there, and
    that wait is idle. Without it the wait hid in the optimizer step's clipping all-reduce, timed as outside."""
    import time

    from deepspeed.runtime.pipe import schedule

    class Grid:
        def get_pipe_parallel_group(self):
            return "pipe group"

    met: list[object] = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: (met.append(group), time.sleep(0.2)))
    engine = FakePipeEngine("cpu")
    engine.grid = Grid()
    clock = IdleClock.attach(engine)
    t0 = time.perf_counter()
    engine._INSTRUCTION_MAP[schedule.ForwardPass](engine)
    engine._INSTRUCTION_MAP[schedule.ReduceTiedGrads](engine)
    engine._INSTRUCTION_MAP[schedule.OptimizerStep](engine)
    step_s = time.perf_counter() - t0
    assert met == ["pipe group"] and engine.ran == ["forward", "reduce tied", "step"]
    assert clock.outside < 0.1                      # the barrier's 0.2 s is not outside ...
    assert clock.idle_fraction(step_s) > 0.9        # ... it is idle: the stage computed next to nothing


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt2", "gpt_neox", "phi3"])
def test_a_bases_flop_count_agrees_with_torchs_flop_counter(kind, checkpoint):
    """The generic count for a base (training.model.init): every Linear/Conv1D weight plus attention, from the config
    alone, against FlopCounterMode on the loaded model with eager attention. Biases and norms are not matmuls."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from lmforge.components.training.model import hf_train_flops_per_token

    model = AutoModelForCausalLM.from_pretrained(checkpoint(kind), attn_implementation="eager")
    x = torch.randint(0, model.config.vocab_size, (2, SEQ))
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(input_ids=x).logits, x).backward()
    counted = counter.get_total_flops() / x.numel()
    assert counted == pytest.approx(hf_train_flops_per_token(model.config, seq_len=SEQ), rel=0.01)


def test_the_generic_count_equals_the_presets_closed_form_up_to_the_norms():
    from lmforge.components.training.model import hf_train_flops_per_token, llama_config

    cfg = tiny()
    closed = train_flops_per_token(cfg, vocab_size=VOCAB, seq_len=SEQ)
    generic = hf_train_flops_per_token(llama_config(cfg, Tok(), seq_len=SEQ), seq_len=SEQ)
    s = cfg.sizes()
    assert closed - generic == 6 * (2 * s["num_layers"] + 1) * s["hidden_size"]  # the closed form counts RMSNorm weights
