"""`python -m cprag.cli`: the `cprag` command."""

from cprag.cli import main

main()
