"""Progress on a stderr that is not a terminal: plain lines a background job's log can show."""

import io

from rich.console import Console

from cprag.cli import output


def test_plain_progress_writes_lines_with_counts_and_the_end(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(output, "err", Console(file=stream))  # a file, not a terminal
    progress = output.progress_bar(transient=False)
    assert isinstance(progress, output.PlainProgress)
    progress.every_s = 3600.0  # only the finished task is written
    with progress:
        task = progress.add_task("encoding passages", total=4)
        for done in range(1, 4):
            progress.update(task, completed=done)
        assert stream.getvalue() == ""
        progress.advance(task)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("encoding passages: 4/4 (100%)")


def test_plain_progress_writes_an_unfinished_task_on_stop(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(output, "err", Console(file=stream))  # a file, not a terminal
    progress = output.PlainProgress(every_s=0.0)
    task = progress.add_task("reading", total=10)
    progress.update(task, completed=5)
    assert "5/10 (50%)" in stream.getvalue() and "left" in stream.getvalue()
    progress.stop()  # already written at 5: nothing new
    assert len(stream.getvalue().splitlines()) == 1
