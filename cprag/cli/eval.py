"""`cprag eval`: SQuAD and SQuAD 2.0 against the baselines, the needle test, and the scale and speed benchmarks.

Commands that write reports by default write them under eval/runs/ (ignored by git), so a run leaves the tree clean.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from cprag.cli.options import (
    CHECKPOINT_OPTION,
    DEVICE_OPTION,
    DTYPE_OPTION,
    END_BIAS_OPTION,
    JSON_OPTION,
    PASSAGE_PRIOR_OPTION,
    START_BEAM_OPTION,
    VERIFY_OPTION,
)
from cprag.cli.output import emit_json, err, out, print_figures, progress_bar, reports_errors

EVAL_BATCH_OPTION = typer.Option(1, "--batch-size", help="Hidden-mode questions decoded per backbone pass (with "
                                 "--oracle; the same answers, and latency becomes each question's share of its "
                                 "batch).")


def answers_streamed(out_dir: Path, as_json: bool, run):
    """Run `run(on_progress, on_result)` under a progress bar, streaming each answer to OUT/results.jsonl as it
    comes (a long run can be followed and is not lost). Returns what `run` returns."""
    from dataclasses import asdict

    out_dir.mkdir(parents=True, exist_ok=True)
    with progress_bar(as_json) as progress, open(out_dir / "results.jsonl", "w") as stream:
        task = progress.add_task("answering", total=None)

        def streamed(result) -> None:
            stream.write(json.dumps(asdict(result), ensure_ascii=False) + "\n")
            stream.flush()

        return run(lambda done, total: progress.update(task, completed=done, total=total), streamed)


MIN_CONFIDENCE_EVAL = typer.Option(0.0, "--min-confidence", help="Withhold answers below this confidence (default "
                                   "0: always answer, as every SQuAD v1.1 question has an answer).")


def _verifier(checkpoint, model_config, verify: bool | None):
    """The checkpoint's verifier when answers are to be verified (`--verify`; by default when it ships one)."""
    from cprag.api import chosen_verifier, load_verifier

    return None if verify is False else chosen_verifier(load_verifier(checkpoint, model_config), verify)


def _span_reader(reader: Path | None, model_config, dtype: str | None):
    """The span reader at `reader` (default: the shipped one), refused when it was trained on another backbone."""
    from cprag.model.reader_checkpoint import check_reader_base, load_reader
    from cprag.model.runtime import DTYPES

    check_reader_base(reader, model_config.base_model)
    return load_reader(reader, dtype=DTYPES[dtype or "float32"])[0]


@reports_errors
def eval_squad_command(
    data: Path = typer.Argument(..., help="SQuAD-format JSON with questions and reference answers."),
    index: Path = typer.Option(None, "--index", "-i", help="Retrieve passages from this index (recall@k)."),
    oracle: bool = typer.Option(False, "--oracle", help="Gold passage plus 4 distractor passages per question."),
    modes: str = typer.Option("hidden,visible,closed", "--modes",
                              help="Comma-separated: hidden,visible,closed, and reader (the visible span reader, "
                              "with --oracle); 'none' for retrieval recall only."),
    limit: int = typer.Option(None, "--limit", help="A seeded random sample of N questions."),
    seed: int = typer.Option(0, "--seed"),
    k: int = typer.Option(5, "-k", help="Passages retrieved per question (with --index)."),
    held_out: bool = typer.Option(False, "--held-out", help="Only questions of the articles the checkpoint's "
                                  "training held out (named in its train_config.json)."),
    min_confidence: float = MIN_CONFIDENCE_EVAL,
    start_beam: int = START_BEAM_OPTION,
    passage_prior: float = PASSAGE_PRIOR_OPTION,
    end_bias: float = END_BIAS_OPTION,
    batch_size: int = EVAL_BATCH_OPTION,
    keys: str = typer.Option("fp16", "--keys", help="With --oracle: answer from the keys as an index storing them "
                             "this way (fp16, int8 or pq, as cprag index --keys) gives them back."),
    pq_subvectors: int = typer.Option(None, "--pq-subvectors", help="With --keys pq: codes per key, as cprag index "
                                      "--pq-subvectors."),
    dtype: str = typer.Option(None, "--dtype", help="float32 or bfloat16 for the model and the span reader with "
                              "--oracle (default float32, as the figures in docs/results.md; with --index the "
                              "index's default, as cprag ask)."),
    verify: bool = VERIFY_OPTION,
    reader: Path = typer.Option(None, "--reader", help="With --modes reader: the span reader's folder (default: "
                                "the one shipped in cprag/checkpoints/default/reader)."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Where results, summary, report and plots go."),
    checkpoint: Path = CHECKPOINT_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Answer SQuAD questions in every mode with one checkpoint; write results, summary, report and plots.

    Example: cprag eval squad squad-v1.1-dev-public.json --oracle --limit 1000 --out eval/runs/sq
    Example: cprag eval squad DATA --index indexes/squad --limit 300 --out eval/runs/squad-retrieved
    Example: cprag eval squad DATA --oracle --modes hidden,reader --reader runs/reader/reader --out eval/runs/rd
    """
    from cprag.errors import ConfigError
    from cprag.evaluation.squad_eval import SquadEvalConfig, evaluate_squad, write_squad_report
    from cprag.model.checkpoint import held_out_articles

    if dtype is not None and dtype not in ("float32", "bfloat16"):
        raise ConfigError("--dtype", dtype, "expected float32 or bfloat16")
    if (index is None) == (not oracle):
        raise ConfigError("--index/--oracle", index or oracle, "give exactly one of --index DIR or --oracle")
    from cprag.api import load_passage_prior

    config = SquadEvalConfig(modes=tuple(m.strip() for m in modes.split(",") if m.strip() not in {"", "none"}),
                             limit=limit, seed=seed, k=k, min_confidence=min_confidence,
                             start_beam=start_beam, batch_size=batch_size,
                             articles=tuple(held_out_articles(checkpoint)) if held_out else None, key_codec=keys,
                             pq_subvectors=pq_subvectors, end_bias=end_bias,
                             passage_prior=load_passage_prior(checkpoint) if passage_prior is None else passage_prior)
    with err.status("loading the model"):
        if index is not None:
            from cprag.api import Index

            opened = Index(index, checkpoint=checkpoint, dtype=dtype)
            model, tokenizer = opened.model, opened.tokenizer
        else:
            from cprag.api import load_reranker
            from cprag.model.checkpoint import load_model
            from cprag.model.runtime import DTYPES, place

            opened = None
            model, tokenizer = load_model(checkpoint)
            if dtype not in (None, "float32"):
                model = place(model, "cpu", DTYPES[dtype])
        verifier = _verifier(checkpoint, model.config, verify)
        span_reader = _span_reader(reader, model.config, dtype) if "reader" in config.modes and index is None else None
    reranker = opened.reranker if opened is not None else load_reranker(checkpoint, model.config)
    summary, results = answers_streamed(out_dir, as_json, lambda progress, result: evaluate_squad(
        data, config, model, tokenizer, opened, progress, result, reranker, span_reader, verifier))
    split = ", held-out articles" if held_out else ""
    write_squad_report(out_dir, summary, results,
                       f"SQuAD ({summary['eval/source']}{split}, {summary['eval/questions']} q)")
    _show_report(out_dir, summary, as_json,
                 "results.jsonl, summary.json, report.md, f1_by_mode.png, latency_by_mode.png")


@reports_errors
def eval_squad2_command(
    data: Path = typer.Argument(..., help="SQuAD 2.0 JSON (questions marked is_impossible have no answer)."),
    oracle: bool = typer.Option(True, "--oracle", help="Each question's own paragraph plus 4 distractors "
                                "(the memory squad2 uses; kept for the same flags as eval squad)."),
    modes: str = typer.Option("hidden", "--modes", help="Comma-separated: hidden,visible,closed, and reader (the "
                              "span reader, withholding by its null entry)."),
    limit: int = typer.Option(None, "--limit", help="A seeded random sample of N questions."),
    seed: int = typer.Option(0, "--seed"),
    min_confidence: float = typer.Option(None, "--min-confidence", help="Withhold answers below this confidence "
                                         "(default: the checkpoint's)."),
    dtype: str = typer.Option(None, "--dtype", help="float32 or bfloat16 for the model and the span reader "
                              "(default float32)."),
    reader: Path = typer.Option(None, "--reader", help="With --modes reader: the span reader's folder (default: "
                                "the one shipped in cprag/checkpoints/default/reader)."),
    start_beam: int = START_BEAM_OPTION,
    passage_prior: float = PASSAGE_PRIOR_OPTION,
    end_bias: float = END_BIAS_OPTION,
    batch_size: int = EVAL_BATCH_OPTION,
    verify: bool = VERIFY_OPTION,
    out_dir: Path = typer.Option(..., "--out", "-o", help="Where results, summary, report and plot go."),
    checkpoint: Path = CHECKPOINT_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Abstention on SQuAD 2.0: HasAns EM/F1, NoAns accuracy, overall EM/F1 (official rules) and the best
    threshold, with answers below the confidence threshold withheld.

    Example: cprag eval squad2 squad-v2.0-dev-public.json --limit 1000 --out eval/runs/squad2
    Example: cprag eval squad2 DATA --limit 1000 --modes hidden,reader --dtype bfloat16 --out eval/runs/sq2-reader
    """
    from cprag.api import load_passage_prior, load_reranker
    from cprag.errors import ConfigError
    from cprag.evaluation.squad2 import evaluate_squad2, write_squad2_report
    from cprag.evaluation.squad_eval import SquadEvalConfig
    from cprag.model.checkpoint import load_model
    from cprag.model.runtime import DTYPES, place

    if not oracle:
        raise ConfigError("--oracle", oracle, "squad2 answers from each question's own paragraph and distractors")
    if dtype is not None and dtype not in ("float32", "bfloat16"):
        raise ConfigError("--dtype", dtype, "expected float32 or bfloat16")
    config = SquadEvalConfig(modes=tuple(m.strip() for m in modes.split(",") if m.strip()), limit=limit, seed=seed,
                             batch_size=batch_size, end_bias=end_bias, start_beam=start_beam,
                             passage_prior=load_passage_prior(checkpoint) if passage_prior is None else passage_prior)
    with err.status("loading the model"):
        model, tokenizer = load_model(checkpoint)
        if dtype not in (None, "float32"):
            model = place(model, "cpu", DTYPES[dtype])
        reranker = load_reranker(checkpoint, model.config)
        verifier = _verifier(checkpoint, model.config, verify)
        span_reader = _span_reader(reader, model.config, dtype) if "reader" in config.modes else None
    threshold = model.config.min_confidence if min_confidence is None else min_confidence
    if not 0.0 <= threshold <= 1.0:
        raise ConfigError("--min-confidence", threshold, "must be a probability in [0, 1]")
    summary, results = answers_streamed(out_dir, as_json, lambda progress, result: evaluate_squad2(
        data, config, model, tokenizer, threshold, progress, result, reranker, verifier, span_reader))
    write_squad2_report(out_dir, summary, results, f"SQuAD 2.0 (oracle, {summary['eval/questions']} q)")
    _show_report(out_dir, summary, as_json, "results.jsonl, summary.json, report.md, abstention.png")


@reports_errors
def eval_scale_command(
    passages: int = typer.Option(1_000_000, "--passages", help="Synthetic passages to write."),
    tokens: int = typer.Option(128, "--tokens", help="Tokens per synthetic passage."),
    keys: str = typer.Option("fp16", "--keys", help="Key codec: fp16, int8 or pq (as cprag index --keys; pq "
                             "codes with a random codebook)."),
    queries: int = typer.Option(500, "--queries", help="Questions timed (fetch and recall on up to 200 of them)."),
    index: Path = typer.Option(None, "--index", help="Where to write the synthetic index (default: a temporary "
                               "folder, removed after; about 160 bytes per token on disk)."),
    compressed_above: int = typer.Option(None, "--compressed-above", help="Passages above which the IVF keeps "
                                         "8-bit vectors, as cprag index --compressed-above (default 2,000,000)."),
    seed: int = typer.Option(0, "--seed"),
    out_dir: Path = typer.Option(Path("eval/runs/scale"), "--out", "-o", help="Where summary.json and report.md go."),
    as_json: bool = JSON_OPTION,
):
    """Write N synthetic passages (random keys and clustered embeddings, the real schema) straight into an index,
    then time FAISS search and k=5 key-shard fetches, recall@5 against exact search, disk bytes per token, memory.

    Example: cprag eval scale --passages 1000000 --json
    """
    import shutil
    import tempfile

    from cprag.errors import ConfigError
    from cprag.evaluation.scale import measure_scale, write_scale_report, write_synthetic_index
    from cprag.index.key_codec import codec_name
    from cprag.index.retrieve import COMPRESSED_ABOVE

    if passages < 100:
        raise ConfigError("--passages", passages, "must be at least 100")
    if tokens < 1:
        raise ConfigError("--tokens", tokens, "must be at least 1")
    codec = codec_name(keys)
    target = Path(tempfile.mkdtemp(prefix="cprag-scale-")) if index is None else index
    if index is not None and any(index.iterdir() if index.is_dir() else []):
        raise ConfigError("--index", str(index), "must be a new or empty folder (the bench writes its own rows)")
    try:
        with progress_bar(as_json) as progress:
            task = progress.add_task("writing synthetic passages", total=passages)
            build, vectors = write_synthetic_index(
                target, passages, tokens, key_codec=codec, seed=seed,
                compressed_above=COMPRESSED_ABOVE if compressed_above is None else compressed_above,
                on_progress=lambda stage, done, total: progress.update(task, completed=done))
        with err.status("timing search and fetches"):
            figures = measure_scale(target, vectors, queries=queries, seed=seed)
    finally:
        if index is None:
            shutil.rmtree(target, ignore_errors=True)
    write_scale_report(out_dir, figures, build)
    if as_json:
        emit_json(figures)
        return
    for key, value in figures.items():
        out.print(f"{key}: {value}", highlight=False)
    err.print(f"wrote {out_dir}/summary.json and report.md")


@reports_errors
def eval_bench_command(
    corpus: Path = typer.Option(Path("examples/long-corpus.jsonl"), "--corpus", help="Corpus to index and query."),
    index: Path = typer.Option(None, "--index", "-i", help="Use this index instead of building one."),
    questions: int = typer.Option(5, "--questions", help="Questions per latency figure."),
    documents: int = typer.Option(0, "--documents", help="Index a seeded sample of this many documents (0: all)."),
    seed: int = typer.Option(0, "--seed"),
    out_dir: Path = typer.Option(None, "--out", help="Also write summary.json, report.md and latency_by_k.png here."),
    checkpoint: Path = CHECKPOINT_OPTION,
    device: str = DEVICE_OPTION,
    dtype: str = DTYPE_OPTION,
    batch_questions: int = typer.Option(64, "--batch-questions", help="Questions for the batch throughput figures "
                                        "(batch/qps@B for B = 1, 4, 16, 64; 0 skips them)."),
    as_json: bool = JSON_OPTION,
):
    """Measure in one run: keys vs KV-cache bytes per token, hidden vs visible latency at k = 1, 5, 10, key
    encoding vs bare forward throughput, warm vs cold key-shard cache throughput, and questions per second with
    1, 4, 16 and 64 questions decoded per backbone pass.

    The hidden/visible ratio depends on how long the passages are (visible mode reads them all), so the figures
    include the mean passage length. The default corpus (examples/long-corpus.jsonl) has ~300-token passages, a
    common RAG chunk size; SQuAD paragraphs are ~170 tokens and the demo corpus (examples/corpus.jsonl) ~70.

    Example: cprag eval bench --out eval/runs/bench --json
    Example: cprag eval bench --corpus examples/corpus.jsonl --json
    Example: cprag eval bench --corpus squad-v1.1-dev.json --documents 40 --json
    Example: cprag eval bench --device cuda --json   (pipelines/gpu_check.sh runs this on a GPU)
    """
    from cprag.evaluation.bench import write_bench_report
    from cprag.evaluation.bench_run import BenchSettings, run_bench

    settings = BenchSettings(corpus=corpus, index=index, questions=questions, documents=documents, seed=seed,
                             checkpoint=checkpoint, device=device, dtype=dtype, batch_questions=batch_questions)
    with err.status("loading the model") as status:
        figures = run_bench(settings, on_stage=status.update)
    if out_dir is not None:
        write_bench_report(out_dir, figures)
        err.print(f"wrote {out_dir}/summary.json, report.md, latency_by_k.png")
    if as_json:
        emit_json(figures)
        return
    print_figures("cprag bench (one run)", figures)


@reports_errors
def eval_needle_command(
    lengths: str = typer.Option("1000,4000,16000,100000", "--lengths", help="Total haystack tokens."),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", "--depths", help="Needle positions as fractions."),
    trials: int = typer.Option(2, "--trials", help="Numbers tried per (length, depth)."),
    visible_trials: int = typer.Option(1, "--visible-trials", help="Trials for the (slow) visible baseline."),
    modes: str = typer.Option("hidden,visible", "--modes"),
    seed: int = typer.Option(0, "--seed"),
    passage_prior: float = PASSAGE_PRIOR_OPTION,
    start_beam: int = START_BEAM_OPTION,
    out_dir: Path = typer.Option(..., "--out", "-o"),
    checkpoint: Path = CHECKPOINT_OPTION,
    as_json: bool = JSON_OPTION,
):
    """The magic-number test: hidden keys over haystacks far beyond the window, against a truncated prompt.

    Example: cprag eval needle --lengths 1000,100000 --depths 0,0.5,1 --out eval/runs/needle
    """
    from cprag.api import load_passage_prior, load_reranker
    from cprag.decoding.passage_prior import check_weight
    from cprag.decoding.rerank import check_start_beam, default_start_beam
    from cprag.errors import ConfigError
    from cprag.evaluation.needle import run_needle, write_needle_report
    from cprag.model.checkpoint import load_model

    try:
        length_list = [int(v) for v in lengths.split(",")]
        depth_list = [float(v) for v in depths.split(",")]
    except ValueError:
        raise ConfigError("--lengths/--depths", f"{lengths} / {depths}", "expected comma-separated numbers") from None
    if any(d < 0 or d > 1 for d in depth_list) or any(n < 64 for n in length_list):
        raise ConfigError("--lengths/--depths", f"{lengths} / {depths}", "depths in [0, 1], lengths >= 64")
    weight = load_passage_prior(checkpoint) if passage_prior is None else check_weight(passage_prior)
    check_start_beam(start_beam)
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    embedder = None
    with err.status("loading the model"):
        model, tokenizer = load_model(checkpoint)
        reranker = load_reranker(checkpoint, model.config)
        if weight > 0 and "hidden" in mode_list:
            from cprag.index.retrieve import MiniLMEmbedder

            embedder = MiniLMEmbedder()
    with progress_bar(as_json) as progress:
        total = len(length_list) * len(depth_list) * (trials * ("hidden" in mode_list)
                                                      + min(trials, visible_trials) * ("visible" in mode_list))
        task = progress.add_task("needles", total=total)
        summary, results = run_needle(model, tokenizer, length_list, depth_list, trials, mode_list, seed,
                                      visible_trials, passage_prior=weight, embedder=embedder, reranker=reranker,
                                      start_beam=default_start_beam(reranker) if start_beam is None else start_beam,
                                      on_result=lambda r: progress.advance(task))
    write_needle_report(out_dir, summary, results, model.config.max_position_embeddings)
    _show_report(out_dir, summary, as_json)


def _show_report(out_dir: Path, summary: dict, as_json: bool, wrote: str | None = None) -> None:
    """The summary as JSON on stdout, or the report's text (its plots left out) and what was written."""
    if as_json:
        emit_json(summary)
        return
    out.print((out_dir / "report.md").read_text().split("![")[0], highlight=False)
    if wrote:
        err.print(f"wrote {out_dir}/{wrote}")
