"""CLI command groups, one module each; `flows/cli.py` mounts them."""
