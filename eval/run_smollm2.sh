#!/usr/bin/env bash
# Dense vs 50% topk SmolLM2-135M-Instruct, as reported in docs/evaluation.md.
# Prerequisite: python eval/prepare_smollm2.py GGUF /tmp/smol  (writes /tmp/smol/dense and /tmp/smol/topk50)
# Usage: bash eval/run_smollm2.sh [SMOL_DIR=/tmp/smol] [OUT=/tmp/ev] [DATA=../shared/data]
# The two models run side by side with one thread each (a 2-core machine); LIMIT="" scores the full sets.
set -euo pipefail
SMOL=${1:-/tmp/smol}
OUT=${2:-/tmp/ev}
DATA=${3:-$(cd "$(dirname "$0")/../.." && pwd)/shared/data}
LIMIT=${LIMIT-harness7=40,pile=20,wikitext103=3}
mkdir -p "$OUT"
for m in dense topk50; do
  OMP_NUM_THREADS=${THREADS:-1} /usr/bin/time -f "$m wall %e s" hf_sparsity eval "$SMOL/$m" \
    --suite pile,wikitext103,harness7 --data-dir "$DATA" ${LIMIT:+--limit "$LIMIT"} \
    --context 2048 --batch-size 4 --no-progress --out "$OUT/$m" > "$OUT/$m.log" 2>&1 &
done
wait
tail -n 3 "$OUT"/dense.log "$OUT"/topk50.log
hf_sparsity eval --compare "$OUT/dense" "$OUT/topk50" --labels dense topk50 --out "$OUT/compare"
