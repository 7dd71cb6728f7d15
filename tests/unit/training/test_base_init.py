"""Fine-tuning from a local folder (training.model.init): what is refused before any work, the tokenizer
check between the data stage and training, and an export that keeps the base's architecture and tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from lmforge.components.errors import UserError
from lmforge.components.model.basemodel import check_base, copy_tokenizer, tokenizer_hash
from lmforge.components.sections.training import ModelConfig, TrainingConfig
from lmforge.components.training.job import check_base_dataset
from lmforge.components.training.layout import check_layout
from tests.checkpoints import KINDS


def copy_without(src: Path, dst: Path, *drop: str) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*drop))
    return dst


def test_a_missing_folder_is_refused_naming_the_key(tmp_path):
    with pytest.raises(UserError, match=r"training\.model\.init: .*nope is not a folder"):
        check_base(tmp_path / "nope")


def test_a_folder_without_config_json_is_refused(tmp_path, checkpoint):
    with pytest.raises(UserError, match="has no config.json"):
        check_base(copy_without(checkpoint("llama"), tmp_path / "m", "config.json"))


def test_pickle_only_weights_are_refused_with_the_conversion_named(tmp_path, checkpoint):
    folder = copy_without(checkpoint("llama"), tmp_path / "m", "*.safetensors")
    torch.save({"w": torch.zeros(1)}, folder / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"holds only pickle weights \(pytorch_model\.bin\); lmforge loads safetensors only.*"
                                        r"save_pretrained\(folder, safe_serialization=True\)"):
        check_base(folder)


def test_a_remote_code_only_config_is_refused(tmp_path, checkpoint):
    folder = copy_without(checkpoint("llama"), tmp_path / "m")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "my_remote_lm", "architectures": ["MyRemoteLM"],
        "auto_map": {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyRemoteLM"}}))
    with pytest.raises(UserError, match="'my_remote_lm'.* cannot read without remote code.*never sets trust_remote_code"):
        check_base(folder)


def test_an_architecture_name_transformers_lacks_is_refused(tmp_path, checkpoint):
    folder = copy_without(checkpoint("llama"), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["MyPatchedLlama"]}))
    with pytest.raises(UserError, match=r"names architectures \['MyPatchedLlama'\].*LlamaForCausalLM"):
        check_base(folder)


@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_a_native_checkpoint_passes_and_says_what_it_is(kind, checkpoint):
    base = check_base(checkpoint(kind))
    assert base.model_type == kind and base.architecture.startswith(("GPT2", "Qwen2"))
    assert len(base.sha256) == 64 and base.tokenizer_sha256 == tokenizer_hash(checkpoint(kind))


def test_size_keys_conflict_with_init_but_a_preset_is_ignored():
    with pytest.raises(ValidationError, match="hidden_size, tie_embeddings cannot be set together with init"):
        ModelConfig.model_validate({"init": "/m", "hidden_size": 32, "tie_embeddings": True})
    cfg = ModelConfig.model_validate({"init": "/m", "preset": "tiny"})  # configs/tiny.toml keeps its preset
    assert cfg.init == "/m"
    # The section crosses into the ranks as JSON, where every field reads as set: still valid.
    assert TrainingConfig.model_validate_json(TrainingConfig(model=cfg).model_dump_json()).model.init == "/m"


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_data_parallel_strategies_take_a_base(strategy):
    cfg = TrainingConfig.model_validate({"model": {"init": "/m"}, "parallel": {"strategy": strategy}, "num_ranks": 2,
                                         "max_steps": 10, "warmup_steps": 1})
    assert check_layout(cfg, vocab_size=512, world_size=2).dp == 2


def test_a_dataset_made_with_another_tokenizer_is_refused_before_launch(tmp_path, checkpoint):
    from tests.checkpoints import train_tokenizer

    base = checkpoint("gpt2")
    cfg = TrainingConfig.model_validate({"model": {"init": str(base)}})
    other = tmp_path / "other" / "tokenizer"
    train_tokenizer(vocab_size=400).save_pretrained(other)  # what a from-scratch data stage would leave
    with pytest.raises(UserError, match=r"was tokenised with another tokenizer than the base's.*Re-run the data stage "
                                        r"with the same training\.model\.init"):
        check_base_dataset(cfg, other)
    same = tmp_path / "same" / "tokenizer"
    copy_tokenizer(base, same)
    resolved, checked = check_base_dataset(cfg, same)
    assert checked is not None and resolved.model.init == str(base.resolve())


def test_the_data_stage_copies_the_base_tokenizer_and_ends_documents_with_its_eos(tmp_path, checkpoint):
    from transformers import AutoTokenizer

    from lmforge.components.data.corpuswork import copy_base_tokenizer
    from lmforge.components.data.tokenizer import encode_flat, eos_id_of, load_tokenizer

    base = checkpoint("qwen2")
    ref = copy_base_tokenizer(base, tmp_path / "tok")
    assert ref.sha256 == tokenizer_hash(base) and ref.verified()
    tok = load_tokenizer(Path(ref.dir))
    eos = eos_id_of(Path(ref.dir), tok)
    assert eos == AutoTokenizer.from_pretrained(base).eos_token_id
    flat, lengths = encode_flat(tok, ["hello world"], torch.zeros(0, dtype=torch.int32).numpy().dtype, eos_id=eos)
    assert flat[-1] == eos and lengths.tolist() == [len(flat)]


@pytest.mark.parametrize("kind", KINDS)
def test_the_export_keeps_the_base_architecture_tokenizer_and_logits(kind, tmp_path, checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmforge.components.sections.training import ModelConfig
    from lmforge.components.training.hf_export import write_export
    from lmforge.components.training.model import build_model, load_tokenizer, model_config

    base = checkpoint(kind)
    cfg = ModelConfig(init=str(base))
    tok = load_tokenizer(base)
    model = build_model(cfg, tok, seq_len=32, seed=0).eval()
    with torch.no_grad():  # a training step's worth of change, so the export is not the base itself
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = write_export(tmp_path / "export", model.state_dict(), model_config(cfg, tok, seq_len=32), tok,
                       dtype=torch.float32, meta={"base": {"path": str(base)}}, tokenizer_dir=base)
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.config.model_type == kind and type(back) is type(model)
    assert tokenizer_hash(out) == tokenizer_hash(base)
    assert AutoTokenizer.from_pretrained(out)("def f(x)").input_ids == AutoTokenizer.from_pretrained(base)("def f(x)").input_ids
    x = torch.randint(0, len(tok), (2, 16))
    with torch.no_grad():
        assert torch.equal(back(input_ids=x).logits, model(input_ids=x).logits)
