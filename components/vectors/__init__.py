"""The vector database: embeddings, one Qdrant collection per dataset version, semantic near-duplicates.

    make_embedder(cfg)                     # components.vectors.embed
    index_dataset(ws, version, cfg)        # components.vectors.index
    EdgeCollections(ws.qdrant)             # components.vectors.edge: the embedded store, one process at a time
    semantic_near_duplicates(...)          # components.vectors.near_dups
"""
