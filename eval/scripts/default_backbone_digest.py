"""The default checkpoint's keys and answers on the bench corpus, in fp32, as digests: two checkouts of cprag that
give the same digests read the default backbone bit for bit alike.

    python eval/scripts/default_backbone_digest.py --out eval/backbones/default-digest.json

It indexes `examples/long-corpus.jsonl` with the shipped checkpoint on the CPU in fp32, then answers the bench's
64 batch questions (`cprag.evaluation.bench.bench_questions`) one at a time. It prints the fingerprint, the sha256
of every stored row's token ids and keys, and the sha256 of the answers with their confidences (and the answers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="examples/long-corpus.jsonl")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--out", help="write the digests here as JSON")
    args = parser.parse_args(argv)

    import torch

    from cprag.api import Index
    from cprag.evaluation.bench import bench_questions
    from cprag.evaluation.bench_run import build_bench_index
    from cprag.index.corpus import read_corpus
    from cprag.index.store import PassageStore
    from cprag.model.checkpoint import load_model, model_fingerprint
    from cprag.model.runtime import place

    model, tokenizer = load_model()
    fingerprint = model_fingerprint(model)
    model = place(model, "cpu", torch.float32)
    documents = read_corpus(Path(args.corpus)).documents
    with tempfile.TemporaryDirectory() as scratch:
        index = build_bench_index(Path(args.corpus), Path(scratch) / "index", model, tokenizer, fingerprint)
        rows = PassageStore(index, 384).table.to_arrow().sort_by("passage_id").to_pylist()
        keys = hashlib.sha256()
        for row in rows:
            keys.update(row["passage_id"].encode())
            for column in ("token_ids", "keys"):  # stored as raw bytes (or lists, by store version)
                value = row[column]
                keys.update(value if isinstance(value, bytes) else np.asarray(value).tobytes())
        opened = Index(index, model=model, tokenizer=tokenizer, device="cpu", fingerprint=fingerprint)
        asked = bench_questions([d.title or d.id for d in documents], args.questions)
        answers = [opened.ask(question, verify=False) for question in asked]
    said = [[a.answer, a.confidence] for a in answers]
    figures = {
        "fingerprint": fingerprint, "rows": len(rows), "keys_sha256": keys.hexdigest(), "questions": len(asked),
        "answers_sha256": hashlib.sha256(json.dumps(said).encode()).hexdigest(), "answers": said,
    }
    text = json.dumps(figures, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(json.dumps({k: v for k, v in figures.items() if k != "answers"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
