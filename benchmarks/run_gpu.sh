#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md: compact vs masked correctness on CUDA, then decode speed and memory of a
# random-weight Llama with SmolLM2-135M's sizes (no weights need to travel to the GPU machine), random N(0, 1)
# scores with threshold 0.44 (~67% of the pairs leaving the window evicted), fp32 and bf16; the time to the first
# token of the chunked and dense prefills; and kvzap (with 8- and 4-bit storage) beside transformers' static and
# quantized caches (the quantized ones are recorded as errors where optimum-quanto or hqq is not installed).
#   OUT=benchmarks/results/gpu benchmarks/run_gpu.sh
# A dry run of every step at toy sizes, on any device (the test suite runs it on CPU, so that the first GPU run
# fails only on what needs a GPU):
#   DEVICE=cpu SMOKE=1 OUT=/tmp/gpu-dry benchmarks/run_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/gpu}
DEVICE=${DEVICE:-cuda}
export PYTHONPATH=. PYTHONUNBUFFERED=1
if [ "${SMOKE:-0}" = 1 ]; then
    FIRST=128 CHECK=256 SHORT=256 LONG=512 DECODE=4 RUNS=1
else
    FIRST=2048 CHECK=4096 SHORT=8192 LONG=32768 DECODE=64 RUNS=3
fi
mkdir -p "$OUT"
if [ "$DEVICE" = cuda ]; then nvidia-smi -L || true; fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
"$PY" -m benchmarks.gpu_check --device "$DEVICE" --prefill "$CHECK" --json "$OUT/gpu_check.json"
"$PY" -m benchmarks.bench_decode --device "$DEVICE" --prefill "$FIRST" "$SHORT" "$LONG" --decode "$DECODE" \
    --runs "$RUNS" --json "$OUT/decode_fp32.json"
"$PY" -m benchmarks.bench_decode --device "$DEVICE" --dtype bfloat16 --prefill "$SHORT" "$LONG" --decode "$DECODE" \
    --runs "$RUNS" --modes none compact --json "$OUT/decode_bf16.json"
# KV memory from outside (storages reachable from the cache, live tensors at every layer's exit), no RSS runs.
"$PY" -m benchmarks.bench_memory --device "$DEVICE" --prefill "$SHORT" "$LONG" --decode "$DECODE" --rss-runs 0 \
    --json "$OUT/memory.json"
"$PY" -m benchmarks.bench_decode --device "$DEVICE" --prefill "$LONG" --threshold=-inf --decode "$DECODE" \
    --runs "$RUNS" --modes none compact --json "$OUT/decode_no_eviction.json"
"$PY" -m benchmarks.bench_ttft --device "$DEVICE" --prefill "$SHORT" "$LONG" --modes none dense chunk:1024 chunk:2048 \
    --runs "$RUNS" --json "$OUT/ttft.json"
"$PY" -m benchmarks.bench_alternatives --device "$DEVICE" --prefill "$FIRST" "$SHORT" "$LONG" --decode "$DECODE" \
    --runs "$RUNS" --json "$OUT/alternatives_fp32.json"
"$PY" -m benchmarks.bench_alternatives --device "$DEVICE" --dtype bfloat16 --prefill "$SHORT" "$LONG" \
    --decode "$DECODE" --runs "$RUNS" --methods none static kvzap kvzap_kv8 --json "$OUT/alternatives_bf16.json"
