"""One pydantic model per stage: each file is one `[table]` of the pipeline TOML.

`components/config.py` assembles them into `PipelineConfig`. A stage's functions take
only their own section, never the root.
"""
