"""The `cprag` command: thin wrappers that parse flags, call one library function, and render the result.

stdout carries data (`--json`), stderr carries chatter and progress.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from cprag.errors import CpragError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Question answering from documents the language model never reads (Copy-Paste LM keys).",
)
err = Console(stderr=True)
out = Console()

CHECKPOINT_OPTION = typer.Option(None, "--checkpoint", help="CPLM checkpoint directory (default: the shipped one).")
JSON_OPTION = typer.Option(False, "--json", help="Write one JSON object to stdout instead of tables.")


def reports_errors(command):
    """Turn library errors into one line on stderr and a non-zero exit; only the CLI does this."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except CpragError as error:
            err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
            raise typer.Exit(error.exit_code) from None
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None

    return wrapper


def emit_json(payload: dict) -> None:
    sys.stdout.write(json.dumps(payload, ensure_ascii=False) + "\n")
    sys.stdout.flush()


@app.command("model")
@reports_errors
def model_command(
    checkpoint: Path = CHECKPOINT_OPTION,
    bench: bool = typer.Option(False, "--bench", help="Also measure backbone forward tokens/s (batch 8 x 128)."),
    as_json: bool = JSON_OPTION,
):
    """Describe the CPLM: its base backbone, fingerprint, key size, and optionally its speed.

    Example: cprag model --bench
    """
    from cprag.benchmark import forward_tokens_per_second
    from cprag.checkpoint import load_model, model_fingerprint

    start = time.perf_counter()
    with err.status("loading the model"):
        model, _ = load_model(checkpoint)
    info = {
        "checkpoint": str(checkpoint) if checkpoint else "default",
        "base_model": model.config.base_model,
        "fingerprint": model_fingerprint(model),
        "key_dim": model.config.key_dim,
        "parameters": sum(p.numel() for p in model.parameters()),
        "cp_head_parameters": sum(p.numel() for p in model.cp_head.parameters()) + model.copy_gate.weight.numel() + 1,
        "load_seconds": round(time.perf_counter() - start, 2),
    }
    if bench:
        with err.status("timing the backbone forward pass"):
            info["forward_tokens_per_second"] = round(forward_tokens_per_second(model), 1)
    if as_json:
        emit_json(info)
        return
    table = Table(show_header=False, box=None)
    for key, value in info.items():
        table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    out.print(table)


@app.command("score")
@reports_errors
def score_command(
    question: str = typer.Argument(..., help="The question."),
    answer: str = typer.Argument(..., help="The answer to score; copied when it occurs in the passage."),
    passage: str = typer.Option(..., "--passage", "-p", help="Passage text, or @FILE to read it from a file."),
    checkpoint: Path = CHECKPOINT_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Score an answer with the passage hidden in the CP memory: per token, the mixture against the base LM.

    Example: cprag score "When was it built?" "1871" -p "The lighthouse was built in 1871."
    """
    from cprag.checkpoint import load_model
    from cprag.scoring import score_answer

    text = read_text_argument(passage)
    with err.status("loading the model"):
        model, tokenizer = load_model(checkpoint)
    result = score_answer(model, tokenizer, text, question, answer)
    if as_json:
        emit_json({
            "question": question, "answer": answer, "log_p": result.log_p, "log_p_base": result.log_p_base,
            "tokens": [vars(t) for t in result.tokens],
        })
        return
    table = Table(title=f"{question!r} → {answer!r}, passage hidden in {len(text)} characters of keys")
    for column in ("token", "log p (CPLM)", "log p (base LM)", "gate g", "most attended passage span"):
        table.add_column(column)
    for t in result.tokens:
        span = text[t.copied_from[0]:t.copied_from[1]] if t.copied_from else ""
        table.add_row(repr(t.token), f"{t.log_p:.3f}", f"{t.log_p_base:.3f}", f"{t.gate:.3f}",
                      f"{span!r} (a={t.copy_attention:.3f})")
    out.print(table)
    out.print(f"total log p: CPLM {result.log_p:.3f} vs base LM {result.log_p_base:.3f}")


def read_text_argument(value: str) -> str:
    from cprag.errors import ConfigError

    if not value.startswith("@"):
        return value
    path = Path(value[1:])
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError("--passage", value, f"cannot read the file: {error}") from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
