"""The pipeline configs that ship with lmforge, as package data.

    lmforge run all --config demo        # a packaged name (demo, tiny) or a path to a TOML file
    lmforge.components.runtime.resources.packaged_config("tiny")   # -> the path of tiny.toml

demo.toml is the default: it runs end to end on a 2-core CPU machine in minutes.
tiny.toml is the smallest config that runs every stage; the tests use it.
"""
