"""A lever screen that goes on from a trained checkpoint: N more steps with one change, on the cache as it stands.

    python pipelines/continue_screen.py TRAIN --validation DEV --out runs/kl2 --steps 200 \\
        --reader-targets targets.pt --distill-weight 2

Starts from --checkpoint's head and adapters (default: the shipped one) and trains --steps steps of the seeded
article-grouped order over the training questions the activation cache already holds (nothing is encoded; the
validation file's cache is built if missing, it is small), at half the shipped peak learning rates by default.
Every arm of a screen reads the same batches, so a control arm (no change) makes the comparison. Writes
OUT/result.json (step cost, loss, teacher-forced metrics on --tf validation questions) and OUT/checkpoint: a copy
of --checkpoint's folder (reranker, passage prior, verifier; not its span reader) with the new tensors, which
`cprag eval squad --checkpoint OUT/checkpoint` decodes with the default decoding. Resumable from OUT/state.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from cprag.cli.output import script_main

    return script_main(run, argv)


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--validation", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, default=None, help="the run to go on from (default: shipped)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--adapter-lr", type=float, default=2.5e-4)
    parser.add_argument("--reader-targets", default=None)
    parser.add_argument("--distill-weight", type=float, default=0.0)
    parser.add_argument("--document-attention", choices=("causal", "both"), default="causal")
    parser.add_argument("--tf", type=int, default=2000, help="validation questions scored teacher-forced")
    args = parser.parse_args(argv)

    from cprag.evaluation.squad import read_squad
    from cprag.model.backbone import BaseReference
    from cprag.model.checkpoint import DEFAULT_CHECKPOINT, load_model
    from cprag.training.config import TrainConfig
    from cprag.training.examples import activation_cache, prepare_examples
    from cprag.training.recipe import prepare
    from cprag.training.train import teacher_forced_validation, train_model

    source = args.checkpoint or DEFAULT_CHECKPOINT
    trained = json.loads((source / "train_config.json").read_text())["train"]
    config = replace(TrainConfig(), init_from=str(source), max_steps=args.steps, lr=args.lr,
                     adapter_lr=args.adapter_lr, cache_layer=trained["cache_layer"], seed=trained["seed"],
                     reader_targets=args.reader_targets, distill_weight=args.distill_weight, save_every=25,
                     head={**trained["head"], "document_attention": args.document_attention})
    started = time.perf_counter()
    model, tokenizer = load_model(source)  # the validation file's cache (blocks below the adapted ones), built once
    examples = prepare_examples(tokenizer, read_squad(args.validation))
    activation_cache(model, tokenizer, examples, args.validation, config.cache_layer, config.cache_dtype, config.seed)
    base = BaseReference.from_dict(model.config.base_model)  # the backbone the checkpoint was trained on
    del model
    ready = prepare(args.data, config, base, validation_path=args.validation, build=False)
    args.out.mkdir(parents=True, exist_ok=True)
    progress = open(args.out / "progress.jsonl", "a")
    tick = time.perf_counter()

    def on_progress(step: int, total: int, loss: float) -> None:
        progress.write(json.dumps({"step": step, "total": total, "loss": round(loss, 4),
                                   "seconds": round(time.perf_counter() - tick, 1)}) + "\n")
        progress.flush()

    report = train_model(ready.model, ready.tokenizer, ready.train, ready.config, args.out / "state", on_progress)
    metrics = teacher_forced_validation(ready.model, ready.tokenizer, ready.validation, ready.config, args.tf,
                                        ready.config.seed)
    folder = args.out / "checkpoint"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("reader"))
    with tempfile.TemporaryDirectory() as staging:
        ready.model.save_pretrained(staging)
        shutil.copy(Path(staging) / "model.safetensors", folder / "model.safetensors")
    stored = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**stored, "document_attention": args.document_attention},
                                                   indent=2))
    losses = report.losses
    result = {"steps": report.steps, "train_questions": len(ready.train.examples.questions),
              "seconds_per_step": round(report.seconds / max(1, report.steps - report.resumed_from), 2),
              "loss_first_50": round(sum(losses[:50]) / len(losses[:50]), 4),
              "loss_last_50": round(sum(losses[-50:]) / len(losses[-50:]), 4), **metrics,
              "total_seconds": round(time.perf_counter() - started, 1),
              "settings": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
