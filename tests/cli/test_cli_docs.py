"""docs/cli.md is every command's --help as it is now, and the command table stays cheap to import."""

import os
import subprocess
import sys
from types import SimpleNamespace

from cprag.cli import COMMANDS, EVAL_COMMANDS
from cprag.cli.ask import citation_place
from cprag.cli.docs import DOCS_PATH, render


def test_docs_cli_md_is_the_commands_help():
    assert DOCS_PATH.read_text(encoding="utf-8") == render(), "docs/cli.md is stale: run make docs"


def test_every_command_has_json_and_an_example_in_its_help():
    text = render()
    for name in [*COMMANDS, *(f"eval {name}" for name in EVAL_COMMANDS)]:
        section = text.split(f"## `cprag {name}`\n", 1)[1].split("\n## ", 1)[0]
        assert "Example: cprag" in section, name
        assert "--json" in section or name == "serve", name  # serve answers over HTTP, not on stdout


def test_importing_the_command_table_loads_no_torch():
    code = "import sys, cprag.cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_python_dash_m_cprag_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "cprag", "--help"], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "100", "NO_COLOR": "1"})
    assert result.returncode == 0 and "eval" in result.stdout


def test_citations_show_their_page_and_anchor_when_they_have_one():
    assert citation_place(SimpleNamespace(start=0, end=3)) == ""
    assert citation_place(SimpleNamespace(page=12, anchor=None)) == " p. 12"
    assert citation_place(SimpleNamespace(page=None, anchor="install")) == " #install"
    assert citation_place(SimpleNamespace(page=3, anchor="#setup")) == " p. 3 #setup"
