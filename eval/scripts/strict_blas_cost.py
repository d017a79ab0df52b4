"""What cprag's reproducible BLAS setting (`MKL_CBWR=AUTO,STRICT`, set by `import cprag`) costs in encoding speed:
`cprag index` of one corpus, alternating runs with the setting and with oneMKL's default (`MKL_CBWR=` empty), in
each dtype asked, all in one run on one machine, so a slow minute falls on both arms.

    python eval/scripts/strict_blas_cost.py CORPUS --pairs 5 --dtypes float32,bfloat16 --out eval/reproducible

CORPUS: anything `cprag index` reads. Each run is a fresh process building into a fresh folder; the figure is the
build's own `encode_tokens_per_second`. Writes `blas_cost.json` in OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cprag.model.cpu_features import cpu_name

ARMS = {"strict": "AUTO,STRICT", "default": ""}


def encode_speed(corpus: Path, dtype: str, cbwr: str, workdir: Path) -> float:
    index = workdir / "index"
    shutil.rmtree(index, ignore_errors=True)
    env = dict(os.environ, MKL_CBWR=cbwr)
    done = subprocess.run([sys.executable, "-m", "cprag", "index", str(corpus), "--index", str(index), "--dtype", dtype,
                           "--json"], env=env, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout)["encode_tokens_per_second"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    report: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "pairs": args.pairs}
    with tempfile.TemporaryDirectory(prefix="cprag-blas-") as scratch:
        for dtype in args.dtypes.split(","):
            runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
            for pair in range(args.pairs):
                order = list(ARMS) if pair % 2 == 0 else list(reversed(ARMS))  # neither arm always goes first
                for arm in order:
                    runs[arm].append(encode_speed(args.corpus, dtype, ARMS[arm], Path(scratch)))
            medians = {arm: statistics.median(values) for arm, values in runs.items()}
            report[dtype] = {"tokens_per_second": runs, "median": {a: round(m, 1) for a, m in medians.items()},
                             "strict_over_default": round(medians["strict"] / medians["default"], 3)}
            print(json.dumps({dtype: report[dtype]["median"] | {"ratio": report[dtype]["strict_over_default"]}}),
                  file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "blas_cost.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
