"""`cprag eval bench`: the figures that make the case for hidden-document keys, all measured in one run.

- memory/keys_bytes_per_token vs memory/kv_bytes_per_token (the backbone's bf16 KV cache, from its config)
- latency/hidden_over_visible@k{1,5,10}: ask latency with passages as keys vs in the prompt, same decode length
- index/throughput_over_forward: key encoding tokens/s over the bare backbone forward on the same batches
- reuse/warm_over_cold_qps: batch questions per second with a warm key-shard cache over a cold one
- batch/qps@B for B in 1, 4, 16, 64: questions per second with B questions decoded per backbone pass
  (`Index.ask_many`), and batch/qps@16_over_qps@1; batch/answers_identical says every B gave the B=1 answers
  and batch/answers_agreeing how many did at the worst B; batch/answers_identical_float32 is the same check
  (B=16 against B=1) in fp32, where bf16's shape-dependent rounding cannot move a near-tied answer
- latency/beam4_*: ask with the default start beam (4 starts as rows of one batch, reranked) against greedy
- latency/verify@k5_ms: the answer verifier's pass per answer, latency/verify_over_hidden_ask@k5 that pass over
  an ask without it, and latency/verified_over_hidden_ask@k5 the ask with it over the ask without (both as
  shipped: default start beam, answers to their natural end)
- latency/reader_ask@k5_ms: an ask in mode "reader" (the span reader reads the 5 retrieved passages' text) and
  latency/reader_over_hidden_ask@k5 its ratio to a hidden ask (both unverified), when a reader is shipped

Asks are greedy (`start_beam=1`) unless a figure says beam: the figures compare with earlier runs that were.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from cprag.decoding.generate import generate
from cprag.index.build import kv_cache_bytes_per_token
from cprag.index.encode import encode_passages, length_batches, tokenize_passage


def _timed(fn: Callable, repeats: int) -> tuple[float, object]:
    """(mean seconds per call after one warm-up call, the last call's result)."""
    result = fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    return (time.perf_counter() - start) / repeats, result


@torch.inference_mode()
def encode_vs_forward(model, tokenizer, texts: list[str], max_tokens: int = 4096) -> dict[str, float]:
    """Tokens/s of key encoding and of the bare backbone forward, on the very same batches."""
    tokenized = [tokenize_passage(tokenizer, t) for t in texts]
    tokens = sum(len(t.ids) + 1 for t in tokenized)
    bos = tokenizer.bos_token_id
    batches = [(ids, mask) for _, ids, mask in length_batches(tokenized, bos, max_tokens)]

    def forward():
        for ids, mask in batches:
            model.backbone(input_ids=ids, attention_mask=mask)

    def encode():
        for _ in encode_passages(model, tokenized, bos_id=bos, max_tokens=max_tokens):
            pass

    (forward_s, _), (encode_s, _) = _timed(forward, 2), _timed(encode, 2)
    return {"index/encode_tokens_per_s": round(tokens / encode_s, 1),
            "index/forward_tokens_per_s": round(tokens / forward_s, 1),
            "index/throughput_over_forward": round(forward_s / encode_s, 3)}


@torch.inference_mode()
def forward_tokens_per_second(model, batch: int = 8, length: int = 128, repeats: int = 3, seed: int = 0) -> float:
    """Tokens per second of a batched backbone forward pass on random ids (one warm-up pass first)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, length), generator=generator).to(next(model.parameters()).device)
    model.backbone(ids)
    start = time.perf_counter()
    for _ in range(repeats):
        model.backbone(ids)
    return batch * length * repeats / (time.perf_counter() - start)


def latency_hidden_vs_visible(index, questions: list[str], ks=(1, 5, 10), new_tokens: int = 8) -> dict[str, float]:
    """Per-question latency (retrieval excluded, warm shards) with the same number of generated tokens.

    Hidden mode is timed as shipped (copied spans drafted and verified several tokens per pass) and without
    drafting (`hidden_undrafted`), which is what the backbone alone costs: visible mode drafts nothing.
    """
    figures = {}
    runs = {"hidden": ("hidden", 8), "hidden_undrafted": ("hidden", 0), "visible": ("visible", 0)}
    for k in ks:
        k = min(k, len(index))
        times = {name: [] for name in runs}
        passage_tokens, prompt_tokens = [], []
        for question in questions:
            hits = index.retrieve([question], k)[0]
            passages = index.cache.get([h.passage_id for h in hits], index.store.fetch)
            passage_tokens += [len(p.ids) for p in passages]
            for name, (mode, draft) in runs.items():
                seconds, generation = _timed(lambda m=mode, d=draft, p=passages, q=question: generate(
                    index.model, index.tokenizer, q, p, m, max_new_tokens=new_tokens, stop_at_end=False,
                    draft_tokens=d, prefix=index.prefix), 1)
                times[name].append(seconds)
                if mode == "visible":
                    prompt_tokens.append(generation.prompt_tokens)
        figures[f"latency/passage_tokens_mean@k{k}"] = round(float(np.mean(passage_tokens)), 1)
        figures[f"latency/visible_prompt_tokens@k{k}"] = round(float(np.mean(prompt_tokens)), 1)
        median = {name: float(np.median(values)) for name, values in times.items()}
        for name, seconds in median.items():
            figures[f"latency/{name}@k{k}_ms"] = round(seconds * 1000, 1)
        figures[f"latency/hidden_over_visible@k{k}"] = round(median["hidden"] / median["visible"], 3)
        figures[f"latency/hidden_undrafted_over_visible@k{k}"] = round(
            median["hidden_undrafted"] / median["visible"], 3)
    return figures


def start_beam_latency(index, questions: list[str], k: int = 5, beam: int = 4) -> dict[str, float]:
    """Per-question ask latency (warm shards, answers to their natural end) greedy, and with a start beam of
    `beam` decoded as rows of one batch (as `ask` does) or one start after another (`generate`), and whether the
    two beams answered alike."""
    k = min(k, len(index))
    options = dict(k=k, min_confidence=0.0, min_retrieval_score=-1.0, verify=False)
    times: dict[str, list[float]] = {"greedy": [], "rows": [], "sequential": []}
    same = True
    for question in questions:
        hits = index.retrieve([question], k)[0]
        passages = index.cache.get([h.passage_id for h in hits], index.store.fetch)
        scores = [h.score for h in hits]
        seconds, _ = _timed(lambda q=question: index.ask(q, start_beam=1, **options), 1)
        times["greedy"].append(seconds)
        seconds, rows = _timed(lambda q=question: index.ask(q, start_beam=beam, **options), 1)
        times["rows"].append(seconds)
        seconds, alone = _timed(lambda q=question, p=passages, s=scores: generate(
            index.model, index.tokenizer, q, p, "hidden", start_beam=beam, reranker=index.reranker,
            prefix=index.prefix, passage_scores=s, passage_prior=index.passage_prior), 1)
        times["sequential"].append(seconds)
        same = same and rows.answer == alone.answer
    median = {name: float(np.median(values)) for name, values in times.items()}
    return {**{f"latency/beam{beam}_{name}@k{k}_ms": round(s * 1000, 1) for name, s in median.items()},
            f"latency/beam{beam}_rows_over_greedy": round(median["rows"] / median["greedy"], 2),
            f"latency/beam{beam}_rows_over_sequential": round(median["rows"] / median["sequential"], 2),
            f"latency/beam{beam}_answers_identical": int(same)}


def verify_latency(index, questions: list[str], k: int = 5) -> dict[str, float]:
    """Per-question ask latency (warm shards, as shipped) without and with the verifier, and the verifier's own
    pass (its `timings_ms["verify"]`), medians."""
    k = min(k, len(index))
    options = dict(k=k, min_confidence=0.0, min_retrieval_score=-1.0)
    times: dict[str, list[float]] = {"hidden": [], "verified": [], "verify": []}
    for question in questions:
        seconds, _ = _timed(lambda q=question: index.ask(q, verify=False, **options), 1)
        times["hidden"].append(seconds)
        seconds, answer = _timed(lambda q=question: index.ask(q, verify=True, **options), 1)
        times["verified"].append(seconds)
        if "verify" in answer.timings_ms:
            times["verify"].append(answer.timings_ms["verify"] / 1000)
    median = {name: float(np.median(values)) if values else float("nan") for name, values in times.items()}
    return {f"latency/hidden_ask@k{k}_ms": round(median["hidden"] * 1000, 1),
            f"latency/verified_ask@k{k}_ms": round(median["verified"] * 1000, 1),
            f"latency/verify@k{k}_ms": round(median["verify"] * 1000, 1),
            f"latency/verify_over_hidden_ask@k{k}": round(median["verify"] / median["hidden"], 3),
            f"latency/verified_over_hidden_ask@k{k}": round(median["verified"] / median["hidden"], 3)}


def reader_latency(index, questions: list[str], k: int = 5) -> dict[str, float]:
    """Per-question ask latency (warm shards) of a hidden ask and of a reader ask over the same passages, medians."""
    k = min(k, len(index))
    options = dict(k=k, min_confidence=0.0, min_retrieval_score=-1.0, verify=False)
    times: dict[str, list[float]] = {"hidden": [], "reader": []}
    index.ask(questions[0], mode="reader", **options)  # loads the reader once, outside the timings
    for question in questions:
        for mode in times:
            seconds, _ = _timed(lambda q=question, m=mode: index.ask(q, mode=m, **options), 1)
            times[mode].append(seconds)
    median = {name: float(np.median(values)) for name, values in times.items()}
    return {f"latency/reader_ask@k{k}_ms": round(median["reader"] * 1000, 1),
            f"latency/reader_over_hidden_ask@k{k}": round(median["reader"] / median["hidden"], 3)}


def warm_vs_cold(index, questions: list[str], k: int = 5, new_tokens: int = 8) -> dict[str, float]:
    """Questions per second when every shard must be loaded (cache cleared each time) vs already cached."""
    def run(clear: bool) -> float:
        start = time.perf_counter()
        for question in questions:
            if clear:
                index.cache.entries.clear()
                index.cache.bytes = 0
            index.ask(question, k=min(k, len(index)), max_new_tokens=new_tokens, min_confidence=0.0, start_beam=1,
                      verify=False)
        return len(questions) / (time.perf_counter() - start)

    cold = run(clear=True)
    warm = run(clear=False)
    return {"reuse/cold_qps": round(cold, 3), "reuse/warm_qps": round(warm, 3),
            "reuse/warm_over_cold_qps": round(warm / cold, 3)}


def batch_throughput(index, questions: list[str], k: int = 5, sizes=(1, 4, 16, 64), max_new_tokens: int = 32,
                     rounds: int = 3) -> dict[str, float]:
    """Questions per second of `Index.ask_many` at each batch size, warm key-shard cache, answers to their natural
    end (a batch waits for its longest answer), and whether every size gave the same answers as size 1.

    Each figure is the median of `rounds` rounds, the sizes alternating within a round, so a slow spell of a
    shared machine lands on every size rather than on one side of a ratio."""
    k = min(k, len(index))
    options = _greedy_asks(k, max_new_tokens)
    index.ask_many(questions, batch_size=max(sizes), **options)  # warm: every shard cached, every op traced
    figures, answers = {"batch/questions": len(questions), "batch/k": k, "batch/rounds": rounds}, {}
    seconds: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(rounds):
        for size in sizes:
            start = time.perf_counter()
            answers[size] = index.ask_many(questions, batch_size=size, **options)
            seconds[size].append(time.perf_counter() - start)
    for size in sizes:
        figures[f"batch/qps@{size}"] = round(len(questions) / float(np.median(seconds[size])), 3)
    if 1 in sizes and 16 in sizes:
        figures["batch/qps@16_over_qps@1"] = round(figures["batch/qps@16"] / figures["batch/qps@1"], 2)
    reference = _answered(answers[min(sizes)])
    figures["batch/answers_identical"] = int(all(_answered(got) == reference for got in answers.values()))
    # bf16 rounds differently at different batch shapes (oneDNN chooses kernels by shape, padding changes the
    # attention's blocks), so near-tied answers can move; `batch_identity` shows whether batching itself does
    figures["batch/answers_agreeing"] = min(sum(a == b for a, b in zip(_answered(got), reference, strict=True))
                                            for got in answers.values())
    return figures


def batch_identity(index, questions: list[str], k: int = 5, size: int = 16, max_new_tokens: int = 32
                   ) -> dict[str, int]:
    """Whether `size` questions per pass answer (and cite) exactly as one at a time, with `index`'s model as it
    is: in fp32, where no rounding depends on the batch's shape, any difference would be batching's own."""
    k = min(k, len(index))
    options = _greedy_asks(k, max_new_tokens)
    alone = _answered(index.ask_many(questions, batch_size=1, **options))
    together = _answered(index.ask_many(questions, batch_size=size, **options))
    dtype = str(next(index.model.parameters()).dtype).removeprefix("torch.")
    return {f"batch/answers_identical_{dtype}": int(alone == together),
            f"batch/answers_agreeing_{dtype}": sum(a == b for a, b in zip(alone, together, strict=True))}


def _greedy_asks(k: int, max_new_tokens: int) -> dict:
    """`Index.ask_many` options for the batch figures: greedy, every answer kept, every passage read."""
    return dict(k=k, max_new_tokens=max_new_tokens, min_confidence=0.0, min_retrieval_score=-1.0, start_beam=1,
                verify=False)


def _answered(answers) -> list[tuple[str, list[str]]]:
    return [(a.answer, [c.text for c in a.citations]) for a in answers]


def bench_questions(titles: list[str], count: int) -> list[str]:
    """`count` questions about the corpus's documents, four kinds per title, in a fixed order."""
    forms = ["What is said about {}?", "When did {} happen?", "Who is behind {}?", "Where is {}?"]
    asked = [form.format(title) for form in forms for title in titles]
    return (asked * (count // max(len(asked), 1) + 1))[:count]


def memory_figures(index) -> dict[str, float]:
    manifest = index.manifest
    kv = kv_cache_bytes_per_token(index.model.config.backbone_config)
    return {"memory/keys_bytes_per_token": manifest["bytes_per_token"], "memory/kv_bytes_per_token": kv,
            "memory/kv_over_keys": round(kv / manifest["bytes_per_token"], 1)}


def write_bench_report(out_dir: str | Path, figures: dict) -> list[Path]:
    """summary.json, report.md and latency_by_k.png (ask latency per mode against k, with the prompt sizes)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(figures, indent=2, sort_keys=True))
    ks = sorted(int(key.split("@k")[1]) for key in figures if key.startswith("latency/hidden_over_visible@k"))
    rows = "\n".join(f"| `{key}` | {value} |" for key, value in figures.items())
    (out_dir / "report.md").write_text(
        f"# cprag bench (one run)\n\n| figure | value |\n|---|---|\n{rows}\n\n![latency by k](latency_by_k.png)\n")
    if not ks:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for name, label in [("visible", "visible (passages in the prompt)"), ("hidden", "hidden (keys, drafted)"),
                        ("hidden_undrafted", "hidden, no drafting")]:
        values = [figures[f"latency/{name}@k{k}_ms"] for k in ks]
        ax.plot(ks, values, marker="o", label=label)
        if name == "visible":
            for k, value in zip(ks, values, strict=True):
                ax.annotate(f"{figures[f'latency/visible_prompt_tokens@k{k}']:.0f} prompt tokens", (k, value),
                            textcoords="offset points", xytext=(8, -3), fontsize=7)
    for k in ks:
        ratio = figures[f"latency/hidden_over_visible@k{k}"]
        ax.annotate(f"{ratio:.2f}×", (k, figures[f"latency/hidden@k{k}_ms"]), textcoords="offset points",
                    xytext=(4, -14), fontsize=8)
    passages = figures.get(f"latency/passage_tokens_mean@k{ks[-1]}")
    ax.set_xticks(ks)
    ax.set_xlim(ks[0] - 0.5, ks[-1] + 0.3 * (ks[-1] - ks[0] + 1))
    ax.set_xlabel("passages per question (k)" + (f", ~{passages:.0f} tokens each" if passages else ""))
    ax.set_ylabel("ask latency, 8 new tokens (ms)")
    ax.set_ylim(bottom=0)
    chip = figures.get("bench/processor", figures.get("bench/device", "cpu"))
    ax.set_title(f"hidden vs visible ask latency ({chip})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "latency_by_k.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]
