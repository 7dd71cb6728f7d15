"""The vector database: embeddings, one Qdrant collection per dataset version, semantic near-duplicates.

    make_embedder(cfg)                     # components.vectors.embed
    index_dataset(ws, version, cfg)        # components.vectors.index
    semantic_near_duplicates(...)          # components.vectors.near_dups
"""
