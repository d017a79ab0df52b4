"""`cprag eval squad`: batch QA in hidden, visible and closed modes, with retrieval recall, latency, key-shard
reuse, and a report with plots. Summary keys are flat and namespaced (qa/hidden/f1, retrieval/recall@5, ...)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from cprag.decoding.passage_prior import check_weight
from cprag.decoding.prompt import MODES
from cprag.decoding.rerank import check_start_beam, default_start_beam
from cprag.errors import ConfigError
from cprag.evaluation.metrics import squad2_question_scores
from cprag.evaluation.oracle_qa import QAResult, evaluate_oracle, summarize
from cprag.evaluation.squad import read_squad
from cprag.evaluation.verified import verified_figures, verify_results
from cprag.index.key_codec import codec_name, pq_subvectors
from cprag.model.config import check_end_bias

# MODES, and "reader": the visible span reader (cprag.model.span_reader) over the same passages
EVAL_MODES = (*MODES, "reader")


@dataclass
class SquadEvalConfig:
    modes: tuple[str, ...] = ("hidden", "visible", "closed")
    limit: int | None = None
    seed: int = 0
    k: int = 5
    distractors: int = 4
    max_new_tokens: int = 32
    articles: tuple[str, ...] | None = None  # only questions of these articles (a checkpoint's held-out ones)
    min_confidence: float = 0.0  # withhold answers below this confidence (0: always answer)
    start_beam: int | None = None  # first tokens decoded per question (1: greedy; None: the reranker's beam)
    batch_size: int = 1  # hidden-mode questions decoded per backbone pass (latency is then a batch's share)
    key_codec: str = "float16"  # with --oracle: the keys as an index storing them this way gives them back
    pq_subvectors: int | None = None  # with key_codec "pq": codes per key (None: cprag.index.key_codec.pq_subvectors)
    # weight of the retrieval scores in the copy scores (cprag.decoding.passage_prior; 0: off)
    passage_prior: float = 0.0
    end_bias: float | None = None  # nats added to ending's log-probability (None: the checkpoint's config.end_bias)

    def __post_init__(self):
        self.key_codec = codec_name(self.key_codec)
        unknown = [m for m in self.modes if m not in EVAL_MODES]
        if unknown:
            raise ConfigError("--modes", ",".join(self.modes), f"expected some of {', '.join(EVAL_MODES)}, or none")
        if self.limit is not None and self.limit < 1:
            raise ConfigError("--limit", self.limit, "must be at least 1")
        if self.k < 1:
            raise ConfigError("-k", self.k, "must be at least 1")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ConfigError("--min-confidence", self.min_confidence, "must be a probability in [0, 1]")
        check_start_beam(self.start_beam)
        if self.batch_size < 1:
            raise ConfigError("--batch-size", self.batch_size, "must be at least 1")
        self.passage_prior = check_weight(self.passage_prior)
        if self.end_bias is not None:
            self.end_bias = check_end_bias(self.end_bias)


def sample_examples(data, limit: int | None, seed: int, articles: tuple[str, ...] | None = None):
    """The questions of `articles` (default: all), in file order, then a seeded sample of `limit` of them."""
    examples = list(data.examples)
    if articles is not None:
        wanted = set(articles)
        examples = [e for e in examples if e.article in wanted]
        if not examples:
            raise ConfigError("--held-out", ", ".join(articles), "none of these articles is in the data")
    if limit is not None and limit < len(examples):
        # shuffle then cut, as training's validation does: --held-out --limit N asks the very same questions
        random.Random(seed).shuffle(examples)
        examples = examples[:limit]
    return examples


def evaluate_squad(
    data_path: str | Path, config: SquadEvalConfig, model, tokenizer, index=None,
    on_progress: Callable[[int, int], None] | None = None, on_result: Callable[[QAResult], None] | None = None,
    reranker=None, reader=None, verifier=None,
) -> tuple[dict, list[QAResult]]:
    """Answer every sampled question in every mode; with `index` (an opened cprag.Index) passages are retrieved,
    otherwise each question gets its gold passage plus `distractors` others (oracle). `on_result` sees each
    answer as it comes (the CLI streams them to results.jsonl, so a long run can be followed and is not lost).
    Mode "reader" (oracle only) needs `reader`, a loaded span reader. With `verifier`, hidden and visible answers
    are then verified and scored with the verifier's withholding too (cprag.evaluation.verified)."""
    data = read_squad(data_path)
    examples = sample_examples(data, config.limit, config.seed, config.articles)
    total = len(examples) * len(config.modes)
    done = [0]

    def tick(result):
        done[0] += 1
        if on_result:
            on_result(result)
        if on_progress:
            on_progress(done[0], total)

    extra: dict[str, float] = {}
    reranker = index.reranker if index is not None else reranker
    if config.start_beam is None:  # the checkpoint's default: its reranker's beam
        config = replace(config, start_beam=default_start_beam(reranker))
    if index is None and not config.modes:
        raise ConfigError("--modes", "none", "without --index there is nothing to evaluate")
    if "reader" in config.modes and index is not None:
        raise ConfigError("--modes", "reader", "the span reader is scored with --oracle passages")
    if index is None:
        results = evaluate_oracle(model, tokenizer, examples, data.passages, list(config.modes), config.distractors,
                                  config.seed, config.max_new_tokens, on_result=tick,
                                  min_confidence=config.min_confidence, start_beam=config.start_beam,
                                  batch_size=config.batch_size, reranker=reranker, key_codec=config.key_codec,
                                  pq_subvectors=config.pq_subvectors, passage_prior=config.passage_prior,
                                  end_bias=config.end_bias, reader=reader)
        extra["eval/keys"] = config.key_codec
        if config.key_codec == "pq":
            extra["eval/pq_subvectors"] = config.pq_subvectors or pq_subvectors(model.config.key_dim)
    else:
        results, extra = _evaluate_with_index(index, examples, config, tick)
    summary = summarize(results) if results else {}
    if verifier is not None and results:
        summary["latency/verify_ms"] = round(verify_results(model, tokenizer, verifier, results, data.passages), 1)
        summary.update(verified_figures(results, verifier))
    for mode in config.modes:
        latencies = [r.latency_ms for r in results if r.mode == mode]
        summary[f"latency/{mode}/p50_ms"] = round(float(np.percentile(latencies, 50)), 1)
        summary[f"latency/{mode}/p90_ms"] = round(float(np.percentile(latencies, 90)), 1)
    summary.update(extra)
    summary["eval/passage_prior"] = config.passage_prior
    summary["eval/start_beam"] = config.start_beam
    summary["eval/end_bias"] = model.config.end_bias if config.end_bias is None else config.end_bias
    summary["eval/questions"] = len(examples)
    summary["eval/source"] = "index" if index is not None else "oracle"
    summary["eval/articles"] = "held-out" if config.articles is not None else "all"
    return summary, results


def retrieval_recall(index, examples, k: int, batch: int = 256) -> dict[str, float]:
    """recall@1, @5 and @k of the gold passage (doc id TITLE#i) over all examples, retrieved in batches."""
    found = []
    for start in range(0, len(examples), batch):
        chunk = examples[start : start + batch]
        for example, hits in zip(chunk, index.retrieve([e.question for e in chunk], max(k, 5)), strict=True):
            docs = [index_doc_id(h.passage_id) for h in hits]
            found.append([example.passage_id in docs[:n] for n in (1, 5, k)])
    hits = np.array(found, dtype=float)
    return {"retrieval/recall@1": round(float(hits[:, 0].mean()), 4),
            "retrieval/recall@5": round(float(hits[:, 1].mean()), 4),
            f"retrieval/recall@{k}": round(float(hits[:, 2].mean()), 4)}


def index_doc_id(passage_id: str) -> str:
    # a document split into passages has passage ids DOC@N; SQuAD paragraphs fit, so mostly DOC itself
    return passage_id.rsplit("@", 1)[0] if "@" in passage_id else passage_id


def _evaluate_with_index(index, examples, config: SquadEvalConfig, tick) -> tuple[list[QAResult], dict]:
    results, cold, warm = [], [], []
    extra = retrieval_recall(index, examples, config.k)
    layout = index.passage_index.layout
    extra["retrieval/faiss"] = layout["kind"]
    if layout["kind"] != "flat":  # how much of the exact top 5 the approximate index finds, on these questions
        ids, vectors = index.store.embeddings()
        queries = index.embedder.embed([e.question for e in examples])
        extra["retrieval/recall@5_vs_exact"] = round(index.passage_index.recall_against_exact(ids, vectors, queries),
                                                     4)
    for example in examples:
        for mode in config.modes:
            misses = index.cache.misses
            tick_start = time.perf_counter()
            answer = index.ask(example.question, k=config.k, mode=mode, max_new_tokens=config.max_new_tokens,
                               min_confidence=config.min_confidence, start_beam=config.start_beam,
                               passage_prior=config.passage_prior, end_bias=config.end_bias, verify=False)
            latency = (time.perf_counter() - tick_start) * 1000
            retrieved = [p["doc_id"] for p in answer.passages]
            if mode != "closed":
                (cold if index.cache.misses > misses else warm).append(answer.timings_ms["load_keys"])
            em, f1 = squad2_question_scores(answer.answer, example.answers)
            result = QAResult(
                qid=example.qid, mode=mode, question=example.question, prediction=answer.answer,
                references=example.answers, em=100 * em, f1=100 * f1, copy_rate=answer.copy_rate,
                latency_ms=latency, passages=retrieved, confidence=answer.confidence, no_answer=answer.no_answer,
            )
            results.append(result)
            tick(result)
    if cold:
        extra["reuse/cold_load_ms"] = round(float(np.mean(cold)), 2)
    if warm:
        extra["reuse/warm_load_ms"] = round(float(np.mean(warm)), 3)
        extra["reuse/warm_fraction"] = round(len(warm) / (len(warm) + len(cold)), 3)
    return results, extra


def write_squad_report(out_dir: str | Path, summary: dict, results: list[QAResult], title: str) -> list[Path]:
    """results.jsonl, summary.json, report.md and two PNG plots (F1 by mode, latency by mode)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.jsonl", "w") as handle:
        for result in results:
            handle.write(json.dumps(asdict(result), ensure_ascii=False) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    modes = [m for m in EVAL_MODES if f"qa/{m}/f1" in summary]
    if not modes:
        others = "\n".join(f"- `{k}`: {v}" for k, v in sorted(summary.items()))
        (out_dir / "report.md").write_text(f"# {title}\n\n{others}\n")
        return []
    verified = [m for m in modes if f"qa/{m}+verifier/f1" in summary]
    labels = modes + [f"{m}+verifier" for m in verified]
    plots = [bar_plot(out_dir / "f1_by_mode.png", labels, [[summary[f"qa/{m}/em"] for m in labels],
                                                               [summary[f"qa/{m}/f1"] for m in labels]],
                       ["EM", "F1"], "score (%)", f"{title}: EM and F1 by mode")]
    latencies = [[r.latency_ms for r in results if r.mode == m] for m in modes]
    plots.append(_box_plot(out_dir / "latency_by_mode.png", modes, latencies, "latency per question (ms)",
                           f"{title}: latency by mode"))
    withheld = {m: 100 * float(np.mean([r.no_answer for r in results if r.mode == m])) for m in modes}
    rows = [f"| {m} | {summary[f'qa/{m}/n']} | {summary[f'qa/{m}/em']:.1f} | {summary[f'qa/{m}/f1']:.1f} | "
            f"{withheld[m]:.1f}% | {summary[f'qa/{m}/copy_rate']:.2f} | {summary[f'latency/{m}/p50_ms']:.0f} | "
            f"{summary[f'latency/{m}/p90_ms']:.0f} |" for m in modes]
    # a verified row: the same answers, less those the verifier withholds (answers already withheld by confidence
    # were not verified, so the shares add); its latency is the verifier's mean cost on top of the mode's
    rows += [f"| {m}+verifier | {summary[f'qa/{m}/n']} | {summary[f'qa/{m}+verifier/em']:.1f} | "
             f"{summary[f'qa/{m}+verifier/f1']:.1f} | {withheld[m] + 100 * summary[f'verify/{m}/withheld']:.1f}% | "
             f"{summary[f'qa/{m}/copy_rate']:.2f} | +{summary['latency/verify_ms']:.0f} | "
             f"+{summary['latency/verify_ms']:.0f} |" for m in verified]
    others = "\n".join(f"- `{k}`: {v}" for k, v in sorted(summary.items())
                       if not k.startswith(("qa/", "latency/")) or "verify" in k)
    (out_dir / "report.md").write_text(
        f"# {title}\n\n| mode | n | EM | F1 | withheld | copy rate | p50 ms | p90 ms |\n"
        f"|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        + ("In `+verifier` rows the answers the verifier doubts are withheld (cprag.evaluation.verified); their "
           "latency is the verifier's mean cost per answer, on top of the mode's.\n\n" if verified else "")
        + f"{others}\n\n![F1 by mode](f1_by_mode.png)\n\n![latency by mode](latency_by_mode.png)\n"
    )
    return plots


def bar_plot(path: Path, labels, series, names, ylabel, title) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    width = 0.8 / len(series)
    for i, (values, name) in enumerate(zip(series, names, strict=True)):
        positions = np.arange(len(labels)) + (i - (len(series) - 1) / 2) * width
        bars = ax.bar(positions, values, width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(np.arange(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max(100, max(max(v) for v in series) * 1.15))
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _box_plot(path: Path, labels, values, ylabel, title) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.boxplot(values, tick_labels=labels, showfliers=False)
    for i, series in enumerate(values, start=1):
        ax.annotate(f"p50 {np.median(series):.0f} ms", (i, np.median(series)), textcoords="offset points",
                    xytext=(28, 0), fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
