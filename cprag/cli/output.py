"""What every command shares on the way out: stdout for data, stderr for chatter, and one line per library error.

stdout carries data (`--json`, tables), stderr carries progress and messages, so `cprag ... --json | jq` works.
"""

from __future__ import annotations

import functools
import json
import sys

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cprag.errors import CpragError

err = Console(stderr=True)
out = Console()


def reports_errors(command):
    """Turn library errors into one line on stderr and a non-zero exit; only the CLI does this."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except CpragError as error:
            # escaped: a message naming `cprag[cluster]` or a list must not be read as rich markup
            err.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
            raise typer.Exit(error.exit_code) from None
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None

    return wrapper


def emit_json(payload: dict) -> None:
    sys.stdout.write(json.dumps(payload, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def print_key_values(info: dict, nested=(dict,)) -> None:
    """One row per key, no header: values of the `nested` types as JSON, the rest as text."""
    table = Table(show_header=False, box=None)
    for key, value in info.items():
        table.add_row(key, json.dumps(value) if isinstance(value, nested) else str(value))
    out.print(table)


def print_figures(title: str, figures: dict, name: str = "figure") -> None:
    """A titled two-column table of `name`s and their values, values right-aligned."""
    table = Table(title=title)
    table.add_column(name)
    table.add_column("value", justify="right")
    for key, value in figures.items():
        table.add_row(key, str(value))
    out.print(table)


def progress_bar(transient: bool):
    """A progress bar on stderr; `transient` (with --json) clears it when done."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    return Progress(*columns, console=err, transient=transient)
