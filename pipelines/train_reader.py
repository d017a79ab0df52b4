"""Train the visible span reader (`cprag.model.span_reader`) on SQuAD-format data, then score it.

    python pipelines/train_reader.py ../shared/data/squad-v1.1-train.json --out runs/reader \
        --max-steps 2000 --validation ../shared/data/squad-v1.1-dev-public.json --validation-questions 1000

Resumes from `OUT/state.pt` when rerun with the same arguments; progress goes to `OUT/progress.jsonl` (one JSON
line per logged step, with tokens/s and the ETA) and to stderr. The reader lands in `OUT/reader`; copy it to
`cprag/checkpoints/default/reader` to ship it. On a GPU the same command runs there (`--device cuda`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from cprag.training.reader_train import ReaderTrainConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train", help="SQuAD-format training file")
    parser.add_argument("--out", required=True, help="run folder (state, progress, the reader)")
    parser.add_argument("--config", help="JSON of ReaderTrainConfig fields")
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

    from cprag.evaluation.squad import read_squad
    from cprag.model.reader_checkpoint import new_reader
    from cprag.model.runtime import default_device
    from cprag.training.reader_train import prepare_reader_data, train_reader

    if args.threads:
        torch.set_num_threads(args.threads)
    values = json.loads(Path(args.config).read_text()) if args.config else {}
    for f in fields(ReaderTrainConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    config = ReaderTrainConfig(**values)
    device = args.device or default_device()
    out = Path(args.out)
    reader_dir = out / "reader"
    if not (reader_dir / "reader.safetensors").is_file():
        reader, tokenizer = new_reader(seed=config.seed, **config.reader)
        reader.to(device)
        started = time.perf_counter()
        data = prepare_reader_data(tokenizer, read_squad(args.train))
        print(f"{len(data.examples)} training questions ({data.skipped} skipped), tokenized in "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr)

        def show(line: dict) -> None:
            print(json.dumps(line), file=sys.stderr, flush=True)

        figures = train_reader(reader, tokenizer, data, config, out, on_step=show)
        print(json.dumps(figures), file=sys.stderr)
    if args.validation:
        score(reader_dir, args.validation, args.validation_questions, device, out)
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
