"""`cprag ask`: answer questions from an index's hidden passages, and show the spans each answer copied."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from cprag.cli.options import (
    CHECKPOINT_OPTION,
    DEVICE_OPTION,
    DTYPE_OPTION,
    END_BIAS_OPTION,
    INDEX_OPTION,
    JSON_OPTION,
    PASSAGE_PRIOR_OPTION,
    START_BEAM_OPTION,
    VERIFY_OPTION,
)
from cprag.cli.output import emit_json, err, out, reports_errors


@reports_errors
def ask_command(
    question: str = typer.Argument(None, help="The question (or use --questions)."),
    index: Path = INDEX_OPTION,
    k: int = typer.Option(5, "-k", help="Passages to retrieve."),
    visible: bool = typer.Option(False, "--visible", help="Baseline: put the passages in the prompt instead."),
    closed: bool = typer.Option(False, "--closed", help="Baseline: no passages at all."),
    reader: bool = typer.Option(False, "--reader", help="Read the retrieved passages' text with the span reader "
                                "shipped beside the checkpoint (or --reader-path) instead of copying from keys."),
    reader_path: Path = typer.Option(None, "--reader-path", help="With --reader: a span reader's folder "
                                     "(pipelines/train_reader.py)."),
    questions: Path = typer.Option(None, "--questions", help="File of questions: one per line, or JSONL."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens"),
    min_confidence: float = typer.Option(None, "--min-confidence", help="Withhold answers whose confidence (the "
                                         "copy path's probability of the first answer token) is below this "
                                         "(default: 0 when answers are verified, else the checkpoint's, tuned on "
                                         "SQuAD 2.0; 0 always answers)."),
    min_retrieval_score: float = typer.Option(None, "--min-retrieval-score", help="Say the passages hold no "
                                              "answer, without decoding, when the best passage's retrieval score "
                                              "is below this (default 0.25, measured on SQuAD; -1 never)."),
    start_beam: int = START_BEAM_OPTION,
    passage_prior: float = PASSAGE_PRIOR_OPTION,
    end_bias: float = END_BIAS_OPTION,
    verify: bool = VERIFY_OPTION,
    batch_size: int = typer.Option(None, "--batch-size", help="With --questions: questions decoded per backbone "
                                   "pass (default: cprag.api.BATCH_SIZE; same answers as one at a time)."),
    checkpoint: Path = CHECKPOINT_OPTION,
    device: str = DEVICE_OPTION,
    dtype: str = DTYPE_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Answer from hidden documents: retrieve k passages, load their keys, and let the CP head copy the answer.
    When the passages hold no answer it says so, and still lists the passages it read.

    Example: cprag ask "When was the lighthouse at Varna Point built?" --index indexes/demo
    Example: cprag ask --questions questions.txt --index indexes/demo --batch-size 16 --json
    Example: cprag ask "Who designed the glass bridge of Tellin?" --index indexes/demo --reader
    """
    from cprag.api import BATCH_SIZE, MIN_RETRIEVAL_SCORE, Index
    from cprag.decoding.rerank import check_start_beam
    from cprag.errors import ConfigError

    batch_size = BATCH_SIZE if batch_size is None else batch_size
    check_start_beam(start_beam)  # before seconds of loading
    if batch_size < 1:
        raise ConfigError("--batch-size", batch_size, "must be at least 1")
    if passage_prior is not None:
        from cprag.decoding.passage_prior import check_weight

        check_weight(passage_prior)
    if end_bias is not None:
        from cprag.model.config import check_end_bias

        check_end_bias(end_bias)
    if dtype is not None:
        from cprag.model.runtime import resolve_dtype

        resolve_dtype("cpu", dtype)  # a wrong name fails before seconds of loading
    floor = MIN_RETRIEVAL_SCORE if min_retrieval_score is None else min_retrieval_score
    if (question is None) == (questions is None):
        raise ConfigError("QUESTION/--questions", question or questions, "give a question or --questions, not both")
    if visible + closed + reader > 1:
        raise ConfigError("--visible/--closed/--reader", True, "choose one of them")
    if reader_path is not None and not reader:
        raise ConfigError("--reader-path", str(reader_path), "goes with --reader")
    mode = "visible" if visible else "closed" if closed else "reader" if reader else "hidden"
    batch = [question] if questions is None else read_questions(questions)
    with err.status("loading the model and the index"):
        opened = Index(index, checkpoint=checkpoint, device=device, dtype=dtype, reader=reader_path)
        if reader:
            opened.reader  # noqa: B018 - a missing reader, or one on another base, fails before any answer
    # every question checked before the first is answered; then answers appear batch by batch
    opened.verifying(verify)  # --verify with a checkpoint that ships no verifier fails before any answer
    opened.check_questions(batch, mode, min_confidence, floor, start_beam, batch_size, max_new_tokens)
    for first in range(0, len(batch), batch_size):
        for answer in opened.ask_many(batch[first : first + batch_size], k=k, mode=mode,
                                      max_new_tokens=max_new_tokens, min_confidence=min_confidence,
                                      min_retrieval_score=floor, start_beam=start_beam, batch_size=batch_size,
                                      passage_prior=passage_prior, end_bias=end_bias, verify=verify):
            if as_json:
                emit_json(answer.to_json())
            else:
                render_answer(answer, opened)
    if not as_json and len(batch) > 1:
        err.print(f"key cache: {opened.cache.stats()}")


def render_answer(answer, opened) -> None:
    """The answer, then each cited passage once with every span copied from it highlighted."""
    from rich.panel import Panel
    from rich.text import Text

    if answer.no_answer_reason == "retrieval":
        text = Text("The passages hold no answer to this question: none of them is about it.", style="bold yellow")
    elif answer.no_answer_reason == "reader":
        text = Text("The passages hold no answer to this question.", style="bold yellow")
        text.append(f'\n(the reader prefers no answer to the span "{answer.withheld_answer}")', style="dim")
    elif answer.no_answer_reason == "verifier":
        text = Text("The passages hold no answer to this question.", style="bold yellow")
        text.append(f'\n(the verifier doubts the span "{answer.withheld_answer}")', style="dim")
    elif answer.no_answer:
        text = Text("The passages hold no answer to this question.", style="bold yellow")
    else:
        text = Text(answer.answer or "(empty answer)", style="bold")
    confidence = "" if answer.confidence is None else f" · confidence {answer.confidence:.2f}"
    if answer.answerable is not None:
        confidence += f" · answerable {answer.answerable:.2f}"
    out.print(Panel(text, title=answer.question, subtitle=f"{answer.mode}{confidence}"))
    passages = {entry.passage.passage_id: entry.passage for entry in opened.cache.entries.values()}
    cited: dict[str, list] = {}
    for citation in answer.citations or answer.withheld_citations:
        for stored in passages.values():
            if stored.doc_id == citation.doc_id and stored.char_start <= citation.start < stored.char_start + len(
                    stored.text):
                cited.setdefault(stored.passage_id, []).append(citation)
                break
    for number, (passage_id, citations) in enumerate(cited.items(), start=1):
        stored = passages[passage_id]
        text = Text(stored.text)
        for citation in citations:
            text.stylize("bold black on yellow", citation.start - stored.char_start, citation.end - stored.char_start)
        spans = ", ".join(f"{c.start}-{c.end}{citation_place(c)}" for c in citations)
        out.print(Panel(text, title=f"[{number}] {stored.doc_id}: {stored.title}", subtitle=f"copied chars {spans}",
                        title_align="left"))
    retrieved = ", ".join(f"{p['doc_id']} ({p['score']:.2f})" for p in answer.passages)
    if answer.no_answer:
        retrieved = "read " + retrieved
    timings = ", ".join(f"{name} {ms:.0f} ms" for name, ms in answer.timings_ms.items())
    out.print(f"copy rate {answer.copy_rate:.0%} · passages: {retrieved or 'none'}\n{timings}", highlight=False)


def citation_place(citation) -> str:
    """Where a citation sits in its source document beyond the character span: ' p. 12', ' #install', or ''."""
    page = getattr(citation, "page", None)
    anchor = getattr(citation, "anchor", None)
    place = "" if page is None else f" p. {page}"
    return place if anchor is None else f"{place} #{str(anchor).lstrip('#')}"


def read_questions(path: Path) -> list[str]:
    """The questions of a file: one per line, or JSONL lines with a "question" field."""
    from cprag.errors import ConfigError

    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError("--questions", str(path), f"cannot read the file: {error}") from None
    result = []
    for number, line in enumerate(lines, start=1):
        if line.lstrip().startswith("{"):
            try:
                result.append(str(json.loads(line)["question"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError("--questions", f"{path}:{number}", 'expected JSON with a "question" field') from None
        else:
            result.append(line.strip())
    if not result:
        raise ConfigError("--questions", str(path), "no questions in the file")
    return result
