#!/usr/bin/env bash
# Dense vs 50% topk SmolLM2-135M-Instruct, as reported in docs/evaluation.md.
# Prerequisite: python eval/prepare_smollm2.py GGUF SMOL_DIR  (writes SMOL_DIR/dense and SMOL_DIR/topk50)
# Usage: bash eval/run_smollm2.sh SMOL_DIR OUT_DIR DATA_DIR
#   OUT_DIR: where the results go; DATA_DIR: the local data folder (docs/evaluation.md, "Data folder")
# The two models run side by side with one thread each (a 2-core machine); LIMIT="" scores the full sets.
set -euo pipefail
if [ "$#" -ne 3 ]; then
  echo "usage: bash eval/run_smollm2.sh SMOL_DIR OUT_DIR DATA_DIR" >&2
  exit 2
fi
SMOL=$1
OUT=$2
DATA=$3
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
