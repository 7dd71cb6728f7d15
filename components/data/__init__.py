"""The data stage: ingest, validate, clean, deduplicate, featurise, split, tokenize, shard."""
