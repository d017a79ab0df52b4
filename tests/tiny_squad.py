"""A tiny SQuAD file and the smoke training settings that train on it."""

import json
from dataclasses import replace

from cprag.training.config import TrainConfig

FACTS = [
    ("Lighthouse", "The lighthouse was built in 1871.", "When was the lighthouse built?", "1871"),
    ("Lighthouse", "Its keeper was Margit.", "Who was the keeper?", "Margit"),
    ("Bridge", "The bridge opened in 2009.", "When did the bridge open?", "2009"),
    ("Bridge", "It crosses the Ravel gorge.", "What does it cross?", "the Ravel gorge"),
    ("Clock", "The clock rings every hour.", "How often does it ring?", "every hour"),
    ("Clock", "A monk named Anselm built it.", "Who built the clock?", "Anselm"),
    ("Geese", "Geese arrive in October.", "When do geese arrive?", "October"),
    ("Geese", "They roost on the lake.", "Where do they roost?", "on the lake"),
]


def tiny_squad(path, missing_answer=True, unanswerable=False):
    articles = {}
    for title, context, question, answer in FACTS:
        paragraphs = articles.setdefault(title, [])
        qas = [{"id": f"{title}{len(paragraphs)}", "question": question,
                "answers": [{"text": answer, "answer_start": context.index(answer)}]}]
        paragraphs.append({"context": context, "qas": qas})
    if missing_answer:  # an answer that is not where it claims to be: skipped and counted
        articles["Geese"][0]["qas"].append({"id": "bad", "question": "?", "answers": [{"text": "zebra",
                                                                                       "answer_start": 3}]})
    if unanswerable:  # SQuAD 2.0 style: no answer in the paragraph
        for title, paragraphs in articles.items():
            paragraphs[0]["qas"].append({"id": f"{title}-none", "question": "Who painted the ceiling?",
                                         "answers": [], "is_impossible": True})
    path.write_text(json.dumps({"data": [{"title": t, "paragraphs": p} for t, p in articles.items()]}))
    return path


HEAD = {"key_dim": 8, "doc_refine_layers": 1, "doc_refine_dim": 16, "end_entries": True, "successor_bias": True,
        "cp_layers": [1], "adapter_layers": [1], "adapter_rank": 4}
SMOKE = TrainConfig(epochs=2, batch_size=4, distractors=2, lr=5e-3, adapter_lr=5e-3, validation_fraction=0.25,
                    save_every=2, cache_layer=1, dtype="float32", cache_dtype="float32", no_answer_fraction=0.25,
                    head=HEAD)


def smoke(**changes) -> TrainConfig:
    return replace(SMOKE, **changes)
