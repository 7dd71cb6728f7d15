"""A byte-level BPE tokenizer trained with Hugging Face `tokenizers`, and document encoding.

    tok = train_tokenizer(train_texts, TokenizerConfig(vocab_size=4096))
    save_tokenizer(tok, out_dir)               # tokenizer.json + config, loads with PreTrainedTokenizerFast
    flat, lengths = encode_flat(tok, texts, np.dtype(np.uint16))   # ids, <eos> after each text
    flat, lengths = encode_flat(tok, texts, dtype, eos_id=eos_id_of(tok_dir, tok))   # a base's own end token

Special tokens, in this order (ids 0-3): <pad> <bos> <eos> <unk>. Byte-level means any
text round-trips: decode(encode(text)) == text, with no unknown tokens. A base model's
tokenizer (copied by the data stage, components/model/basemodel.py) ends documents with its
own end-of-sequence token, which its tokenizer_config.json names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Sized
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lmforge.components.sections.data import TokenizerConfig

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD, BOS, EOS, UNK = SPECIALS


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                  special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts) if isinstance(texts, Sized) else None)
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2, 3]
    return tok


def as_transformers(tok: Tokenizer):  # -> PreTrainedTokenizerFast (imported lazily: transformers is slow to import)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
                                   clean_up_tokenization_spaces=False)


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> Path:
    """`PreTrainedTokenizerFast.save_pretrained` output: tokenizer.json, tokenizer_config.json, ..."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    as_transformers(tok).save_pretrained(str(out_dir))
    assert (out_dir / "tokenizer.json").is_file()
    return out_dir


def load_tokenizer(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))


def eos_id_of(tok_dir: Path, tok: Tokenizer) -> int:
    """The id of the end-of-sequence token tokenizer_config.json names (<eos> when it names none)."""
    import json

    config = Path(tok_dir) / "tokenizer_config.json"
    name = json.loads(config.read_text(encoding="utf-8")).get("eos_token") if config.is_file() else None
    if isinstance(name, dict):  # an AddedToken written out in full
        name = name.get("content")
    eos = tok.token_to_id(name or EOS)
    if eos is None:
        raise ValueError(f"{tok_dir}: the end-of-sequence token {name or EOS!r} is not in tokenizer.json")
    return eos


def encode_flat(tok: Tokenizer, texts: Sequence[str], dtype: np.dtype, *, eos_id: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """(flat, lengths): every text's token ids followed by <eos> (or `eos_id`), concatenated; lengths include it."""
    eos = tok.token_to_id(EOS) if eos_id is None else eos_id
    encs = tok.encode_batch_fast(list(texts), add_special_tokens=False) if len(texts) else []
    lengths = np.fromiter((len(e) + 1 for e in encs), dtype=np.int64, count=len(encs))  # len(e): no list of its ids
    flat = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for e, n in zip(encs, lengths.tolist()):
        flat[pos:pos + n - 1] = e.ids
        flat[pos + n - 1] = eos
        pos += n
    return flat, lengths
