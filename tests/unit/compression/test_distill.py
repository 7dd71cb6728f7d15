import pytest
import torch

from lmforge.components.compression.distill import distill_variant, layer_map
from lmforge.components.compression.variant import load_variant, read_meta
from lmforge.components.errors import UserError
from lmforge.components.sections.compression import DistillConfig


def _params(model):
    return sum(p.numel() for p in model.parameters())


def test_student_is_smaller_and_learns_from_the_teacher(tiny_model_dir, tmp_path, tuner):
    out = distill_variant(tiny_model_dir, tmp_path / "d", DistillConfig(num_layers=1, steps=8), tuner=tuner)
    student, teacher = load_variant(out), load_variant(tiny_model_dir)
    assert student.config.num_hidden_layers == 1 < teacher.config.num_hidden_layers
    assert _params(student) < _params(teacher)
    meta = read_meta(out)
    losses = meta["recipe"]["losses"]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert meta["recipe"]["init"] == "teacher layers [1]"
    # Initialised from the teacher: embeddings start as the teacher's and move only a little in 8 steps.
    assert torch.allclose(student.model.embed_tokens.weight, teacher.model.embed_tokens.weight, atol=0.05)


def test_a_narrower_student_starts_from_scratch(tiny_model_dir, tmp_path, tuner):
    out = distill_variant(tiny_model_dir, tmp_path / "d", DistillConfig(num_layers=2, hidden_size=32, steps=2), tuner=tuner)
    student = load_variant(out)
    assert student.config.hidden_size == 32 and student.config.intermediate_size == 64
    assert read_meta(out)["recipe"]["init"] == "random"


@pytest.mark.parametrize("kwargs, problem", [
    ({"num_layers": 3}, "is larger than the teacher"),
    ({"hidden_size": 128}, "is larger than the teacher"),
    ({"num_layers": 2}, "would not be smaller"),
])
def test_a_student_not_smaller_than_the_teacher_is_refused_before_any_work(tiny_model_dir, tmp_path, tuner, kwargs, problem):
    with pytest.raises(UserError, match=problem):
        distill_variant(tiny_model_dir, tmp_path / "d", DistillConfig(**kwargs), tuner=tuner)
    assert not (tmp_path / "d").exists()


def test_layer_map_keeps_first_and_last():
    assert layer_map(8, 4) == [0, 2, 5, 7]
    assert layer_map(8, 1) == [7]
    assert layer_map(2, 2) == [0, 1]
