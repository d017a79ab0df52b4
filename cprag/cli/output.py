"""What every command shares on the way out: stdout for data, stderr for chatter, and one line per library error.

stdout carries data (`--json`, tables), stderr carries progress and messages, so `cprag ... --json | jq` works.
"""

from __future__ import annotations

import functools
import json
import sys
import time

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


def script_main(run, argv: list[str] | None = None) -> int:
    """A pipeline script's entry point: `run(argv)`, with a library error (a bad file, cache or setting) as one
    line on stderr and its exit code; nothing stored is touched."""
    try:
        return run(argv)
    except CpragError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code


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
    """A progress bar on stderr; `transient` (with --json) clears it when done. When stderr is a file or a pipe
    (a background job's log), a rich bar draws nothing until the end, so plain lines are written instead."""
    if not err.is_terminal:
        return PlainProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    return Progress(*columns, console=err, transient=transient)


class PlainProgress:
    """The part of rich's Progress the commands use, as one stderr line per task at most every `every_s` seconds
    (and at the end): `description: done/total (pct) elapsed, ~remaining`."""

    def __init__(self, every_s: float = 30.0):
        self.every_s = every_s
        self.tasks: dict[int, dict] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        for task_id, task in self.tasks.items():
            if task["written"] != task["done"]:
                self._write(task_id)

    def add_task(self, description: str, total: float | None = None, **_) -> int:
        task_id = len(self.tasks)
        now = time.monotonic()
        self.tasks[task_id] = {"description": description, "total": total, "done": 0, "started": now,
                               "last": now, "written": None}
        return task_id

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, completed=self.tasks[task_id]["done"] + advance)

    def update(self, task_id: int, completed: float | None = None, total: float | None = None, **_) -> None:
        task = self.tasks[task_id]
        if total is not None:
            task["total"] = total
        if completed is not None:
            task["done"] = completed
        finished = task["total"] is not None and task["done"] >= task["total"]
        if finished or time.monotonic() - task["last"] >= self.every_s:
            self._write(task_id)

    def _write(self, task_id: int) -> None:
        task = self.tasks[task_id]
        task["last"], task["written"] = time.monotonic(), task["done"]
        elapsed = task["last"] - task["started"]
        line = f"{task['description']}: {task['done']:g}"
        if task["total"]:
            share = task["done"] / task["total"]
            line += f"/{task['total']:g} ({100 * share:.0f}%)"
            if 0 < share < 1:
                line += f", ~{elapsed * (1 - share) / share:.0f}s left"
        err.file.write(f"{line}, {elapsed:.0f}s\n")
        err.file.flush()
