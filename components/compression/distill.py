"""Knowledge distillation: a smaller student trained on the teacher's soft targets.

    out = distill_variant(model_dir, out / "distill", DistillConfig(num_layers=2, steps=50), tuner=tuner)

The student is the teacher's architecture with fewer layers and/or a narrower width. At
the teacher's width it starts from the teacher: embeddings, final norm, head and an
evenly spaced subset of its layers (first and last kept), which recovers far faster than
a random start; the layers are the decoder blocks found by structure (the longest
ModuleList of one block class: `model.layers`, GPT-2's `transformer.h`, ...), so any
causal LM works. A narrower student starts from a seeded random init. The loss is

    alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, data)

(the T^2 keeps the KL gradient's scale independent of T, as in Hinton et al. 2015).

Training runs on the shared compression fine-tune loop (finetune.py: the training stage's
data loader, one process, on the device and in the precision it picks; the teacher sits on
the same device). Distilling with the DeepSpeed launcher would need a rank entry
point that holds a frozen teacher beside the engine; at the tens of steps used here one
process is faster than starting ranks.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.components.compression.finetune import Finetuner, LossFn
from lmforge.components.compression.modules import require_linear
from lmforge.components.compression.variant import load_parent, save_variant
from lmforge.components.errors import UserError
from lmforge.components.model.projections import decoder_blocks
from lmforge.components.sections.compression import DistillConfig


def student_config(teacher_config, cfg: DistillConfig):
    """The student's config, or a UserError when it would not be smaller than the teacher."""
    layers_t, hidden_t = teacher_config.num_hidden_layers, teacher_config.hidden_size
    layers = cfg.num_layers if cfg.num_layers is not None else max(1, layers_t // 2)
    hidden = cfg.hidden_size if cfg.hidden_size is not None else hidden_t
    if layers > layers_t or hidden > hidden_t:
        raise UserError("compression.distill", f"{layers} layers x {hidden} wide",
                        f"is larger than the teacher ({layers_t} layers x {hidden_t} wide)",
                        "Choose num_layers and hidden_size no larger than the teacher's")
    if (layers, hidden) == (layers_t, hidden_t):
        raise UserError("compression.distill", f"{layers} layers x {hidden} wide",
                        "is the teacher's own size, so the student would not be smaller",
                        "Lower num_layers or hidden_size")
    heads = teacher_config.num_attention_heads
    kv = getattr(teacher_config, "num_key_value_heads", heads) or heads
    if hidden % heads or heads % kv:
        raise UserError("compression.distill.hidden_size", hidden, f"is not a multiple of the teacher's {heads} heads",
                        f"Choose a multiple of {heads}")
    student = copy.deepcopy(teacher_config)
    student.num_hidden_layers = layers
    if getattr(student, "layer_types", None) is not None:
        # transformers' per-layer list (full or sliding attention) must match the layer count: the picked layers'.
        student.layer_types = [teacher_config.layer_types[i] for i in layer_map(layers_t, layers)]
    if hidden != hidden_t:
        student.hidden_size = hidden
        student.head_dim = hidden // heads
        # A config without intermediate_size (GPT-2: n_inner unset = 4 x hidden) scales with hidden by itself.
        if getattr(teacher_config, "intermediate_size", None):
            student.intermediate_size = max(8, round(teacher_config.intermediate_size * hidden / hidden_t))
    return student


def layer_map(teacher_layers: int, student_layers: int) -> list[int]:
    """Evenly spaced teacher layers for the student, first and last included."""
    if student_layers == 1:
        return [teacher_layers - 1]
    return [round(i * (teacher_layers - 1) / (student_layers - 1)) for i in range(student_layers)]


def init_student(teacher: nn.Module, config, *, seed: int) -> tuple[nn.Module, list[int] | None]:
    """The student, seeded; at the teacher's width it starts from the teacher: every tensor outside the decoder
    blocks, and the picked blocks in order. The blocks are found by structure (projections.decoder_blocks)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if config.hidden_size != teacher.config.hidden_size:
        return student, None
    t_blocks, s_blocks = decoder_blocks(teacher), decoder_blocks(student)
    assert t_blocks is not None and s_blocks is not None, "a causal LM without a ModuleList of decoder blocks"
    picked = layer_map(len(t_blocks[1]), len(s_blocks[1]))
    t_prefix, s_prefix = t_blocks[0] + ".", s_blocks[0] + "."
    mapped = {}
    for key, value in teacher.state_dict().items():
        if key.startswith(t_prefix):
            idx, rest = key[len(t_prefix):].split(".", 1)
            for s_idx, t_idx in enumerate(picked):
                if int(idx) == t_idx:
                    mapped[f"{s_prefix}{s_idx}.{rest}"] = value
        else:
            mapped[key] = value
    missing, unexpected = student.load_state_dict(mapped, strict=False)
    # Every parameter comes from the teacher; only buffers the teacher does not store (rotary tables) may be absent.
    params = dict(student.named_parameters(remove_duplicate=False))
    assert not unexpected and not [k for k in missing if k in params], (missing, unexpected)
    return student, picked


def distill_loss(teacher: nn.Module, *, temperature: float, alpha: float) -> LossFn:
    def loss(student: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t_logits = teacher(input_ids=x).logits.float()
        s_logits = student(input_ids=x).logits.float()
        ce = F.cross_entropy(s_logits.flatten(0, 1), y.flatten())
        if alpha == 0:
            return ce
        t = temperature
        kl = F.kl_div(F.log_softmax(s_logits / t, -1).flatten(0, 1), F.log_softmax(t_logits / t, -1).flatten(0, 1),
                      log_target=True, reduction="batchmean") * t * t
        return alpha * kl + (1 - alpha) * ce
    return loss


def distill_variant(model_dir: Path, out_dir: Path, cfg: DistillConfig, *, tuner: Finetuner | None, seed: int = 0) -> Path:
    teacher, parent = load_parent(model_dir)
    require_linear(teacher, model_dir)
    config = student_config(teacher.config, cfg)
    if tuner is None:
        raise UserError("compression.distill", "enabled", "needs training data but none was given",
                        "Run the data stage first, or disable [compression.distill]")
    student, picked = init_student(teacher, config, seed=seed)
    teacher.requires_grad_(False)
    teacher.to(tuner.device)  # beside the student, which the tuner moves to its device for the run
    losses = tuner.run(student, steps=cfg.steps, loss_fn=distill_loss(teacher, temperature=cfg.temperature, alpha=cfg.alpha))
    recipe = {**cfg.model_dump(mode="json"),
              "teacher": {"layers": teacher.config.num_hidden_layers, "hidden_size": teacher.config.hidden_size},
              "student": {"layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                          "intermediate_size": getattr(config, "intermediate_size", None)},
              "init": f"teacher layers {picked}" if picked is not None else "random", "losses": losses,
              "device": tuner.device.type, "precision": tuner.precision.to_dict()}
    return save_variant(student, out_dir, parent_dir=parent, technique="distill", recipe=recipe)
