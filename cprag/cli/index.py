"""`cprag index` and `cprag info`: encode a corpus into an index of CP keys, and describe an index."""

from __future__ import annotations

from pathlib import Path

import typer

from cprag.cli.options import CHECKPOINT_OPTION, DEVICE_OPTION, DTYPE_OPTION, INDEX_OPTION, JSON_OPTION
from cprag.cli.output import emit_json, err, out, print_key_values, progress_bar, reports_errors


@reports_errors
def index_command(
    corpus: Path = typer.Argument(
        ..., help="JSONL ({id, text, title?}), SQuAD .json, one .txt/.md/.html/.pdf file, or a folder of them."),
    index: Path = INDEX_OPTION,
    glob: str = typer.Option(None, "--glob", help="Only files whose path relative to CORPUS matches this pattern, "
                             "e.g. '**/*.html'."),
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
    device: str = DEVICE_OPTION,
    dtype: str = DTYPE_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Encode a corpus into CP keys (LanceDB) and a FAISS index; reruns add only new or changed documents.

    Example: cprag index examples/corpus.jsonl --index indexes/demo
    Example: cprag index corpus.jsonl --index indexes/small --keys int8   # 70 B per stored token
    Example: cprag index corpus.jsonl --index indexes/big --ray 10.0.0.5:6379   # encode on a Ray cluster
    Example: cprag index docs/ --glob '**/*.html' --index indexes/docs
    """
    from cprag.index.build import IndexConfig, build_index
    from cprag.index.retrieve import APPROXIMATE_ABOVE, COMPRESSED_ABOVE, MiniLMEmbedder
    from cprag.model.checkpoint import load_model, model_fingerprint
    from cprag.model.runtime import default_device, place, resolve_dtype

    above = APPROXIMATE_ABOVE if approximate_above is None else approximate_above
    config = IndexConfig(max_passage_tokens=max_passage_tokens, chunk_passages=chunk, rebuild=rebuild,
                         key_codec=keys, approximate_above=above, pq_subvectors=pq_subvectors,
                         compressed_above=COMPRESSED_ABOVE if compressed_above is None else compressed_above,
                         glob=glob)
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
    progress = progress_bar(transient=as_json)
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
    render_index_report(report, cluster, as_json)


def render_index_report(report, cluster, as_json: bool) -> None:
    """The skipped sources on stderr, then the summary: one JSON object, or one line."""
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
    print_key_values(dict(sorted(info.items())), nested=(dict, list))
