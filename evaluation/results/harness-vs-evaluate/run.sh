#!/usr/bin/env bash
# Harness vs `kvzap evaluate` on the same 40 needle samples of the default model (5 tasks x 8 samples, 1,024
# tokens), KVzap-MLP at threshold -3: writes both runs under $OUT and compare.py's table to compare.txt.
set -euo pipefail
OUT=${OUT:-$(dirname "$0")/run}
TASKS="niah_single niah_multikey niah_multivalue niah_multiquery vt"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1
kvzap harness data --dataset ruler_offline --tasks $TASKS --length 1024 --n-samples 8 --out "$OUT/data"
kvzap evaluate --dataset ruler_offline --tasks $TASKS --lengths 1024 --n-samples 8 \
  --press kvzap_mlp --threshold -3 --output-dir "$OUT/evaluate"
kvzap harness --model_args press=kvzap_mlp,threshold=-3 --device cpu \
  --tasks "$(printf 'kvzap_ruler_offline_%s,' $TASKS | sed 's/,$//')" \
  --metadata "{\"data_dir\": \"$OUT/data\"}" --log_samples --output_path "$OUT/harness"
python "$(dirname "$0")/compare.py" "$OUT" | tee "$(dirname "$0")/compare.txt"
