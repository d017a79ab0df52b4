"""One `cprag eval bench` run: load the model, index the corpus (or open a given index), and measure every figure
of `cprag.evaluation.bench` on it.

The figures themselves live in `bench.py`; this module only orders them, so a caller (the CLI, a script) gets the
whole run from one settings object and one call.
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cprag.errors import ConfigError

DEFAULT_CORPUS = Path("examples/long-corpus.jsonl")  # ~300-token passages, a common RAG chunk size
BATCH_SIZES = (1, 4, 16, 64)  # questions per backbone pass in the batch throughput figures


@dataclass
class BenchSettings:
    """What one bench run measures on; checked when built, naming the CLI flag of a wrong value."""

    corpus: Path = DEFAULT_CORPUS
    index: Path | None = None  # an index to query instead of building one from the corpus
    questions: int = 5  # questions per latency figure
    documents: int = 0  # index a seeded sample of this many documents (0: all)
    seed: int = 0
    checkpoint: Path | None = None
    device: str | None = None  # None: cuda when present
    dtype: str | None = None  # None: cprag.model.runtime's default for the device
    batch_questions: int = 64  # questions for the batch throughput figures (0 skips them)

    def __post_init__(self):
        if self.documents < 0:
            raise ConfigError("--documents", self.documents, "must be 0 (all) or a positive count")
        if self.device is not None and self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError("--device", self.device, "expected cpu, cuda or cuda:N")


def run_bench(settings: BenchSettings, on_stage: Callable[[str], None] = lambda stage: None) -> dict:
    """Every bench figure in one run, plus bench/device and bench/dtype; `on_stage` hears each stage's name as it
    starts (the CLI shows it as a status line)."""
    import torch

    from cprag.api import Index, load_verifier
    from cprag.index.corpus import read_corpus
    from cprag.model.checkpoint import load_model, model_fingerprint
    from cprag.model.runtime import default_device, place, resolve_dtype

    device = settings.device or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device", device, "this machine has no CUDA device")
    on_stage("loading the model")
    model, tokenizer = load_model(settings.checkpoint)
    fingerprint = model_fingerprint(model)  # of the stored weights: an --index built in another dtype opens
    model = place(model, device, resolve_dtype(device, settings.dtype))
    with tempfile.TemporaryDirectory() as scratch:
        corpus, index = settings.corpus, settings.index
        chosen = read_corpus(corpus).documents
        if settings.documents and index is None:
            chosen = random.Random(settings.seed).sample(chosen, min(settings.documents, len(chosen)))
            corpus = write_sample(chosen, Path(scratch) / "bench-corpus.jsonl")
        if index is None:
            on_stage("indexing the corpus")
            index = build_bench_index(corpus, Path(scratch) / "bench-index", model, tokenizer, fingerprint)
        opened = Index(index, model=model, tokenizer=tokenizer, device=device, fingerprint=fingerprint)
        # a model handed in opens without its checkpoint's verifier; the bench times the checkpoint's own
        verifier = load_verifier(settings.checkpoint, model.config)
        if verifier is not None and verifier.fingerprint in ("", fingerprint):
            opened.verifier = verifier

        def exact_index():
            """The same index answered by an fp32 copy of the model, for batching's own effect on answers."""
            if next(model.parameters()).dtype == torch.float32:
                return opened
            exact = place(load_model(settings.checkpoint)[0], device, torch.float32)
            return Index(index, model=exact, tokenizer=tokenizer, device=device, fingerprint=fingerprint)

        figures = measure_figures(opened, model, tokenizer, chosen, settings, exact_index, on_stage)
    figures["bench/device"] = opened.device
    figures["bench/processor"] = processor_name(opened.device)  # speed figures mean little without it
    figures["bench/dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    return figures


def processor_name(device: str) -> str:
    """The chip the figures were measured on: the GPU's name, or the CPU's with its best vector units."""
    import torch

    from cprag.model.cpu_features import cpu_name

    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_name()


def measure_figures(opened, model, tokenizer, chosen: list, settings: BenchSettings, exact_index: Callable,
                    on_stage: Callable[[str], None]) -> dict:
    """The figures of `cprag.evaluation.bench`, stage by stage, on an opened index of the `chosen` documents."""
    from cprag.evaluation.bench import (
        batch_identity,
        batch_throughput,
        bench_questions,
        encode_vs_forward,
        latency_hidden_vs_visible,
        memory_figures,
        reader_latency,
        start_beam_latency,
        verify_latency,
        warm_vs_cold,
    )
    from cprag.model.reader_checkpoint import reader_exists, reader_fits

    asked = [f"What is said about {d.title or d.id}?" for d in chosen][:settings.questions]
    figures = {}
    on_stage("memory and throughput")
    figures.update(memory_figures(opened))
    figures.update(encode_vs_forward(model, tokenizer, [d.text for d in chosen]))
    on_stage("hidden vs visible latency")
    figures.update(latency_hidden_vs_visible(opened, asked))
    on_stage("start beam 4 against greedy")
    figures.update(start_beam_latency(opened, asked))
    if opened.verifier is not None:
        on_stage("the verifier's cost beside a hidden ask")
        figures.update(verify_latency(opened, asked))
    if reader_exists(opened.reader_path) and reader_fits(opened.reader_path, model.config.base_model):
        on_stage("a reader ask beside a hidden one")
        figures.update(reader_latency(opened, asked))
    on_stage("warm vs cold key-shard cache")
    figures.update(warm_vs_cold(opened, asked))
    if settings.batch_questions > 0:
        sizes = ", ".join(str(size) for size in BATCH_SIZES)
        on_stage(f"batch throughput ({settings.batch_questions} questions at {sizes} per pass)")
        asked_in_batches = bench_questions([d.title or d.id for d in chosen], settings.batch_questions)
        figures.update(batch_throughput(opened, asked_in_batches, sizes=BATCH_SIZES))
        on_stage("batching's own effect on answers, in fp32")
        figures.update(batch_identity(exact_index(), asked_in_batches))
    return figures


def write_sample(documents: list, path: Path) -> Path:
    """The sampled documents as a JSONL corpus at `path` (their metadata kept), for the index to read."""
    path.write_text("".join(json.dumps({**d.metadata, "id": d.id, "title": d.title, "text": d.text}) + "\n"
                            for d in documents))
    return path


def build_bench_index(corpus: Path, index: Path, model, tokenizer, fingerprint: str) -> Path:
    """A fresh index of `corpus` at `index`, passages at most half the backbone's window (and 384 tokens)."""
    from cprag.index.build import IndexConfig, build_index
    from cprag.index.retrieve import MiniLMEmbedder

    passage_tokens = min(384, model.config.max_position_embeddings // 2)
    build_index(corpus, index, model, tokenizer, MiniLMEmbedder(),
                IndexConfig(max_passage_tokens=passage_tokens, rebuild=True), fingerprint=fingerprint)
    return index
