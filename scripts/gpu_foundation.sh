#!/usr/bin/env bash
# One-shot GPU check for the foundation: fallback vs reference on CUDA, and the fallback benchmark.
# Run on the GPU machine from the repo root; writes logs and JSON under $OUT (default ./bench_out).
set -uo pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" | tee -a "$OUT/gpu.txt"
python3 -m pytest -m gpu tests/test_fallback.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu_fallback.log"
python3 -m dsv4_attn.bench fallback --json "$OUT/bench_fallback.json" 2>&1 | tee "$OUT/bench_fallback.log"
