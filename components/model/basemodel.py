"""A Hugging Face causal-LM folder, local or registered, as the starting point of training (`[training.model] init`).

    base = check_base(Path("~/models/qwen2-0.5b"))     # UserError naming training.model.init when it cannot be used
    base.model_type, base.architecture, base.sha256     # "qwen2", "Qwen2ForCausalLM", the folder's content hash
    base.tokenizer_sha256                               # == tokenizer_hash(dataset_dir / "tokenizer") when the data
                                                        # stage tokenised with this base's tokenizer
    copy_tokenizer(base.path, out_dir)                  # the tokenizer files only, byte for byte

A folder is usable when it is what `huggingface-cli download` or `save_pretrained` leaves:
a config.json that transformers reads without remote code and maps to a causal-LM class it
implements natively, weights as `*.safetensors` (pickle checkpoints are refused: loading one
runs arbitrary code), and a fast tokenizer (tokenizer.json) that AutoTokenizer loads. The
data stage needs tokenizer.json because it encodes with the `tokenizers` library directly.

Both the data stage (copies the tokenizer) and training (loads the weights, refuses a dataset
made with another tokenizer) import this module, so both agree on what the tokenizer's hash is.

A registry reference (`models:/<name>@<alias>`, `models:/<name>/<version>`) becomes such a folder
in components/registry/basesource.py (resolve_base), which sets `ref` and `version` on the checked base.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.sections.training import parse_registry_ref
from lmforge.components.workspace import sha256_file, sha256_json, sha256_tree

KEY = "training.model.init"
PICKLE_GLOBS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
# The tokenizer's own files, whatever its class: transformers' fixed names plus the class's vocab files
# (vocab.json/merges.txt, tokenizer.model, ...), read from the loaded tokenizer in tokenizer_files.
TOKENIZER_COMMON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class BaseCheckpoint:
    """A checked base folder: what training loads and what lineage records."""

    path: Path
    model_type: str
    architecture: str          # the transformers class AutoModelForCausalLM builds for it
    tokenizer_sha256: str      # tokenizer_hash(path)
    vocab_size: int            # the embedding's rows (config.vocab_size), >= the tokenizer's length
    ref: str | None = None     # init as given when it is a registry reference ("models:/lmforge-lm@champion")
    version: str | None = None  # the registered version it resolved to ("3")

    @cached_property
    def sha256(self) -> str:
        """The whole folder's content hash (workspace.sha256_tree): read on first use, since it reads every weight."""
        return sha256_tree(self.path)

    def lineage(self) -> dict[str, str]:
        """What the export's lmforge.json, the MLflow run and the registered version record."""
        registry = {"ref": self.ref, "version": str(self.version)} if self.ref is not None else {}
        return {**registry, "path": str(self.path), "sha256": self.sha256, "model_type": self.model_type,
                "architecture": self.architecture, "tokenizer_sha256": self.tokenizer_sha256}

    @property
    def named(self) -> str:
        """How the user named it: the reference, or the folder."""
        return self.ref or str(self.path)

    def pin(self) -> dict[str, str] | None:
        """What the dataset's manifest records for a registry base (source.base), for training to pass as `pinned`."""
        return {"ref": self.ref, "version": str(self.version)} if self.ref is not None else None


def causal_lm_class(config: Any) -> type:
    """The transformers class AutoModelForCausalLM builds for `config` (KeyError when there is none)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def read_base_config(folder: Path, *, key: str = KEY) -> Any:
    """config.json read by transformers without remote code; refused when transformers has no causal LM for it."""
    import transformers
    from transformers import AutoConfig

    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError, KeyError or OSError for an unknown model_type
        raise UserError(key, folder, f"has a config.json (model_type {raw.get('model_type')!r}) that transformers cannot read "
                        f"without remote code ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
                        "Use a checkpoint of an architecture transformers implements natively; lmforge never sets "
                        "trust_remote_code") from None
    try:
        cls = causal_lm_class(config)
    except KeyError:
        raise UserError(key, folder, f"is a {config.model_type!r} model, which transformers has no causal-LM class for",
                        "Use a causal (decoder) language model checkpoint") from None
    # The names config.json gives must be transformers' own classes: a name only a repository's code defines
    # (auto_map) would mean the checkpoint was made for code lmforge does not run.
    foreign = [a for a in raw.get("architectures") or [] if getattr(transformers, a, None) is None]
    if foreign:
        raise UserError(key, folder, f"names architectures {foreign} that transformers does not implement (remote code)",
                        f"Use a checkpoint whose config.json names a transformers class such as {cls.__name__}")
    return config


def tokenizer_files(folder: Path, tokenizer: Any | None = None) -> list[Path]:
    """The files that make up the folder's tokenizer, sorted by name."""
    names = set(TOKENIZER_COMMON)
    if tokenizer is not None:
        names |= set(getattr(tokenizer, "vocab_files_names", {}).values())
    else:
        names |= {"vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "spiece.model"}
    return sorted((folder / n for n in names if (folder / n).is_file()), key=lambda p: p.name)


def tokenizer_hash(folder: Path) -> str:
    """The tokenizer's content hash: each tokenizer file's name and SHA-256, so extra files in the folder do not count."""
    return sha256_json({p.name: sha256_file(p) for p in tokenizer_files(Path(folder))})


def copy_tokenizer(base: Path, out: Path) -> list[str]:
    """Copy the base's tokenizer files into `out` (byte for byte, so tokenizer_hash(out) == tokenizer_hash(base))."""
    out.mkdir(parents=True, exist_ok=True)
    files = tokenizer_files(Path(base))
    for p in files:
        shutil.copyfile(p, out / p.name)
    return [p.name for p in files]


def check_weights(folder: Path, *, key: str = KEY) -> list[Path]:
    """The folder's safetensors files; a pickle-only or weightless folder is refused."""
    safetensors = sorted(folder.glob("*.safetensors"))
    if safetensors:
        return safetensors
    pickles = sorted({p.name for g in PICKLE_GLOBS for p in folder.glob(g)})
    if pickles:
        raise UserError(key, folder, f"holds only pickle weights ({', '.join(pickles[:3])}); lmforge loads safetensors only "
                        "(a pickle runs code when loaded)",
                        "Convert it: AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, "
                        "safe_serialization=True), then point init at the result")
    raise UserError(key, folder, "holds no weights (*.safetensors)",
                    "Point it at a folder save_pretrained or huggingface-cli download wrote")


def check_base(folder: str | Path, *, key: str = KEY) -> BaseCheckpoint:
    """Everything that can be checked of a base folder before any data is tokenised or any rank starts."""
    if parse_registry_ref(str(folder)) is not None:
        raise UserError(key, folder, "is a registry reference, not a folder",
                        "Resolve it with lmforge.components.registry.basesource.resolve_base(ws, init)")
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise UserError(key, path, "is not a folder", "Point it at a local Hugging Face model folder (config.json, "
                        "*.safetensors, a tokenizer), or unset it to train from a preset")
    path = path.resolve()
    if not (path / "config.json").is_file():
        raise UserError(key, path, "has no config.json", "Point it at the folder save_pretrained or huggingface-cli "
                        "download wrote (the one holding config.json)")
    config = read_base_config(path, key=key)
    check_weights(path, key=key)
    if not (path / "tokenizer.json").is_file():
        raise UserError(key, path, "has no tokenizer.json (a fast tokenizer); lmforge tokenises with the base's own "
                        "tokenizer", "Save one beside the weights: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any failure to load means the data stage cannot use it either
        raise UserError(key, path, f"has a tokenizer AutoTokenizer cannot load ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]})", "Save the model's tokenizer into the folder") from None
    if tok.eos_token_id is None:
        raise UserError(key, path, "has a tokenizer without an end-of-sequence token; the data stage ends every "
                        "document with it", "Set eos_token in its tokenizer_config.json")
    vocab = int(config.get_text_config().vocab_size)
    if len(tok) > vocab:
        raise UserError(key, path, f"has a tokenizer of {len(tok)} tokens for an embedding of {vocab} rows",
                        "Resize the model's embeddings to the tokenizer (resize_token_embeddings) and save it again")
    return BaseCheckpoint(path=path, model_type=config.model_type, architecture=causal_lm_class(config).__name__,
                          tokenizer_sha256=tokenizer_hash(path), vocab_size=vocab)
