"""The split reader's start and end distributions over a hidden training run's questions, for distillation.

    python pipelines/reader_targets.py TRAIN --out targets.pt --steps 300 [--reader DIR] [--max-questions N]

Reads the questions a `cprag train TRAIN` run with the same --seed, --max-questions, --batch-size (and
--validation, which keeps every article for training) reaches in its first --steps steps, in that order, each with
its gold passage, from the run's activation cache (nothing is re-encoded unless --build: the questions the cache
does not hold yet are left out), and stores the reader's top-32 start and end positions with their probabilities
(cprag.training.distill). Resumable: the file is written every --save-every batches, and questions already in it
are not read again. Then train with `cprag train TRAIN --reader-targets targets.pt --distill-weight W`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from cprag.cli.output import script_main

    return script_main(run, argv)


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path, help="the SQuAD-format training file of the hidden run")
    parser.add_argument("--out", type=Path, required=True, help="the targets file (.pt) to write or go on with")
    parser.add_argument("--reader", type=Path, default=None, help="a split reader folder (default: the shipped one)")
    parser.add_argument("--validation", type=Path, default=None, help="as the run's --validation (the training "
                        "file's articles are then all training articles)")
    parser.add_argument("--steps", type=int, required=True, help="the run's steps whose questions are read")
    parser.add_argument("--batch-size", type=int, default=32, help="the run's questions per step")
    parser.add_argument("--max-questions", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--read-batch", type=int, default=16, help="questions the reader reads at once")
    parser.add_argument("--build", action="store_true", help="build (or resume) the run's activation cache first")
    parser.add_argument("--save-every", type=int, default=50, help="write the file every N read batches")
    args = parser.parse_args(argv)

    import random

    import torch

    from cprag.evaluation.squad import read_squad
    from cprag.model.reader_checkpoint import DEFAULT_READER, load_reader
    from cprag.model.runtime import resolve_dtype
    from cprag.training.config import TrainConfig
    from cprag.training.distill import ReaderTargets, describe, reader_targets, targets_fingerprint
    from cprag.training.examples import Examples
    from cprag.training.reader_train import ReaderData
    from cprag.training.recipe import prepare
    from cprag.training.train import _article_grouped_order

    started = time.perf_counter()
    done = ReaderTargets.load(args.out) if args.out.exists() else None  # refused before any work if not ours
    config = replace(TrainConfig(), seed=args.seed, max_questions=args.max_questions, batch_size=args.batch_size)
    prepared = prepare(args.data, config, validation_path=args.validation, build=args.build)
    questions = prepared.train.examples.questions
    order = _article_grouped_order(questions, random.Random(args.seed))  # the run's first epoch, as train_model
    chosen = [questions[i] for i in order[: args.steps * args.batch_size]]
    cache, passages = prepared.train.cache, prepared.train.examples.passages
    del prepared
    reader_dir = args.reader or DEFAULT_READER
    reader, tokenizer = load_reader(reader_dir, dtype=resolve_dtype("cpu"))
    texts = {pid: text for pid, (_, text) in read_squad(args.data).passages.items()}
    data = ReaderData.build(Examples(passages, chosen, {}), cache, reader.config.split_layer, texts)
    rank = {q.qid: i for i, q in enumerate(chosen)}  # read in the run's order: a stopped file covers its first steps
    data.questions.sort(key=lambda q: rank[q.qid])
    fingerprint = targets_fingerprint(reader_dir)
    if done is not None and done.meta.get("reader") != fingerprint:
        print(f"error: {args.out} was made by another reader; remove it or choose another --out", file=sys.stderr)
        return 1
    print(json.dumps({"questions": len(chosen), "already": len(done.start) if done else 0,
                      "cache": str(cache.directory)}), file=sys.stderr, flush=True)
    targets = done or ReaderTargets(meta={"reader": fingerprint, "data": args.data.name, "seed": args.seed,
                                          "steps": args.steps, "batch_size": args.batch_size,
                                          "max_questions": args.max_questions})
    tick = last = time.perf_counter()
    earlier = targets.meta.get("figures", {}).get("seconds", 0.0)  # a resumed file keeps counting its reading time
    batch = args.read_batch * args.save_every
    dtype = torch.bfloat16 if resolve_dtype("cpu") == torch.bfloat16 else torch.float32
    for first in range(0, len(data.questions), batch):
        reader_targets(reader, data, data.questions[first : first + batch], batch_size=args.read_batch,
                       dtype=dtype, done=targets)
        targets.meta["figures"] = describe(targets, time.perf_counter() - tick + earlier)
        targets.save(args.out)
        if time.perf_counter() - last > 30 or first + batch >= len(data.questions):
            print(json.dumps({"read": len(targets.start), "of": len(data.questions),
                              "seconds": round(time.perf_counter() - tick, 1)}), file=sys.stderr, flush=True)
            last = time.perf_counter()
    print(json.dumps({**targets.meta["figures"], "total_seconds": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
