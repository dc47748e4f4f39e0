#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md: compact vs masked correctness on CUDA, then decode speed and memory of a
# random-weight Llama with SmolLM2-135M's sizes (no weights need to travel to the GPU machine), random N(0, 1)
# scores with threshold 0.44 (~67% of the pairs leaving the window evicted), fp32 and bf16.
#   OUT=benchmarks/results/gpu benchmarks/run_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/gpu}
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi -L || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
"$PY" -m benchmarks.gpu_check --device cuda --json "$OUT/gpu_check.json"
"$PY" -m benchmarks.bench_decode --device cuda --prefill 2048 8192 32768 --decode 64 --runs 3 \
    --json "$OUT/decode_fp32.json"
"$PY" -m benchmarks.bench_decode --device cuda --dtype bfloat16 --prefill 8192 32768 --decode 64 --runs 3 \
    --modes none compact --json "$OUT/decode_bf16.json"
# KV memory from outside (storages reachable from the cache, live tensors at every layer's exit), no RSS runs.
"$PY" -m benchmarks.bench_memory --device cuda --prefill 8192 32768 --decode 64 --rss-runs 0 \
    --json "$OUT/memory.json"
"$PY" -m benchmarks.bench_decode --device cuda --prefill 32768 --threshold=-inf --decode 64 --runs 3 \
    --modes none compact --json "$OUT/decode_no_eviction.json"
