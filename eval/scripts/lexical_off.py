"""A copy of a checkpoint with its lexical features switched off at query time, for `cprag eval squad`.

The CP head weighs each entry's query-time lexical features (`cprag.model.lexical`: overlap windows, sentence
overlap, answer-type indicators) by learned scalars, `cp_head.lexical` for starts and `cp_head.lexical_end` for
ends. Zeroing both leaves every other weight as trained, so the copy scores come from the keys alone. The start
reranker and passage prior are copied unchanged (the reranker still reads its own span features).

    python eval/scripts/lexical_off.py --out runs/lexical-off
    cprag eval squad eval/ood/real-docs.json --oracle --modes hidden --batch-size 8 \
        --checkpoint runs/lexical-off --out eval/runs/ood-lexical-off
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from cprag.model.checkpoint import DEFAULT_CHECKPOINT

SCALARS = ("cp_head.lexical", "cp_head.lexical_end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.copytree(args.checkpoint, args.out)
    weights = load_file(args.out / "model.safetensors")
    missing = [name for name in SCALARS if name not in weights]
    if missing:
        raise SystemExit(f"{args.checkpoint} has no {', '.join(missing)}: its head reads no lexical features")
    for name in SCALARS:
        weights[name] = weights[name] * 0
    save_file(weights, args.out / "model.safetensors", metadata={"format": "pt"})
    print(f"wrote {args.out} with {', '.join(SCALARS)} zeroed")


if __name__ == "__main__":
    main()
