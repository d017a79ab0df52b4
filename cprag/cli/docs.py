"""docs/cli.md from the commands themselves: every command's and subcommand's `--help`, as a terminal 100 columns
wide without colour shows it. `make docs` (or `python -m cprag.cli.docs`) rewrites the file, and a test fails when
it no longer matches the commands.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path

DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
WIDTH = 100
# the environment the help is rendered in, so the text is the same on every machine and terminal
PLAIN_TERMINAL = {"NO_COLOR": "1", "COLUMNS": str(WIDTH), "TERM": "dumb", "TERMINAL_WIDTH": str(WIDTH)}

HEADER = """# The `cprag` command line

Every command's `--help`, generated from the commands by `make docs` (`python -m cprag.cli.docs`); do not edit it
by hand. `tests/cli/test_cli_docs.py` fails when this file no longer matches them.
"""


@contextlib.contextmanager
def plain_terminal() -> Iterator[None]:
    """Typer's rich help at WIDTH columns, no colour and no terminal codes; the settings are restored after."""
    from typer import rich_utils

    saved_env = {name: os.environ.get(name) for name in PLAIN_TERMINAL}
    saved = (rich_utils.MAX_WIDTH, rich_utils.COLOR_SYSTEM, rich_utils.FORCE_TERMINAL)
    os.environ.update(PLAIN_TERMINAL)
    rich_utils.MAX_WIDTH, rich_utils.COLOR_SYSTEM, rich_utils.FORCE_TERMINAL = WIDTH, None, False
    try:
        yield
    finally:
        rich_utils.MAX_WIDTH, rich_utils.COLOR_SYSTEM, rich_utils.FORCE_TERMINAL = saved
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def command_help(command, context) -> str:
    """What `--help` prints for `command` in `context`, trailing spaces and outer blank lines removed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        returned = command.get_help(context)  # typer's rich help prints; plain click returns the text
    text = printed.getvalue() + (returned or "")
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


def help_sections(command, context) -> Iterator[tuple[str, str]]:
    """(command path, help text) for `command` and, depth first in the order --help lists them, its subcommands."""
    yield context.command_path, command_help(command, context)
    list_commands = getattr(command, "list_commands", None)
    for name in list_commands(context) if list_commands else []:
        subcommand = command.get_command(context, name)
        yield from help_sections(subcommand, subcommand.context_class(subcommand, info_name=name, parent=context))


def render() -> str:
    """The text of docs/cli.md for the commands as they are now."""
    from typer.main import get_command

    from cprag.cli import app

    with plain_terminal():
        root = get_command(app)
        sections = [f"## `{path}`\n\n```text\n{text}\n```\n"
                    for path, text in help_sections(root, root.context_class(root, info_name="cprag"))]
    return HEADER + "\n" + "\n".join(sections)


def main(argv: list[str] | None = None) -> None:
    """Write docs/cli.md (or the path given)."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else DOCS_PATH
    path.write_text(render(), encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
