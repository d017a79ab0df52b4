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
from rich.markup import escape
from rich.table import Table

from cprag.errors import CpragError
from cprag.training.config import TrainConfig

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Question answering from documents the language model never reads (Copy-Paste LM keys).",
)
err = Console(stderr=True)
out = Console()

CHECKPOINT_OPTION = typer.Option(None, "--checkpoint", help="CPLM checkpoint directory (default: the shipped one).")
JSON_OPTION = typer.Option(False, "--json", help="Write one JSON object to stdout instead of tables.")


TRAIN_DEFAULTS = TrainConfig()


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
    from cprag.evaluation.bench import forward_tokens_per_second
    from cprag.model.checkpoint import load_model, model_fingerprint

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
        "adapters": None if model.adapters is None else {
            "layers": model.config.adapter_layers, "rank": model.config.adapter_rank,
            "parameters": sum(p.numel() for p in model.adapters.parameters())},
        "min_confidence": model.config.min_confidence,
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
    from cprag.evaluation.answer_score import score_answer
    from cprag.model.checkpoint import load_model

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


INDEX_OPTION = typer.Option(Path("indexes/default"), "--index", "-i", help="Index directory.")


DTYPE_OPTION = typer.Option(None, "--dtype", help="float32 or bfloat16 (default: CPRAG_DTYPE, else bfloat16 on "
                            "CUDA and on CPUs with bf16 units, float32 on others; see cprag.model.runtime).")


@app.command("index")
@reports_errors
def index_command(
    corpus: Path = typer.Argument(..., help="JSONL ({id, text, title?}), SQuAD .json, or a folder of .txt/.md."),
    index: Path = INDEX_OPTION,
    rebuild: bool = typer.Option(False, "--rebuild", help="Discard the existing index and start over."),
    max_passage_tokens: int = typer.Option(384, "--max-passage-tokens", help="Split longer documents."),
    chunk: int = typer.Option(64, "--chunk", help="Passages per committed chunk (the resume granularity)."),
    keys: str = typer.Option("fp16", "--keys", help="How keys are stored: fp16 (132 B per token with its id), "
                             "int8 with a scale per key (70 B), or pq: 16 one-byte codes of a codebook learned from "
                             "the corpus (20 B); changing it needs --rebuild."),
    pq_subvectors: int = typer.Option(None, "--pq-subvectors", help="With --keys pq: codes (bytes) per key; each "
                                      "codes key_dim / N dimensions (default: cprag.index.key_codec.PQ_SUBVECTORS)."),
    approximate_above: int = typer.Option(None, "--approximate-above", help="Passages above which the FAISS "
                                          "index is an IVF (trained on the stored embeddings) instead of exact "
                                          "(default: cprag.index.retrieve.APPROXIMATE_ABOVE, 100,000); "
                                          "cprag info shows which."),
    ray: str = typer.Option(None, "--ray", help="Encode on a Ray cluster: "
                            "--ray ADDRESS joins one (HOST:PORT, ray://..., or auto for the one `ray start` runs "
                            "here); a bare --ray (or --ray local) starts a local cluster. Needs the cluster "
                            "extra (ray, lance-ray)."),
    ray_workers: int = typer.Option(None, "--ray-workers", help="Encoding actors on the cluster (default: one per "
                                    "GPU, else one per --ray-cpus-per-worker CPUs)."),
    ray_cpus_per_worker: int = typer.Option(1, "--ray-cpus-per-worker", help="CPUs (torch threads) per actor."),
    ray_commit: int = typer.Option(1024, "--ray-commit", help="Passages per Lance commit with --ray (what a killed "
                                   "run keeps)."),
    compressed_above: int = typer.Option(None, "--compressed-above", help="Passages above which the IVF keeps its "
                                         "vectors as 8-bit scalars, a quarter of the memory (default: "
                                         "cprag.index.retrieve.COMPRESSED_ABOVE, 2,000,000)."),
    checkpoint: Path = CHECKPOINT_OPTION,
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    dtype: str = DTYPE_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Encode a corpus into CP keys (LanceDB) and a FAISS index; reruns add only new or changed documents.

    Example: cprag index examples/corpus.jsonl --index indexes/demo
    Example: cprag index corpus.jsonl --index indexes/small --keys int8   # 70 B per stored token
    Example: cprag index corpus.jsonl --index indexes/big --ray 10.0.0.5:6379   # encode on a Ray cluster
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from cprag.index.build import IndexConfig, build_index
    from cprag.index.retrieve import APPROXIMATE_ABOVE, COMPRESSED_ABOVE, MiniLMEmbedder
    from cprag.model.checkpoint import load_model, model_fingerprint
    from cprag.model.runtime import default_device, place, resolve_dtype

    above = APPROXIMATE_ABOVE if approximate_above is None else approximate_above
    config = IndexConfig(max_passage_tokens=max_passage_tokens, chunk_passages=chunk, rebuild=rebuild,
                         key_codec=keys, approximate_above=above, pq_subvectors=pq_subvectors,
                         compressed_above=COMPRESSED_ABOVE if compressed_above is None else compressed_above)
    cluster = None
    if ray is not None:
        from cprag.index.ray_runner import RayIndexSettings

        cluster = RayIndexSettings(address=None if ray == "local" else ray, workers=ray_workers,
                                   cpus_per_worker=ray_cpus_per_worker, commit_passages=ray_commit,
                                   checkpoint=str(checkpoint) if checkpoint else None, device=device, dtype=dtype)
    device = device or default_device()
    cast = resolve_dtype(device, dtype)  # a wrong name fails before seconds of loading
    with err.status("loading the model and the retriever"):
        model, tokenizer = load_model(checkpoint)
        fingerprint = model_fingerprint(model)  # of the stored weights, so any dtype's index opens in any other
        model = place(model, device, cast)
        embedder = MiniLMEmbedder()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    progress = Progress(*columns, console=err, transient=as_json)
    task = None

    def on_progress(stage: str, done: int, total: int) -> None:
        nonlocal task
        if task is None:  # shown once encoding starts, so early errors stay one clean line
            progress.start()
            task = progress.add_task("encoding passages", total=total)
        progress.update(task, completed=done, total=total)

    try:
        report = build_index(corpus, index, model, tokenizer, embedder, config, on_progress, fingerprint, cluster)
    finally:
        progress.stop()
    for skipped in report.skipped:
        err.print(f"[yellow]skipped[/] {skipped.source}: {skipped.reason}", highlight=False)
    summary = {
        "index": report.index, "documents": report.documents, "passages": report.passages,
        "encoded": report.encoded, "unchanged": report.unchanged, "removed": report.removed,
        "skipped": [vars(s) for s in report.skipped], "tokens_encoded": report.tokens_encoded,
        "encode_tokens_per_second": round(report.encode_tokens_per_second, 1), "seconds": round(report.seconds, 2),
        "bytes_per_token": report.manifest["bytes_per_token"], "dtype": report.manifest["encode_dtype"],
        "keys": report.manifest["key_dtype"], "ray": None if cluster is None else (cluster.address or "local"),
    }
    if as_json:
        emit_json(summary)
    else:
        out.print(f"indexed {report.documents} documents into {report.index}: {report.encoded} passages encoded, "
                  f"{report.unchanged} unchanged, {len(report.skipped)} skipped, "
                  f"{report.manifest['bytes_per_token']} bytes/token in {report.seconds:.1f}s")


EVAL_BATCH_OPTION = typer.Option(1, "--batch-size", help="Hidden-mode questions decoded per backbone pass (with "
                                 "--oracle; the same answers, and latency becomes each question's share of its "
                                 "batch).")
START_BEAM_OPTION = typer.Option(None, "--start-beam", help="Decode from this many most probable first tokens and "
                                  "answer with the one the checkpoint's start reranker picks (the likeliest without "
                                  "one). Default: the beam the reranker was fitted for (4 for the shipped checkpoint: "
                                  "+4.5 F1 on SQuAD dev over greedy); 1 is greedy, the fastest.")

PASSAGE_PRIOR_OPTION = typer.Option(None, "--passage-prior", help="Weight of each passage's retrieval score in the "
                                    "copy scores (hidden mode): passages less similar to the question are pushed "
                                    "down by this many nats per unit of cosine (default: the checkpoint's; 0: off).")
END_BIAS_OPTION = typer.Option(None, "--end-bias", help="Nats added to the log-probability of ending an answer at "
                               "every choice after the first; below 0 answers run on where the model is unsure they "
                               "are over (default: the checkpoint's end_bias; 0: off).")


@app.command("ask")
@reports_errors
def ask_command(
    question: str = typer.Argument(None, help="The question (or use --questions)."),
    index: Path = INDEX_OPTION,
    k: int = typer.Option(5, "-k", help="Passages to retrieve."),
    visible: bool = typer.Option(False, "--visible", help="Baseline: put the passages in the prompt instead."),
    closed: bool = typer.Option(False, "--closed", help="Baseline: no passages at all."),
    questions: Path = typer.Option(None, "--questions", help="File of questions: one per line, or JSONL."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens"),
    min_confidence: float = typer.Option(None, "--min-confidence", help="Withhold answers whose confidence (the "
                                         "copy path's probability of the first answer token) is below this "
                                         "(default: the checkpoint's, tuned on SQuAD 2.0; 0 always answers)."),
    min_retrieval_score: float = typer.Option(None, "--min-retrieval-score", help="Say the passages hold no "
                                              "answer, without decoding, when the best passage's retrieval score "
                                              "is below this (default 0.25, measured on SQuAD; -1 never)."),
    start_beam: int = START_BEAM_OPTION,
    passage_prior: float = PASSAGE_PRIOR_OPTION,
    end_bias: float = END_BIAS_OPTION,
    batch_size: int = typer.Option(None, "--batch-size", help="With --questions: questions decoded per backbone "
                                   "pass (default: cprag.api.BATCH_SIZE; same answers as one at a time)."),
    checkpoint: Path = CHECKPOINT_OPTION,
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    dtype: str = DTYPE_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Answer from hidden documents: retrieve k passages, load their keys, and let the CP head copy the answer.
    When the passages hold no answer it says so, and still lists the passages it read.

    Example: cprag ask "When was the lighthouse at Varna Point built?" --index indexes/demo
    Example: cprag ask --questions questions.txt --index indexes/demo --batch-size 16 --json
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
    if visible and closed:
        raise ConfigError("--visible/--closed", True, "choose one baseline")
    mode = "visible" if visible else "closed" if closed else "hidden"
    batch = [question] if questions is None else read_questions(questions)
    with err.status("loading the model and the index"):
        opened = Index(index, checkpoint=checkpoint, device=device, dtype=dtype)
    # every question checked before the first is answered; then answers appear batch by batch
    opened.check_questions(batch, mode, min_confidence, floor, start_beam, batch_size, max_new_tokens)
    for first in range(0, len(batch), batch_size):
        for answer in opened.ask_many(batch[first : first + batch_size], k=k, mode=mode,
                                      max_new_tokens=max_new_tokens, min_confidence=min_confidence,
                                      min_retrieval_score=floor, start_beam=start_beam, batch_size=batch_size,
                                      passage_prior=passage_prior, end_bias=end_bias):
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
    elif answer.no_answer:
        text = Text("The passages hold no answer to this question.", style="bold yellow")
    else:
        text = Text(answer.answer or "(empty answer)", style="bold")
    confidence = "" if answer.confidence is None else f" · confidence {answer.confidence:.2f}"
    out.print(Panel(text, title=answer.question, subtitle=f"{answer.mode}{confidence}"))
    passages = {entry.passage.passage_id: entry.passage for entry in opened.cache.entries.values()}
    cited: dict[str, list] = {}
    for citation in answer.citations:
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
        spans = ", ".join(f"{c.start}-{c.end}" for c in citations)
        out.print(Panel(text, title=f"[{number}] {stored.doc_id}: {stored.title}", subtitle=f"copied chars {spans}",
                        title_align="left"))
    retrieved = ", ".join(f"{p['doc_id']} ({p['score']:.2f})" for p in answer.passages)
    if answer.no_answer:
        retrieved = "read " + retrieved
    timings = ", ".join(f"{name} {ms:.0f} ms" for name, ms in answer.timings_ms.items())
    out.print(f"copy rate {answer.copy_rate:.0%} · passages: {retrieved or 'none'}\n{timings}", highlight=False)


def read_questions(path: Path) -> list[str]:
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


@app.command("info")
@reports_errors
def info_command(index: Path = INDEX_OPTION, as_json: bool = JSON_OPTION):
    """Print an index's manifest and sizes, including bytes_per_token (keys + token ids per stored token).

    Example: cprag info --index indexes/demo --json
    """
    from cprag.api import index_info

    info = index_info(index)
    if as_json:
        emit_json(info)
        return
    table = Table(show_header=False, box=None)
    for key, value in sorted(info.items()):
        table.add_row(key, json.dumps(value) if isinstance(value, dict | list) else str(value))
    out.print(table)


@app.command("serve")
@reports_errors
def serve_command(
    index: Path = INDEX_OPTION,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; any but loopback needs --api-key."),
    port: int = typer.Option(8000, "--port"),
    api_key: str = typer.Option(None, "--api-key", envvar="CPRAG_API_KEY", show_envvar=True,
                                help="Key every route but /healthz asks for (Authorization: Bearer KEY)."),
    max_batch: int = typer.Option(16, "--max-batch", help="Questions decoded per backbone pass."),
    max_wait_ms: float = typer.Option(10.0, "--max-wait-ms", help="How long a request waits to batch with others."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds before a request gets 504."),
    checkpoint: Path = CHECKPOINT_OPTION,
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    dtype: str = DTYPE_OPTION,
):
    """Serve the index over HTTP: POST /v1/ask (?stream=true for server-sent events), POST /v1/ask_batch,
    GET /v1/info, GET /healthz, the web page at /, and OpenAPI docs at /docs. One model and key-shard cache serve
    every request, and concurrent questions are decoded together.

    Example: cprag serve --index indexes/demo --port 8000   (then open http://127.0.0.1:8000/)
    Example: CPRAG_API_KEY=... cprag serve --index indexes/demo --host 0.0.0.0
    """
    import ipaddress

    import uvicorn

    from cprag.api import Index
    from cprag.errors import ConfigError, IndexBusy, IndexUnfinished
    from cprag.serve import ServeConfig, create_app

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ConfigError("--host", host, "expected an IP address or localhost") from None
    if not loopback and not api_key:
        raise ConfigError("--host", host, "binding beyond this machine needs --api-key (or CPRAG_API_KEY)")
    if not 0 < port < 65536:
        raise ConfigError("--port", port, "must be between 1 and 65535")
    config = ServeConfig(max_batch=max_batch, max_wait_ms=max_wait_ms, timeout_s=timeout, api_key=api_key)
    app = create_app(index, lambda: Index(index, checkpoint=checkpoint, device=device, dtype=dtype), config)
    with err.status("loading the model and the index"):
        try:
            app.state.served.get()
        except (IndexBusy, IndexUnfinished) as failure:  # still being built: serve, answering 503 until it is ready
            err.print(f"[yellow]{failure}[/yellow]; answering 503 until it is ready")
    err.print(f"serving {index} on http://{host}:{port}/ (docs at /docs)")
    uvicorn.run(app, host=host, port=port, log_level="warning")


def parse_layers(value: str) -> list[int]:
    """'24-29', '24,26,28' or 'none' -> block indices."""
    from cprag.errors import ConfigError

    if value.strip().lower() in {"", "none"}:
        return []
    try:
        layers: list[int] = []
        for part in value.split(","):
            first, _, last = part.strip().partition("-")
            layers += list(range(int(first), int(last or first) + 1))
        return layers
    except ValueError:
        raise ConfigError("--adapter-layers", value, "expected block indices like 24-29, 24,26,28 or none") from None


@app.command("train")
@reports_errors
def train_command(
    data: Path = typer.Argument(..., help="SQuAD-format training JSON (e.g. ../shared/data/squad-v1.1-train.json)."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Checkpoint directory to write (resumes if interrupted)."),
    validation: Path = typer.Option(None, "--validation", help="SQuAD-format validation JSON (default: hold out "
                                    "20% of the training file's articles)."),
    epochs: float = typer.Option(TRAIN_DEFAULTS.epochs, "--epochs"),
    max_steps: int = typer.Option(None, "--max-steps", help="Stop after this many steps."),
    max_questions: int = typer.Option(None, "--max-questions", help="Train on a seeded sample of N questions."),
    lr: float = typer.Option(TRAIN_DEFAULTS.lr, "--lr"),
    adapter_lr: float = typer.Option(TRAIN_DEFAULTS.adapter_lr, "--adapter-lr"),
    adapter_layers: str = typer.Option("18-29", "--adapter-layers", help="Backbone blocks with low-rank "
                                       "adapters trained through the CP path ('none': a frozen backbone)."),
    adapter_rank: int = typer.Option(16, "--adapter-rank"),
    batch_size: int = typer.Option(TRAIN_DEFAULTS.batch_size, "--batch-size"),
    distractors: int = typer.Option(TRAIN_DEFAULTS.distractors, "--distractors", help="Other passages in memory."),
    end_weight: float = typer.Option(TRAIN_DEFAULTS.end_weight, "--end-weight", help="Loss weight of the end."),
    no_answer_fraction: float = typer.Option(TRAIN_DEFAULTS.no_answer_fraction, "--no-answer-fraction",
                                             help="Share of questions asked without their passage (stop at once)."),
    no_answer_in_passage: float = typer.Option(TRAIN_DEFAULTS.no_answer_in_passage, "--no-answer-in-passage",
                                               help="Share of those no-answer questions that see their own "
                                               "passage with the answer's sentences hidden."),
    negatives: Path = typer.Option(None, "--negatives", help="SQuAD 2.0 file of unanswerable questions over the "
                                   "training file's paragraphs (pipelines/squad_negatives.py writes one): each is "
                                   "asked with its own passage in memory and trained to stop at once."),
    visible_every: int = typer.Option(TRAIN_DEFAULTS.visible_every, "--visible-every", help="Every N steps also "
                                      "train --visible-batch questions in the visible form (0: never)."),
    visible_batch: int = typer.Option(TRAIN_DEFAULTS.visible_batch, "--visible-batch"),
    dtype: str = typer.Option("auto", "--dtype", help="bfloat16 (autocast), float32, or auto: bf16 where the "
                              "CPU has bf16 units (AMX or AVX512-BF16), else float32."),
    seed: int = typer.Option(TRAIN_DEFAULTS.seed, "--seed"),
    init_from: Path = typer.Option(None, "--init-from", help="Continue a finished run: start from this "
                                   "checkpoint's head and adapters (same head settings)."),
    skip_steps: int = typer.Option(0, "--skip-steps", help="With --init-from: the steps that checkpoint trained "
                                   "(its batches of the seeded order are skipped; the schedule covers the rest)."),
    validation_questions: int = typer.Option(1000, "--validation-questions", help="Questions decoded to validate."),
    modes: str = typer.Option("hidden", "--modes", help="Validation modes: hidden,visible,closed."),
    as_json: bool = JSON_OPTION,
):
    """Train the CPLM for hidden-document QA: the CP head and adapters on the top backbone blocks, on cached
    activations of the frozen blocks below them; validate, and write a checkpoint.

    Example: cprag train ../shared/data/squad-v1.1-train.json --validation DEV.json --out checkpoints/mine

    Continue it past its 1,000 steps to a full epoch:
    cprag train TRAIN.json --validation DEV.json --out checkpoints/more --init-from checkpoints/mine --skip-steps 1000
    """
    from dataclasses import replace

    from cprag.training.recipe import train_checkpoint

    head = {**TRAIN_DEFAULTS.head, "adapter_layers": parse_layers(adapter_layers) or None,
            "adapter_rank": adapter_rank}
    config = replace(TRAIN_DEFAULTS, epochs=epochs, max_steps=max_steps, max_questions=max_questions, lr=lr,
                     adapter_lr=adapter_lr, batch_size=batch_size, distractors=distractors, end_weight=end_weight,
                     no_answer_fraction=no_answer_fraction, no_answer_in_passage=no_answer_in_passage,
                     visible_every=visible_every, visible_batch=visible_batch, dtype=dtype, seed=seed, head=head,
                     init_from=str(init_from) if init_from else None, skip_steps=skip_steps,
                     negatives=str(negatives) if negatives else None)
    with _progress_bar(as_json) as progress:
        tasks: dict[str, int] = {}

        def on_progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done, total=total)

        metrics = train_checkpoint(data, out_dir, config, validation_path=validation,
                                   validation_questions=validation_questions,
                                   validation_modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
                                   on_progress=on_progress)
    if as_json:
        emit_json(metrics)
        return
    table = Table(title=f"checkpoint written to {out_dir}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in sorted(metrics.items()):
        table.add_row(key, str(value))
    out.print(table)


eval_app = typer.Typer(no_args_is_help=True, help="Evaluation: batch QA against baselines, and benchmarks.")
app.add_typer(eval_app, name="eval")


def _progress_bar(transient: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    return Progress(*columns, console=err, transient=transient)


def _answers_streamed(out_dir: Path, as_json: bool, run):
    """Run `run(on_progress, on_result)` under a progress bar, streaming each answer to OUT/results.jsonl as it
    comes (a long run can be followed and is not lost). Returns what `run` returns."""
    from dataclasses import asdict

    out_dir.mkdir(parents=True, exist_ok=True)
    with _progress_bar(as_json) as progress, open(out_dir / "results.jsonl", "w") as stream:
        task = progress.add_task("answering", total=None)

        def streamed(result) -> None:
            stream.write(json.dumps(asdict(result), ensure_ascii=False) + "\n")
            stream.flush()

        return run(lambda done, total: progress.update(task, completed=done, total=total), streamed)


MIN_CONFIDENCE_EVAL = typer.Option(0.0, "--min-confidence", help="Withhold answers below this confidence (default "
                                   "0: always answer, as every SQuAD v1.1 question has an answer).")


@eval_app.command("squad")
@reports_errors
def eval_squad_command(
    data: Path = typer.Argument(..., help="SQuAD-format JSON with questions and reference answers."),
    index: Path = typer.Option(None, "--index", "-i", help="Retrieve passages from this index (recall@k)."),
    oracle: bool = typer.Option(False, "--oracle", help="Gold passage plus 4 distractor passages per question."),
    modes: str = typer.Option("hidden,visible,closed", "--modes",
                              help="Comma-separated: hidden,visible,closed; 'none' for retrieval recall only."),
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
    out_dir: Path = typer.Option(..., "--out", "-o", help="Where results, summary, report and plots go."),
    checkpoint: Path = CHECKPOINT_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Answer SQuAD questions in every mode with one checkpoint; write results, summary, report and plots.

    Example: cprag eval squad ../shared/data/squad-v1.1-dev-public.json --oracle --limit 1000 --out eval/runs/sq
    Example: cprag eval squad DATA --index indexes/squad --limit 300 --out eval/runs/squad-retrieved
    """
    from cprag.errors import ConfigError
    from cprag.evaluation.squad_eval import SquadEvalConfig, evaluate_squad, write_squad_report
    from cprag.model.checkpoint import held_out_articles

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

            opened = Index(index, checkpoint=checkpoint)
            model, tokenizer = opened.model, opened.tokenizer
        else:
            from cprag.api import load_reranker
            from cprag.model.checkpoint import load_model

            opened = None
            model, tokenizer = load_model(checkpoint)
    reranker = opened.reranker if opened is not None else load_reranker(checkpoint, model.config)
    summary, results = _answers_streamed(out_dir, as_json, lambda progress, result: evaluate_squad(
        data, config, model, tokenizer, opened, progress, result, reranker))
    split = ", held-out articles" if held_out else ""
    write_squad_report(out_dir, summary, results,
                       f"SQuAD ({summary['eval/source']}{split}, {summary['eval/questions']} q)")
    if as_json:
        emit_json(summary)
        return
    out.print((out_dir / "report.md").read_text().split("![")[0], highlight=False)
    err.print(f"wrote {out_dir}/results.jsonl, summary.json, report.md, f1_by_mode.png, latency_by_mode.png")


@eval_app.command("squad2")
@reports_errors
def eval_squad2_command(
    data: Path = typer.Argument(..., help="SQuAD 2.0 JSON (questions marked is_impossible have no answer)."),
    oracle: bool = typer.Option(True, "--oracle", help="Each question's own paragraph plus 4 distractors "
                                "(the memory squad2 uses; kept for the same flags as eval squad)."),
    modes: str = typer.Option("hidden", "--modes", help="Comma-separated: hidden,visible,closed."),
    limit: int = typer.Option(None, "--limit", help="A seeded random sample of N questions."),
    seed: int = typer.Option(0, "--seed"),
    min_confidence: float = typer.Option(None, "--min-confidence", help="Withhold answers below this confidence "
                                         "(default: the checkpoint's)."),
    start_beam: int = START_BEAM_OPTION,
    passage_prior: float = PASSAGE_PRIOR_OPTION,
    end_bias: float = END_BIAS_OPTION,
    batch_size: int = EVAL_BATCH_OPTION,
    out_dir: Path = typer.Option(..., "--out", "-o", help="Where results, summary, report and plot go."),
    checkpoint: Path = CHECKPOINT_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Abstention on SQuAD 2.0: HasAns EM/F1, NoAns accuracy, overall EM/F1 (official rules) and the best
    threshold, with answers below the confidence threshold withheld.

    Example: cprag eval squad2 ../shared/data/squad-v2.0-dev-public.json --limit 1000 --out eval/squad2
    """
    from cprag.api import load_passage_prior, load_reranker
    from cprag.errors import ConfigError
    from cprag.evaluation.squad2 import evaluate_squad2, write_squad2_report
    from cprag.evaluation.squad_eval import SquadEvalConfig
    from cprag.model.checkpoint import load_model

    if not oracle:
        raise ConfigError("--oracle", oracle, "squad2 answers from each question's own paragraph and distractors")
    config = SquadEvalConfig(modes=tuple(m.strip() for m in modes.split(",") if m.strip()), limit=limit, seed=seed,
                             batch_size=batch_size, end_bias=end_bias, start_beam=start_beam,
                             passage_prior=load_passage_prior(checkpoint) if passage_prior is None else passage_prior)
    with err.status("loading the model"):
        model, tokenizer = load_model(checkpoint)
        reranker = load_reranker(checkpoint, model.config)
    threshold = model.config.min_confidence if min_confidence is None else min_confidence
    if not 0.0 <= threshold <= 1.0:
        raise ConfigError("--min-confidence", threshold, "must be a probability in [0, 1]")
    summary, results = _answers_streamed(out_dir, as_json, lambda progress, result: evaluate_squad2(
        data, config, model, tokenizer, threshold, progress, result, reranker))
    write_squad2_report(out_dir, summary, results, f"SQuAD 2.0 (oracle, {summary['eval/questions']} q)")
    if as_json:
        emit_json(summary)
        return
    out.print((out_dir / "report.md").read_text().split("![")[0], highlight=False)
    err.print(f"wrote {out_dir}/results.jsonl, summary.json, report.md, abstention.png")


@eval_app.command("scale")
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
    out_dir: Path = typer.Option(Path("eval/scale"), "--out", "-o", help="Where summary.json and report.md go."),
    as_json: bool = JSON_OPTION,
):
    """Write N synthetic passages (random keys and clustered embeddings, the real schema) straight into an index,
    then time FAISS search and k=5 key-shard fetches, recall@5 against exact search, disk bytes per token, memory.

    Example: cprag eval scale --passages 1000000 --out eval/scale --json
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
        with _progress_bar(as_json) as progress:
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


@eval_app.command("bench")
@reports_errors
def eval_bench_command(
    corpus: Path = typer.Option(Path("examples/long-corpus.jsonl"), "--corpus", help="Corpus to index and query."),
    index: Path = typer.Option(None, "--index", "-i", help="Use this index instead of building one."),
    questions: int = typer.Option(5, "--questions", help="Questions per latency figure."),
    documents: int = typer.Option(0, "--documents", help="Index a seeded sample of this many documents (0: all)."),
    seed: int = typer.Option(0, "--seed"),
    out_dir: Path = typer.Option(None, "--out", help="Also write summary.json, report.md and latency_by_k.png here."),
    checkpoint: Path = CHECKPOINT_OPTION,
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available; bf16 on cuda)."),
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

    Example: cprag eval bench --out eval/bench --json
    Example: cprag eval bench --corpus examples/corpus.jsonl --json
    Example: cprag eval bench --corpus squad-v1.1-dev.json --documents 40 --json
    Example: cprag eval bench --device cuda --json   (pipelines/gpu_check.sh runs this on a GPU)
    """
    import random
    import tempfile

    import torch

    from cprag.api import Index
    from cprag.errors import ConfigError
    from cprag.evaluation.bench import (
        batch_identity,
        batch_throughput,
        bench_questions,
        encode_vs_forward,
        latency_hidden_vs_visible,
        memory_figures,
        start_beam_latency,
        warm_vs_cold,
        write_bench_report,
    )
    from cprag.index.build import IndexConfig, build_index
    from cprag.index.corpus import read_corpus
    from cprag.index.retrieve import MiniLMEmbedder
    from cprag.model.checkpoint import load_model, model_fingerprint
    from cprag.model.runtime import default_device, place, resolve_dtype

    if documents < 0:
        raise ConfigError("--documents", documents, "must be 0 (all) or a positive count")
    device = device or default_device()
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError("--device", device, "expected cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device", device, "this machine has no CUDA device")
    with err.status("loading the model"):
        model, tokenizer = load_model(checkpoint)
        fingerprint = model_fingerprint(model)  # of the stored weights: an --index built in another dtype opens
        model = place(model, device, resolve_dtype(device, dtype))
    with tempfile.TemporaryDirectory() as scratch:
        chosen = read_corpus(corpus).documents
        if documents and index is None:
            chosen = random.Random(seed).sample(chosen, min(documents, len(chosen)))
            corpus = Path(scratch) / "bench-corpus.jsonl"
            corpus.write_text("".join(json.dumps({**d.metadata, "id": d.id, "title": d.title, "text": d.text}) + "\n"
                                      for d in chosen))
        if index is None:
            index = Path(scratch) / "bench-index"
            with err.status("indexing the corpus"):
                passage_tokens = min(384, model.config.max_position_embeddings // 2)
                build_index(corpus, index, model, tokenizer, MiniLMEmbedder(),
                            IndexConfig(max_passage_tokens=passage_tokens, rebuild=True), fingerprint=fingerprint)
        opened = Index(index, model=model, tokenizer=tokenizer, device=device, fingerprint=fingerprint)
        asked = [f"What is said about {d.title or d.id}?" for d in chosen][:questions]
        figures = {}
        with err.status("memory and throughput"):
            figures.update(memory_figures(opened))
            figures.update(encode_vs_forward(model, tokenizer, [d.text for d in chosen]))
        with err.status("hidden vs visible latency"):
            figures.update(latency_hidden_vs_visible(opened, asked))
        with err.status("start beam 4 against greedy"):
            figures.update(start_beam_latency(opened, asked))
        with err.status("warm vs cold key-shard cache"):
            figures.update(warm_vs_cold(opened, asked))
        if batch_questions > 0:
            with err.status(f"batch throughput ({batch_questions} questions at 1, 4, 16, 64 per pass)"):
                titles = [d.title or d.id for d in chosen]
                asked_in_batches = bench_questions(titles, batch_questions)
                figures.update(batch_throughput(opened, asked_in_batches))
            with err.status("batching's own effect on answers, in fp32"):
                exact = opened if next(model.parameters()).dtype == torch.float32 else Index(
                    index, model=place(load_model(checkpoint)[0], device, torch.float32), tokenizer=tokenizer,
                    device=device, fingerprint=fingerprint)
                figures.update(batch_identity(exact, asked_in_batches))
    figures["bench/device"] = opened.device
    figures["bench/dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    if out_dir is not None:
        write_bench_report(out_dir, figures)
        err.print(f"wrote {out_dir}/summary.json, report.md, latency_by_k.png")
    if as_json:
        emit_json(figures)
        return
    table = Table(title="cprag bench (one run)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in figures.items():
        table.add_row(key, str(value))
    out.print(table)


@eval_app.command("needle")
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
    with _progress_bar(as_json) as progress:
        total = len(length_list) * len(depth_list) * (trials * ("hidden" in mode_list)
                                                      + min(trials, visible_trials) * ("visible" in mode_list))
        task = progress.add_task("needles", total=total)
        summary, results = run_needle(model, tokenizer, length_list, depth_list, trials, mode_list, seed,
                                      visible_trials, passage_prior=weight, embedder=embedder, reranker=reranker,
                                      start_beam=default_start_beam(reranker) if start_beam is None else start_beam,
                                      on_result=lambda r: progress.advance(task))
    write_needle_report(out_dir, summary, results, model.config.max_position_embeddings)
    if as_json:
        emit_json(summary)
        return
    out.print((out_dir / "report.md").read_text().split("![")[0], highlight=False)


def read_text_argument(value: str) -> str:
    from cprag.errors import ConfigError

    if not value.startswith("@"):
        return value
    path = Path(value[1:])
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError("--passage", value, f"cannot read the file: {error}") from None


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


if __name__ == "__main__":
    main()
