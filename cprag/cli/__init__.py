"""The `cprag` command: a table of command names and the functions that run them.

Each command lives beside its logic (`cprag.cli.index`, `ask`, `serve`, `train`, `eval`) as a thin wrapper that
parses flags, calls one library function, and renders the result; stdout carries data (`--json`), stderr carries
chatter and progress. Importing this package loads no torch: command bodies import what they need when they run.
"""

from __future__ import annotations

import sys

import typer

from cprag.cli.ask import ask_command
from cprag.cli.eval import (
    eval_bench_command,
    eval_needle_command,
    eval_scale_command,
    eval_squad2_command,
    eval_squad_command,
)
from cprag.cli.index import index_command, info_command
from cprag.cli.serve import serve_command
from cprag.cli.train import model_command, score_command, train_command

# in the order `cprag --help` lists them
COMMANDS = {
    "model": model_command,
    "score": score_command,
    "index": index_command,
    "ask": ask_command,
    "info": info_command,
    "serve": serve_command,
    "train": train_command,
}
EVAL_COMMANDS = {
    "squad": eval_squad_command,
    "squad2": eval_squad2_command,
    "scale": eval_scale_command,
    "bench": eval_bench_command,
    "needle": eval_needle_command,
}


def build_app() -> typer.Typer:
    """The `cprag` app: every command of COMMANDS, and the `eval` group of EVAL_COMMANDS."""
    root = typer.Typer(
        add_completion=False,
        no_args_is_help=True,
        help="Question answering from documents the language model never reads (Copy-Paste LM keys).",
    )
    for name, command in COMMANDS.items():
        root.command(name)(command)
    evaluation = typer.Typer(no_args_is_help=True, help="Evaluation: batch QA against baselines, and benchmarks.")
    for name, command in EVAL_COMMANDS.items():
        evaluation.command(name)(command)
    root.add_typer(evaluation, name="eval")
    return root


app = build_app()


def with_optional_values(argv: list[str], options: dict[str, str]) -> list[str]:
    """`argv` with each option of `options` that is given no value (last, or followed by another option) given its
    default: `cprag index C --ray --json` means `--ray local`. Click has no options with an optional value."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg in options and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append(options[arg])
    return out


def main() -> None:
    sys.argv = with_optional_values(sys.argv, {"--ray": "local"})
    app()
