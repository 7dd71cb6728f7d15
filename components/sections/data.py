"""The [data] table: sources, validation, cleaning, dedup, split, tokenizer.

    [data]
    source = "/corpus.jsonl"          # unset = the built-in stdlib docstring corpus
    max_docs = 400
    dedup.threshold = 0.85            # sub-tables may be written as dotted keys or [data.dedup]
    tokenizer.vocab_size = 1024
    validation.completion_field = "answer"   # user records: {"text"}, {"prompt", "completion"} or {"messages": [...]}
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ._base import Section


class ValidationConfig(Section):
    """What makes a record bad enough to quarantine, and which fields of a user record mean what.

    A user record is a document ({text}), a prompt-completion pair ({prompt, completion}) or a chat
    ({messages: [{role, content}, ...]}, ending with the assistant's reply); components/data/validate.py
    says how each becomes a Record.
    """

    max_chars: int = Field(20_000, ge=16, description="a document longer than this (in characters) is quarantined as too_long")
    text_field: str = Field("text", min_length=1, description="user files: the field holding the document")
    id_field: str = Field("id", min_length=1, description="user files: the optional field holding a unique record id")
    prompt_field: str = Field("prompt", min_length=1,
                              description="user files: optional generation prompt (becomes the record's signature); "
                                          "with completion_field and no text_field, the prompt of a fine-tuning pair")
    completion_field: str = Field("completion", min_length=1,
                                  description="user files: the completion of a prompt-completion pair, for records with "
                                              "no text_field (becomes the record's docstring and summary)")
    messages_field: str = Field("messages", min_length=1,
                                description="user files: a chat, a list of {role, content} (system/user/assistant) "
                                            "ending with the assistant's reply, for records with no text_field (CSV: "
                                            "the list as a JSON string)")
    reference_field: str = Field("reference", min_length=1,
                                 description="user files: optional generation reference (becomes the record's summary)")
    group_field: str = Field("module", min_length=1,
                             description="user files: optional grouping key; a group never spans two splits (default: each "
                                         "record its own group)")


class DedupConfig(Section):
    """Exact dedup on the content hash, then near-duplicate removal with MinHash LSH."""

    enabled: bool = Field(True, description="turn near-duplicate removal off (exact duplicates are always removed)")
    threshold: float = Field(0.85, gt=0, lt=1,
                             description="Jaccard similarity of word shingles above which two documents are near-duplicates")
    num_perm: int = Field(64, ge=16, le=1024, description="MinHash permutations; more is slower and more exact")
    shingle: int = Field(5, ge=1, le=32, description="word n-gram size of the shingles")


class SplitConfig(Section):
    """Train/validation/test by group (the module), so that no group sits in two splits."""

    validation: float = Field(0.05, ge=0, lt=0.5, description="fraction of documents for validation")
    test: float = Field(0.05, ge=0, lt=0.5, description="fraction of documents for test")

    @model_validator(mode="after")
    def _leaves_training_data(self) -> "SplitConfig":
        if self.validation + self.test >= 0.9:
            raise ValueError(f"validation + test = {self.validation + self.test:.2f} leaves almost nothing to train on; "
                             "keep it below 0.9")
        return self


class TokenizerConfig(Section):
    """A byte-level BPE tokenizer trained on the train split."""

    vocab_size: int = Field(4096, ge=300, le=200_000,
                            description="target vocabulary size, special tokens and the 256 bytes included")
    min_frequency: int = Field(2, ge=1, description="a merge must occur at least this often")
    train_chars: int | None = Field(8_000_000, ge=1000,
                                    description="train on the first N characters of the train split (in corpus order); unset = "
                                                "all of it. The vocabulary settles long before a large corpus ends")


class DataConfig(Section):
    """Ingest → validate → clean → dedup → split → features → tokenizer → shards."""

    source: str | None = Field(
        None, description="JSONL/Parquet/CSV file or folder of .txt files; unset = the built-in stdlib docstring corpus")
    include_site_packages: bool = Field(False, description="add site-packages docstrings to the built-in corpus")
    skip_tests: bool = Field(True, description="built-in corpus: leave out test packages (test/, tests/, idle_test/)")
    max_docs: int | None = Field(None, ge=1, description="keep only N documents, drawn with the seed before validation")
    seed: int = Field(0, description="seed for sampling and splitting")
    workers: int | None = Field(None, ge=1, le=256,
                                description="local Dask worker processes that run the per-shard steps; "
                                            "unset = every CPU this process may use")
    cluster_address: str | None = Field(
        None, description="a running Dask scheduler (tcp://host:8786) to run the per-shard steps on instead of a local cluster")
    runner: Literal["dask", "threads"] = Field(
        "dask", description="dask: worker processes (every core); threads: in this process (for debugging and tests)")
    shard_mb: float = Field(8.0, gt=0, le=4096,
                            description="input bytes per shard; peak memory per worker grows with it, not with the corpus")
    validation: ValidationConfig = ValidationConfig()
    dedup: DedupConfig = DedupConfig()
    split: SplitConfig = SplitConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
