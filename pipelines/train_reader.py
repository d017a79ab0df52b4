r"""Train the span reader (`cprag.model.span_reader`) on the activation cache, then score it.

    python pipelines/train_reader.py ../shared/data/squad-v1.1-train.json --out runs/reader \
        --max-questions 32000 --max-steps 2000 --snapshot-questions 8000,16000 \
        --validation ../shared/data/squad-v1.1-dev-public.json --validation-questions 1000

    python pipelines/train_reader.py ../shared/data/squad-v1.1-train.json ../shared/data/nq-qed-train.json \
        ../shared/data/subjqa-train.json --from-reader cprag/checkpoints/default/reader --out runs/reader-mix

The lower blocks' states come from the CPLM training's activation cache of each file (the same folder `cprag train`
builds and reuses; `--no-build` trains on the chunks already there). Several files train together, each capped at
`--max-questions`; their unanswerable questions are read with their own passage and trained to answer null. The
adapters start from the CPLM checkpoint's on the same blocks (`--no-warm`: fresh); `--from-reader DIR` goes on from
a saved reader (the shipped one, say) instead; a reader with `--split-layer` below the saved one's, or a higher
`--adapter-rank`, grows out of it (the new blocks start as identity adapters, a lower rank is padded). The CPLM's
cache serves any split it holds states for (blocks 8, 16 and 18 for the shipped checkpoint). Resumes from
`OUT/state.pt` when rerun with the same arguments; progress goes to `OUT/progress.jsonl` (one JSON line per logged
step, with seconds per step and the ETA) and to stderr. The reader lands in `OUT/reader`; copy it to
`cprag/checkpoints/default/reader` to ship it. `--negatives FILE` (what `pipelines/squad_negatives.py` writes over
the first training file) adds unanswerable questions over that file's own paragraphs, read with their own passage
and trained to answer null: the negatives a SQuAD 2.0 question is, unlike a question asked with other paragraphs.
Only their prompts are cached (a cache of their own, built here: 822,800 tokens in 508 s for SQuAD train's 23,158
rewrites); their passages come from the first file's cache. A file that cannot be read is one line on stderr and
exit status 1.
`--cost-steps 20` runs 20 steps in a scratch folder and prints the measured cost of the whole run instead.
On a GPU the same command runs there (`--device cuda`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from cprag.cli.output import script_main

    return script_main(run, argv)


def run(argv: list[str] | None = None) -> int:
    from cprag.training.reader_train import ReaderTrainConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train", nargs="+", help="SQuAD-format training files (SQuAD 2.0's unanswerable questions "
                        "included: they are read with their own passage and trained to answer null)")
    parser.add_argument("--out", required=True, help="run folder (state, progress, the reader)")
    parser.add_argument("--checkpoint", default=None, help="CPLM checkpoint: the cache's model and the warm start "
                        "(default: the shipped one)")
    parser.add_argument("--no-warm", action="store_true", help="fresh adapters instead of the checkpoint's")
    parser.add_argument("--from-reader", default=None, help="go on from a saved reader's adapters, null and head "
                        "(e.g. cprag/checkpoints/default/reader) instead of the CPLM's adapters")
    parser.add_argument("--passage-attention", choices=["causal", "both"], default="causal",
                        help="'both': passage positions read the whole passage in the upper blocks")
    parser.add_argument("--split-layer", type=int, default=None, help="the block where question and passage join "
                        "(default 60%% of the depth: 18 of 30); the cache must hold its states (8, 16, 18)")
    parser.add_argument("--adapter-rank", type=int, default=None, help="the adapters' rank (default 16); "
                        "--from-reader pads a lower-rank reader to it")
    parser.add_argument("--negatives", default=None, help="SQuAD 2.0 file of unanswerable questions over the first "
                        "training file's paragraphs (pipelines/squad_negatives.py)")
    parser.add_argument("--no-build", action="store_true", help="train on the cache chunks already on disk")
    parser.add_argument("--snapshot-questions", default="", help="comma-separated question counts to snapshot at")
    parser.add_argument("--cost-steps", type=int, default=0, help="measure this many steps, print the run's cost")
    parser.add_argument("--validation", help="SQuAD file to score the reader on (gold + 4 distractors)")
    parser.add_argument("--validation-questions", type=int, default=1000)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None)
    for f in fields(ReaderTrainConfig):
        if f.type in ("int", "float", "str", "int | None"):
            kind = {"int": int, "float": float, "str": str, "int | None": int}[f.type]
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None)
    args = parser.parse_args(argv)

    import torch

    from cprag.model.cpu_features import fastest_dtype
    from cprag.model.runtime import default_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or default_device()
    values = {"dtype": fastest_dtype(device)}
    for f in fields(ReaderTrainConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    if args.snapshot_questions:
        values["snapshot_questions"] = [int(n) for n in args.snapshot_questions.split(",")]
    out = Path(args.out)
    reader_dir = out / "reader"
    if not (reader_dir / "reader.safetensors").is_file():
        reader, data, config = prepare(args, values, device)
        if args.cost_steps:
            return measure_cost(reader, data, config, args.cost_steps)
        from cprag.training.reader_train import train_reader

        def show(line: dict) -> None:
            print(json.dumps(line), file=sys.stderr, flush=True)

        figures = train_reader(reader, data, config, out, on_step=show)
        print(json.dumps(figures), file=sys.stderr)
    if args.validation:
        score(reader_dir, args.validation, args.validation_questions, device, out)
    return 0


def prepare(args, values: dict, device: str):
    """The activation cache (built or resumed unless --no-build), the reader (warm-started) and its data."""
    from cprag.evaluation.squad import read_squad
    from cprag.model.backbone import BaseReference
    from cprag.model.checkpoint import DEFAULT_CHECKPOINT, load_model
    from cprag.model.cpu_features import fastest_dtype
    from cprag.model.reader_checkpoint import continue_from, new_reader, warm_start
    from cprag.training.examples import (
        Examples,
        activation_cache,
        cached_negatives,
        prepare_examples,
        prepare_negatives,
    )
    from cprag.training.reader_train import ReaderData, ReaderTrainConfig

    config = ReaderTrainConfig(**values)
    started = time.perf_counter()
    model, tokenizer = load_model(args.checkpoint)
    shape = {k: v for k, v in (("split_layer", args.split_layer), ("adapter_rank", args.adapter_rank))
             if v is not None}
    reader, _ = new_reader(BaseReference.from_dict(model.config.base_model), seed=config.seed,  # the CPLM's backbone
                           passage_attention=args.passage_attention, **shape)
    split = reader.config.split_layer
    # the CPLM's own cache serves a reader split at any layer it holds (8, 16, 18 for the shipped one); a split
    # below its adapted blocks gets a cache of its own; above them the frozen states do not exist
    held = model.cached_layers()
    if split > max(held):
        from cprag.errors import ConfigError

        raise ConfigError("--split-layer", split, f"the checkpoint's blocks from {max(held)} are adapted, so a "
                          f"reader can join at {max(held)} or below (its cache holds {held})")
    cache_start = max(held) if split in held else split
    dtype = fastest_dtype(device)

    def progress(done: int, total: int, tokens: int) -> None:
        print(json.dumps({"cache": f"{done}/{total}", "tokens": tokens}), file=sys.stderr, flush=True)

    sources, texts = [], {}
    first_data = None  # the first file's questions and paragraphs: what --negatives rewrites
    for train in args.train:
        data = read_squad(train)
        first_data = first_data or data
        examples = prepare_examples(tokenizer, data)
        unanswerable = prepare_negatives(tokenizer, read_squad(train, unanswerable=True), data)
        examples = Examples(examples.passages, examples.questions + unanswerable.questions, examples.skipped)
        cache, figures = activation_cache(model, tokenizer, examples, Path(train), cache_start, dtype, config.seed,
                                          build=not args.no_build, on_progress=progress)
        print(json.dumps({"train": train, "questions": len(examples.questions), "unanswerable":
                          len(unanswerable.questions), "cache": str(cache.directory), **figures}), file=sys.stderr,
              flush=True)
        sources.append((examples, cache))
        texts = {pid: text for pid, (_, text) in data.passages.items()} | texts  # an earlier file's passage stays
    extra = []
    if args.negatives:  # over the first file's paragraphs: its cache serves their passages
        negatives, figures = cached_negatives(model, tokenizer, Path(args.negatives), first_data,
                                              sources[0][1], cache_start, dtype, config.seed, on_progress=progress)
        extra = negatives.questions
        print(json.dumps({"negatives": args.negatives, "questions": len(extra), "skipped": negatives.skipped,
                          **figures}), file=sys.stderr, flush=True)
    del model
    if args.from_reader:
        taken = continue_from(reader, args.from_reader)
        config.warm_from = f"the reader at {args.from_reader}"
        if taken["fresh"] or taken["rank"] != reader.config.adapter_rank:
            config.warm_from += (f" ({taken['adapters']} adapters of rank {taken['rank']} taken at rank "
                                 f"{reader.config.adapter_rank}, {len(taken['fresh'])} fresh)")
        print(f"going on from {config.warm_from}", file=sys.stderr)
    elif not args.no_warm:
        config.warm_from = str(args.checkpoint) if args.checkpoint else "the shipped CPLM checkpoint"
        taken = warm_start(reader, args.checkpoint or DEFAULT_CHECKPOINT)
        print(f"warm start: {taken} adapters from {config.warm_from}", file=sys.stderr)
    reader.to(device)
    prepared = ReaderData.build_many(sources, split, texts, config.max_questions)
    if extra:
        print(json.dumps({"negatives_trained": prepared.add_negatives(extra)}), file=sys.stderr, flush=True)
    print(f"{len(prepared.questions)} training questions in the cache, prepared in "
          f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    return reader, prepared, config


def measure_cost(reader, data, config, steps: int) -> int:
    """Run `steps` steps in a scratch folder; print seconds per step and the whole run's cost."""
    from cprag.training.reader_train import ReaderTrainConfig, train_reader

    scratch = Path(tempfile.mkdtemp(prefix="reader-cost-"))
    try:
        trial = ReaderTrainConfig(**{**asdict(config), "max_steps": steps, "log_every": steps,
                                     "save_every": 10 ** 9, "snapshot_questions": []})
        started = time.perf_counter()
        train_reader(reader, data, trial, scratch)
        per_step = (time.perf_counter() - started) / steps
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps({"cost_steps": steps, "seconds_per_step": round(per_step, 2), "planned_steps":
                      config.max_steps, "planned_hours": round(per_step * config.max_steps / 3600, 2)}))
    return 0


def score(reader_dir: Path, validation: str, questions: int, device: str, out: Path) -> dict:
    """The reader on `questions` seeded validation questions, gold + 4 distractors (as `cprag eval squad`)."""
    from cprag.evaluation.oracle_qa import evaluate_oracle, summarize
    from cprag.evaluation.squad import read_squad
    from cprag.evaluation.squad_eval import sample_examples
    from cprag.model.reader_checkpoint import load_reader
    from cprag.model.runtime import resolve_dtype

    reader, tokenizer = load_reader(reader_dir, device=device, dtype=resolve_dtype(device))
    data = read_squad(validation)
    examples = sample_examples(data, questions, seed=0)
    results = evaluate_oracle(None, tokenizer, examples, data.passages, ["reader"], reader=reader)
    summary = summarize(results)
    (out / "validation.json").write_text(json.dumps({"summary": summary, "results": [asdict(r) for r in results]},
                                                   indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
