"""`python -m lmforge.cli ...` is the `lmforge` console script."""

from lmforge.cli.cli import main

main()
