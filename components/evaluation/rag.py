"""Retrieval-augmented prompts for evaluation, or the reason they cannot be built.

    rag = build_rag(ws, cfg.vectors, cfg.features, k=2, dataset_version=v)
    if rag.augment is None:
        print("RAG skipped:", rag.reason)
    else:
        prompt = rag.augment(generation_prompt(signature))

`components.vectors.retrieval` (the vector store and feature store) is imported here, lazily, so
evaluation works without it. Before any scoring, one probe query is made; a missing
module, an unbuilt store or a failing query skips RAG with that reason: nothing is ever
scored under a RAG label without retrieval having happened. A store held by another process
is not such a reason: retrieval waits for it (vectors.lock_wait_s), then its error propagates.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from lmforge.components.workspace import Workspace

PROBE_PROMPT = 'def probe(x):\n    """'


@dataclass(frozen=True)
class Rag:
    augment: Callable[[str], str] | None
    reason: str | None = None


def build_rag(ws: Workspace, vectors: Any, features: Any, *, k: int, dataset_version: str | None) -> Rag:
    try:
        from lmforge.components.vectors.retrieval import format_context, retrieve
    except ImportError as e:
        return Rag(None, f"components.vectors.retrieval is not available ({e})")

    def augment(prompt: str) -> str:
        examples = retrieve(prompt, k, ws=ws, vectors=vectors, features=features, dataset_version=dataset_version)
        return format_context(examples, prompt)

    try:
        found = retrieve(PROBE_PROMPT, k, ws=ws, vectors=vectors, features=features, dataset_version=dataset_version)
    except Exception as e:  # an unbuilt store is a reason to skip, stated in the report; a held one is an error
        if store_busy(e):
            raise
        return Rag(None, f"retrieval failed: {type(e).__name__}: {e}")
    if not found:
        return Rag(None, "retrieval returned no examples (is the vector store built for this dataset?)")
    return Rag(augment)


def store_busy(e: BaseException) -> bool:
    """True for a vector store another process held past the wait bound: an error to raise, never a reason to skip RAG."""
    try:
        from lmforge.components.vectors.edge import StoreBusy
    except ImportError:
        return False
    return isinstance(e, StoreBusy)


def held() -> AbstractContextManager[Any]:
    """The vector store held across a batch of retrievals (one shard load for all of them), when retrieval is here."""
    try:
        from lmforge.components.vectors.edge import stores_held
    except ImportError:
        return nullcontext()
    return stores_held()


def release() -> None:
    """Let go of the vector store (a local-mode Qdrant folder admits one process at a time)."""
    try:
        from lmforge.components.vectors.index import close_clients
    except ImportError:
        return
    close_clients()
