"""`python -m cprag`: the `cprag` command."""

from cprag.cli import main

main()
