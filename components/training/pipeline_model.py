"""A Llama-style decoder as a deepspeed.pipe.PipelineModule: embedding, decoder blocks, norm + head.

    pipe = build_pipeline(model, stages=2, partition="type:DecoderBlock", loss_fn=lm_loss)
    loss = engine.train_batch(iter(micro_batches))          # 1F1B over the micro-batches
    hf_state = stage_hf_state(pipe)                          # this stage's weights under HF names

Only hidden states travel between stages, so each decoder block carries its own rotary
embedding and builds the position ids itself; attention is SDPA with `is_causal`, so no
mask crosses a stage boundary. The blocks reuse the modules of a built model (lmforge's
Llama, or a base of any architecture `unsplittable` accepts), so a pipeline run starts from
exactly the weights of the other strategies.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class EmbedBlock(nn.Module):
    hf_prefix = "model."

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class DecoderBlock(nn.Module):
    def __init__(self, layer: nn.Module, rotary: nn.Module, index: int) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.hf_prefix = f"model.layers.{index}."

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0).expand(hidden.shape[0], -1)
        cos_sin = self.rotary(hidden, positions)
        out = self.layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    def hf_state(self) -> dict[str, torch.Tensor]:
        return {self.hf_prefix + k: v for k, v in self.layer.state_dict().items()}


class NormHeadBlock(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def hf_state(self) -> dict[str, torch.Tensor]:
        return {"model.norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight}


def _embed_state(block: EmbedBlock) -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": block.embed_tokens.weight}


EmbedBlock.hf_state = _embed_state  # type: ignore[attr-defined]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, in fp32 whatever the compute precision."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


LLAMA_STYLE = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")


def unsplittable(model: Any, *, seq_len: int) -> str | None:
    """Why the pipeline cannot split `model` (None when it can), by what the model is made of.

    The stages below take a Llama-style decoder: `model.embed_tokens`, a ModuleList `model.layers`
    of blocks called with rotary `position_embeddings`, `model.norm`, the model's own
    `model.rotary_emb` and an `lm_head` of its own (Llama, Mistral, Qwen2, Phi-3 are built so;
    GPT-2 and GPT-NeoX are not). A head tied to the embedding would sit on two stages, and a
    sliding window shorter than seq_len needs a mask, which no stage boundary carries.
    """
    missing = [name for name in LLAMA_STYLE if not _has(model, name)]
    if missing:
        return (f"it is not a Llama-style decoder (it has no {', '.join(missing)}); the pipeline splits models made of "
                f"{', '.join(LLAMA_STYLE)}, such as Llama, Mistral, Qwen2 and Phi-3")
    if model.lm_head.weight is model.model.embed_tokens.weight:
        return "its output head is tied to the input embedding, and a pipeline puts those on different stages"
    window = getattr(model.config, "sliding_window", None)
    if window and window < seq_len and getattr(model.config, "use_sliding_window", True):
        return f"its attention is windowed ({window} tokens, shorter than seq_len {seq_len}), which needs a mask"
    return None


def _has(model: Any, dotted: str) -> bool:
    try:
        model.get_submodule(dotted)
    except AttributeError:
        return False
    return True


def pipeline_layers(model: Any) -> list[nn.Module]:
    inner = model.model
    rotary = type(inner.rotary_emb)  # the architecture's own rotary embedding, one per block (buffers only)
    blocks: list[nn.Module] = [EmbedBlock(inner.embed_tokens)]
    blocks += [DecoderBlock(layer, rotary(config=model.config), i) for i, layer in enumerate(inner.layers)]
    blocks.append(NormHeadBlock(inner.norm, model.lm_head))
    return blocks


def build_pipeline(model: Any, *, stages: int, partition: str, activation_checkpoint_interval: int = 0) -> Any:
    from deepspeed.pipe import PipelineModule

    return PipelineModule(layers=pipeline_layers(model), num_stages=stages, partition_method=partition,
                          loss_fn=lm_loss, activation_checkpoint_interval=activation_checkpoint_interval)


def stage_hf_state(pipe: Any) -> dict[str, torch.Tensor]:
    """This stage's weights under Hugging Face names, on CPU."""
    out: dict[str, torch.Tensor] = {}
    for layer in pipe.forward_funcs:
        if hasattr(layer, "hf_state"):
            out.update({k: v.detach().cpu() for k, v in layer.hf_state().items()})
    return out


class IdleClock:
    """How long this pipeline stage computed, and how long it spent outside the 1F1B schedule.

        clock = IdleClock.attach(engine)     # a deepspeed PipelineEngine
        t0 = time.perf_counter(); engine.train_batch(it)
        idle = clock.idle_fraction(time.perf_counter() - t0)

    The bubble of a stage is the part of its schedule in which it does no forward or
    backward work: 1 - (forward + backward) / (step time - optimizer and gradient reduction).
    Waits at the end of the step (a later stage finishing its last backward) count, which is
    why this does not time the send/receive instructions alone.

    On CUDA the clock waits for the device (torch.cuda.synchronize on the engine's device)
    before each reading: kernels run asynchronously, so without it an instruction's time would
    be the time to launch its kernels, and the compute would look near zero and the idle
    fraction near one. The syncs cost a little overlap between instructions; on the CPU,
    where every op is done when it returns, there is nothing to wait for and none is made.
    """

    def __init__(self) -> None:
        self.compute = 0.0
        self.outside = 0.0

    @classmethod
    def attach(cls, engine: Any) -> "IdleClock":
        import time

        from deepspeed.runtime.pipe import schedule

        clock = cls()
        device = torch.device(engine.device)

        def now() -> float:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the queued kernels finish first: see the docstring
            return time.perf_counter()

        compute = (schedule.ForwardPass, schedule.BackwardPass)
        outside = (schedule.OptimizerStep, schedule.ReduceGrads, schedule.ReduceTiedGrads)

        def timed(fn: Any, bucket: str) -> Any:
            def run(self: Any, *args: Any, **kwargs: Any) -> Any:
                t0 = now()  # work queued before this instruction is not its time
                try:
                    return fn(self, *args, **kwargs)
                finally:
                    setattr(clock, bucket, getattr(clock, bucket) + now() - t0)
            return run

        table = {}
        for k, v in type(engine)._INSTRUCTION_MAP.items():
            table[k] = timed(v, "compute") if k in compute else timed(v, "outside") if k in outside else v
        # An instance attribute shadows the class's instruction table for this engine only.
        engine._INSTRUCTION_MAP = table
        return clock

    def idle_fraction(self, step_seconds: float) -> float:
        schedule_s = max(step_seconds - self.outside, 1e-9)
        out = max(0.0, 1.0 - self.compute / schedule_s)
        self.compute = self.outside = 0.0
        return out
