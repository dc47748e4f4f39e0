#!/usr/bin/env bash
# Every figure of BENCHMARKS.md in one run: kvzap (this environment) and kvpress 0.5.5 (its own environment,
# transformers 5.2.x) on the same model, text, threshold and surrogate, then the tables (benchmarks/report.py).
#   KVPRESS_PYTHON=/path/to/kvpress-venv/bin/python benchmarks/run_all.sh [MODEL_DIR] [THRESHOLD]
# PART=timing runs the speed figures only (they need a quiet machine), PART=memory the memory figures only (they do
# not depend on the machine's load); the default runs both, then writes the report.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-$HOME/.cache/kvzap/models/SmolLM2-135M-Instruct}
TAU=${2:--3.4}  # about 67% evicted (3x compression) with the bundled KVzap-MLP surrogate: `kvzap calibrate`
PY=${PYTHON:-python}
KVP=${KVPRESS_PYTHON:?set KVPRESS_PYTHON to the python of a virtual environment with kvpress==0.5.5}
OUT=${OUT:-benchmarks/results}
THREADS=${THREADS:-2}
RUNS=${RUNS:-5}  # runs per kvzap mode (medians): this VM's run-to-run noise is a few percent
KVPRESS_RUNS=${KVPRESS_RUNS:-3}
BATCH_RUNS=${BATCH_RUNS:-3}  # runs of the ragged-batch benchmark (each about 5 minutes on 2 cores)
PART=${PART:-all}
export PYTHONPATH=.
mkdir -p "$OUT"
common=(--model "$MODEL" --threads "$THREADS")

if [ "$PART" != memory ]; then  # speed: decoding, prefill, scorers, the collection
"$PY" -m benchmarks.bench_decode "${common[@]}" --prefill 2048 4096 8192 --threshold="$TAU" --decode 64 --runs "$RUNS" \
    --modes none compact --json "$OUT/decode.json"
"$PY" -m benchmarks.bench_decode "${common[@]}" --prefill 2048 8192 --threshold=-inf --decode 64 --runs "$RUNS" \
    --modes none compact --json "$OUT/decode_no_eviction.json"
# The fixed cost of a decoding step: a context where reading the cache costs next to nothing.
"$PY" -m benchmarks.bench_decode "${common[@]}" --prefill 256 --threshold="$TAU" --decode 64 --runs "$RUNS" \
    --modes none compact --json "$OUT/decode_fixed_cost.json"
"$PY" -m benchmarks.bench_decode "${common[@]}" --prefill 256 --threshold="$TAU" --decode 64 --runs "$RUNS" \
    --modes none compact --no-decoding --json "$OUT/decode_fixed_cost_prompt_only.json"
"$KVP" -m benchmarks.bench_kvpress "${common[@]}" --prefill 2048 4096 8192 --threshold="$TAU" --decode 64 --runs "$KVPRESS_RUNS" \
    --json "$OUT/decode_kvpress.json"
# Ragged batch: 8 prompts of 1k-4k tokens, 64 decoded tokens each, one at a time vs batched (no press, kvzap)
"$PY" -m benchmarks.bench_batch "${common[@]}" --threshold="$TAU" --decode 64 --runs "$BATCH_RUNS" \
    --json "$OUT/batch.json"
# Time to the first answer token through the pipeline: no press, one dense forward (the default), chunked prefills
"$PY" -m benchmarks.bench_ttft "${common[@]}" --prefill 4096 8192 --threshold=-3 \
    --modes none dense chunk:2048 chunk:1024 --runs "$RUNS" --breakdown --json "$OUT/ttft.json"
# Side by side: the static and quantized caches of transformers, kvzap, kvzap with 8- and 4-bit storage
"$PY" -m benchmarks.bench_alternatives "${common[@]}" --prefill 2048 4096 8192 --threshold="$TAU" --decode 32 \
    --runs "$KVPRESS_RUNS" --json "$OUT/alternatives.json"
"$PY" -m benchmarks.bench_scorers --model "$MODEL" --threads "$THREADS" --json "$OUT/scorers.json"
if [ -z "${SKIP_COLLECT:-}" ]; then  # the KVzip+ collection cost (training); SKIP_COLLECT=1 keeps the last figures
    "$PY" -m benchmarks.bench_collect --threads "$THREADS" --runs 3 --json "$OUT/collect.json"
fi
fi
if [ "$PART" != timing ]; then  # memory, measured from outside
# KV memory from outside (held by the cache, prefill peak at every layer's exit) and peak RSS of 8k prefill + 256
# decoded tokens, median of 5 fresh processes per mode (no press and kvzap compact).
"$PY" -m benchmarks.bench_memory "${common[@]}" --prefill 2048 8192 --threshold="$TAU" --decode 64 --rss-runs 5 \
    --rss-variants none compact --rss-mmap-runs 0 --json "$OUT/memory.json"
# (The ways of giving freed memory back, and kvpress's peak RSS: research/heap-release/README.md.)
fi
"$PY" -m benchmarks.report "$OUT"  # then: python -m benchmarks.report --update BENCHMARKS.md
