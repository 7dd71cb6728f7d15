import numpy as np
from transformers import PreTrainedTokenizerFast

from lmforge.components.data.tokenizer import SPECIALS, encode_flat, save_tokenizer, train_tokenizer
from lmforge.components.sections.data import TokenizerConfig

from .corpus import good_rows

TEXTS = [r["text"] for r in good_rows(200)]
ODD = 'def f(x):\n    """Ünïcödé — tabs\tand  double  spaces, emoji 🐍, CJK 漢字."""\n'


def test_round_trip_through_pretrained_tokenizer_fast(tmp_path):
    tok = train_tokenizer(TEXTS, TokenizerConfig(vocab_size=400))
    save_tokenizer(tok, tmp_path / "tok")
    hf = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    assert [hf.convert_tokens_to_ids(s) for s in SPECIALS] == [0, 1, 2, 3]
    assert (hf.pad_token, hf.bos_token, hf.eos_token, hf.unk_token) == SPECIALS
    for text in (TEXTS[0], ODD):
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert hf.decode(ids) == text
        assert hf.unk_token_id not in ids
    assert len(hf) == tok.get_vocab_size() <= 400


def test_documents_end_with_eos_and_training_is_deterministic():
    cfg = TokenizerConfig(vocab_size=400)
    a, b = train_tokenizer(TEXTS, cfg), train_tokenizer(TEXTS, cfg)
    assert a.to_str() == b.to_str()
    flat, lengths = encode_flat(a, TEXTS[:3], np.dtype(np.uint16))
    docs = np.split(flat, np.cumsum(lengths)[:-1])
    assert len(docs) == 3 and len(flat) == lengths.sum()
    assert all(d[-1] == 2 and 2 not in d[:-1] for d in docs)
    assert a.decode(docs[0][:-1].tolist()) == TEXTS[0]
