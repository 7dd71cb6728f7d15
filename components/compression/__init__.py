"""Compression: each technique maps a model folder plus its own config section to a new model folder.

    from lmforge.components.compression.quantize import quantize_int8_variant, cast_variant
    from lmforge.components.compression.prune import prune_variant, prune_channels_variant
    from lmforge.components.compression.distill import distill_variant
    from lmforge.components.compression.lowrank import lowrank_variant
    from lmforge.components.compression.lora import lora_variant
    from lmforge.components.compression.variant import load_variant          # rebuilds any of them, no pickle
    from lmforge.components.compression.tradeoff import tradeoff_rows, choose_compressed, tradeoff_chart

Every variant folder carries lmforge.json: the technique, its recipe, how to load it and
its parent (see variant.py).
"""
