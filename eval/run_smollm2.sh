#!/usr/bin/env bash
# Dense vs 50% topk SmolLM2-135M-Instruct, as reported in docs/evaluation.md.
# Prerequisite: python eval/prepare_smollm2.py GGUF /tmp/smol  (writes /tmp/smol/dense and /tmp/smol/topk50)
# Usage: bash eval/run_smollm2.sh [SMOL_DIR=/tmp/smol] [OUT=/tmp/ev] [DATA=../shared/data]
set -euo pipefail
SMOL=${1:-/tmp/smol}
OUT=${2:-/tmp/ev}
DATA=${3:-$(cd "$(dirname "$0")/../.." && pwd)/shared/data}
LIMIT=${LIMIT:-harness7=100,pile=40,wikitext103=8}
for m in dense topk50; do
  /usr/bin/time -f "$m wall %e s" hf_sparsity eval "$SMOL/$m" --suite pile,wikitext103,harness7 \
    --data-dir "$DATA" --limit "$LIMIT" --context 2048 --batch-size 4 --no-progress --out "$OUT/$m"
done
hf_sparsity eval --compare "$OUT/dense" "$OUT/topk50" --labels dense topk50 --out "$OUT/compare"
