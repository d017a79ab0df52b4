"""`cprag eval needle`: a 7-digit magic number hidden in neutral filler at chosen depths and total lengths.

Hidden mode keeps the whole haystack as CP keys, encoded passage by passage as `cprag index` would (identical
filler passages are encoded once and shared); visible mode puts the haystack in the prompt, truncated to the
backbone's window as a RAG pipeline would, so beyond the window it can only fail.

With `passage_prior` > 0, hidden mode decodes as `cprag ask` does by default: the retriever's cosine of the
question to each haystack passage is weighed into the copy scores of that passage's entries
(`cprag.decoding.passage_prior`).
At a million tokens the filler's thousands of weakly matching entries otherwise add up, token by token, to more
copy mass than the needle's few.

`start_beam` > 1 decodes from that many first tokens and answers with the one `reranker` picks, as `cprag ask`
does by default (the shipped reranker's beam): greedy alone copies "The magic" for some numbers when the needle
sentence opens its passage, an answer that repeats the question and that the reranker passes over.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cprag.decoding.prompt import prompt_ids
from cprag.decoding.route import decode_questions
from cprag.index.encode import PassageKeys, TokenizedPassage, encode_passages
from cprag.index.key_cache import KEY_CACHE_DTYPE, DevicePassage
from cprag.index.store import StoredPassage

FILLER = [
    "The grass on the hill was green and the wind moved slowly across it.",
    "A small boat drifted along the river while the sun went down behind the trees.",
    "Children walked home from school, talking about the games they had played.",
    "The baker opened the shop early and the smell of fresh bread filled the street.",
    "Clouds gathered over the valley, but the rain did not come that evening.",
    "An old dog slept in the shade of the porch, lifting its head now and then.",
    "The library was quiet, and only the turning of pages could be heard.",
    "Farmers brought their vegetables to the market in wooden carts.",
    "A gentle breeze carried the sound of bells from the village church.",
    "The path through the forest was covered with fallen leaves of many colours.",
]
NEEDLE = "The magic number is {number}."
QUESTION = "What is the magic number?"


@dataclass
class Haystack:
    blocks: list[list[int]]  # token ids per passage; all but the needle block are filler
    needle_block: int
    needle_token: int  # absolute token position where the needle sentence starts
    needle_tokens: int
    number: str

    @property
    def length(self) -> int:
        return sum(len(b) for b in self.blocks)

    @property
    def depth(self) -> float:
        """The fraction of the filler that comes before the needle."""
        return self.needle_token / max(self.length - self.needle_tokens, 1)


def filler_block(tokenizer, block_tokens: int) -> list[int]:
    """One passage of filler, exactly `block_tokens` tokens, cut from the cycled sentences."""
    text, ids = "", []
    while len(ids) < block_tokens:
        text += " ".join(FILLER) + " "
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:block_tokens]


def build_haystack(tokenizer, length: int, depth: float, number: str, block_tokens: int = 512) -> Haystack:
    """A haystack of `length` tokens (within a sentence) with the needle sentence starting near `depth`."""
    block = filler_block(tokenizer, block_tokens)
    needle = tokenizer(" " + NEEDLE.format(number=number) + " ", add_special_tokens=False)["input_ids"]
    filler_total = max(length - len(needle), 1)
    target = int(round(depth * filler_total))  # filler tokens before the needle
    sentence_starts = _sentence_starts(tokenizer, block)
    # cut the filler stream at the nearest sentence start, so the needle reads as a sentence, unless that
    # would move it by more than 1% of the haystack (short haystacks): then exactly at the target token
    cycle_offset = target % block_tokens
    nearest = min(sentence_starts + [block_tokens], key=lambda s: abs(s - cycle_offset))
    if abs(nearest - cycle_offset) <= 0.01 * length:
        target = max(0, min(filler_total, target - cycle_offset + nearest))
    stream_before, stream_after = target, filler_total - target
    blocks, needle_block = [], None
    blocks.extend(_chunks(block, stream_before, block_tokens))
    head = blocks.pop() if blocks and len(blocks[-1]) < block_tokens else []
    tail_first = block[len(head) % block_tokens :] if head else []
    tail_first = tail_first[:stream_after]
    needle_block = len(blocks)
    blocks.append(head + needle + tail_first)
    remaining = stream_after - len(tail_first)
    blocks.extend(_chunks(block, remaining, block_tokens))
    needle_token = sum(len(b) for b in blocks[:needle_block]) + len(head)
    return Haystack(blocks=blocks, needle_block=needle_block, needle_token=needle_token, needle_tokens=len(needle),
                    number=number)


def _chunks(block: list[int], count: int, size: int) -> list[list[int]]:
    full, rest = divmod(count, size)
    return [list(block) for _ in range(full)] + ([block[:rest]] if rest else [])


def _sentence_starts(tokenizer, block: list[int]) -> list[int]:
    starts = [0]
    for i in range(1, len(block)):
        if tokenizer.decode(block[i - 1 : i]).strip().endswith("."):
            starts.append(i)
    return starts


class HaystackKeys:
    """Encodes each distinct passage once (filler passages repeat) and assembles a haystack's memory."""

    def __init__(self, model, tokenizer, embedder=None):
        self.model, self.tokenizer, self.embedder = model, tokenizer, embedder
        self.cache: dict[tuple[int, ...], DevicePassage] = {}
        self.similarity: dict[tuple[int, ...], float] = {}  # cosine of QUESTION to each distinct passage
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, KEY_CACHE_DTYPE

    def passages(self, haystack: Haystack) -> list[DevicePassage]:
        missing = list(dict.fromkeys(tuple(b) for b in haystack.blocks if tuple(b) not in self.cache))
        if missing:
            tokenized = [TokenizedPassage(ids=list(b), offsets=[(0, 0)] * len(b)) for b in missing]
            for index, keys in encode_passages(self.model, tokenized, bos_id=self.tokenizer.bos_token_id):
                self.cache[missing[index]] = self._device(missing[index], keys)
        return [self.cache[tuple(b)] for b in haystack.blocks]

    def scores(self, haystack: Haystack) -> list[float]:
        """The retriever's cosine of QUESTION to each passage (each distinct one embedded once), as an index of
        the haystack would score them; needs the embedder."""
        missing = list(dict.fromkeys(tuple(b) for b in haystack.blocks if tuple(b) not in self.similarity))
        if missing:
            vectors = self.embedder.embed([QUESTION] + [self.tokenizer.decode(list(b)) for b in missing])
            for block, vector in zip(missing, vectors[1:], strict=True):
                self.similarity[block] = float(vector @ vectors[0])
        return [self.similarity[tuple(b)] for b in haystack.blocks]

    def _device(self, block: tuple[int, ...], keys: PassageKeys) -> DevicePassage:
        stored = StoredPassage(passage_id=str(hash(block)), doc_id="haystack", title="haystack",
                               text=self.tokenizer.decode(list(block)), char_start=0, keys=keys)
        return DevicePassage.from_stored(stored, self.device, self.dtype)


def visible_passage(tokenizer, haystack: Haystack, window: int, reserve: int, end_id: int) -> list[DevicePassage]:
    """The haystack as one prompt passage of token ids (pasting `end_id` last, as stored passages do), truncated
    from the end so the prompt fits the window. It has no keys: visible mode keys it from the prompt."""
    budget = window - reserve - len(prompt_ids(tokenizer, QUESTION, ["x"]))
    ids = [t for block in haystack.blocks for t in block][: max(budget, 0)]
    stored = StoredPassage(passage_id="haystack", doc_id="haystack", title="haystack", text=tokenizer.decode(ids),
                           char_start=0, keys=PassageKeys(np.zeros((0, 1)), np.zeros(0), np.zeros((0, 2))))
    return [DevicePassage(passage=stored, keys=torch.zeros(0, 1), ids=torch.tensor(ids + [end_id]))]


def run_needle(model, tokenizer, lengths: list[int], depths: list[float], trials: int, modes: list[str],
               seed: int = 0, visible_trials: int = 1, passage_prior: float = 0.0, embedder=None,
               start_beam: int = 1, reranker=None,
               on_result: Callable[[dict], None] | None = None) -> tuple[dict, list[dict]]:
    """Accuracy per (length, depth) and one record per answer. `passage_prior` > 0 (hidden mode) needs `embedder`
    (the index's retriever, `cprag.index.retrieve.MiniLMEmbedder`)."""
    if passage_prior > 0 and embedder is None:
        raise ValueError("a passage prior needs the retriever's embedder")
    rng = random.Random(seed)
    keys = HaystackKeys(model, tokenizer, embedder)
    window = model.config.max_position_embeddings
    results = []
    for length in lengths:
        for depth in depths:
            for trial in range(trials):
                number = str(rng.randrange(1_000_000, 10_000_000))
                haystack = build_haystack(tokenizer, length, depth, number)
                for mode in modes:
                    if mode == "visible" and trial >= visible_trials:
                        continue
                    tick = time.perf_counter()
                    scores = None
                    if mode == "hidden":
                        passages = keys.passages(haystack)
                        scores = keys.scores(haystack) if passage_prior > 0 else None
                    else:
                        passages = visible_passage(tokenizer, haystack, window, reserve=16, end_id=model.config.end_id)
                    answer = decode_questions(model, tokenizer, [QUESTION], [passages], mode, 12,
                                              start_beam=start_beam, passage_scores=[scores],
                                              passage_prior=passage_prior, reranker=reranker)[0][0].answer
                    result = {"mode": mode, "length": length, "depth": depth, "trial": trial, "number": number,
                              "answer": answer, "correct": number in answer.replace(",", "").split()
                              or answer.strip(" .") == number, "tokens": haystack.length,
                              "actual_depth": round(haystack.depth, 4),
                              "passage_prior": passage_prior if mode == "hidden" else 0.0, "start_beam": start_beam,
                              "seconds": time.perf_counter() - tick}
                    results.append(result)
                    if on_result:
                        on_result(result)
    return summarize_needle(results), results


def summarize_needle(results: list[dict]) -> dict:
    summary = {}
    for mode in sorted({r["mode"] for r in results}):
        chosen = [r for r in results if r["mode"] == mode]
        cells = {}
        for r in chosen:
            cells.setdefault((r["length"], r["depth"]), []).append(r["correct"])
        for (length, depth), values in sorted(cells.items()):
            summary[f"needle/{mode}/acc@{length}/{depth}"] = round(float(np.mean(values)), 3)
        summary[f"needle/{mode}/acc_min"] = round(min(float(np.mean(v)) for v in cells.values()), 3)
        summary[f"needle/{mode}/acc_mean"] = round(float(np.mean([r["correct"] for r in chosen])), 3)
        summary[f"needle/{mode}/start_beam"] = chosen[0].get("start_beam", 1)
        if mode == "hidden":
            summary["needle/hidden/passage_prior"] = chosen[0].get("passage_prior", 0.0)
    return summary


def write_needle_report(out_dir, summary: dict, results: list[dict], window: int) -> None:
    """results.jsonl, summary.json, report.md and a heatmap PNG per mode (accuracy by length and depth)."""
    import json
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.jsonl", "w") as handle:
        for r in results:
            handle.write(json.dumps(r) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    modes = sorted({r["mode"] for r in results})
    lengths = sorted({r["length"] for r in results})
    depths = sorted({r["depth"] for r in results})
    fig, axes = plt.subplots(1, len(modes), figsize=(5.2 * len(modes), 3.8), dpi=120, squeeze=False)
    beyond = [j for j, n in enumerate(lengths) if n > window]
    lines = [f"# Needle test (backbone window {window} tokens)", ""]
    if "needle/hidden/passage_prior" in summary:
        lines += [f"Hidden mode with passage prior {summary['needle/hidden/passage_prior']:g} (0: off); start beam "
                  f"{summary.get('needle/hidden/start_beam', 1)} (1: greedy).", ""]
    for ax, mode in zip(axes[0], modes, strict=True):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, depth in enumerate(depths):
            for j, length in enumerate(lengths):
                values = [r["correct"] for r in results if r["mode"] == mode and r["length"] == length
                          and r["depth"] == depth]
                if values:
                    grid[i, j] = np.mean(values)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [f"{n // 1000}k" if n >= 1000 else str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
        ax.set_xlabel("haystack tokens")
        if ax is axes[0][0]:
            ax.set_ylabel("needle depth")
        if beyond:  # to the right of this line the haystack no longer fits the backbone's window
            ax.axvline(beyond[0] - 0.5, color="black", linestyle="--", linewidth=1)
            ax.text(beyond[0] - 0.45, -0.45, f"beyond the {window // 1000}k window", fontsize=7, va="top")
        ax.set_title(f"{mode}: accuracy (min {summary[f'needle/{mode}/acc_min']:.2f})", fontsize=10)
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
        lines += [f"## {mode}", "", "| depth \\\\ tokens | " + " | ".join(map(str, lengths)) + " |",
                  "|---" * (len(lengths) + 1) + "|"]
        lines += [f"| {d:.2f} | " + " | ".join("-" if np.isnan(v) else f"{v:.2f}" for v in grid[i]) + " |"
                  for i, d in enumerate(depths)]
        lines.append("")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(out_dir / "needle_heatmap.png", bbox_inches="tight")
    plt.close(fig)
    (out_dir / "report.md").write_text("\n".join(lines) + "\n![heatmap](needle_heatmap.png)\n")
