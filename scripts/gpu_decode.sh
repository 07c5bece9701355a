#!/usr/bin/env bash
# One-shot GPU check of the sparse-decode kernel on a Hopper machine, from the repo root:
#   1. the GPU tests of tests/test_sparse_decode.py (kernel vs the float64 reference, both
#      launches: by capacity and the balanced schedule) and of the balanced plan's Triton program
#      (tests/test_fused.py::test_decode_schedule_cuda);
#   2. the decode benchmark (python -m dsv4_attn.bench decode), table + JSON; against FlashMLA
#      (--against flashmla) when flash_mla is importable, as CUDA-graph replays with GRAPHS=1;
#   3. with SPLITS=1 the split-count sweep (python -m dsv4_attn.bench decode-splits);
#   4. with PROFILE=1 the Nsight Compute profile of scripts/profile_decode.sh (V4-Flash FP8 T=128).
# Logs and JSON land under $OUT (default ./bench_out). Needs torch with CUDA, nvidia-cutlass-dsl
# 4.8.0 and apache-tvm-ffi. Set DSV4_ATTN_KERNEL_CACHE_DIR to a folder of precompiled kernels
# (python -m dsv4_attn.kernels.precompile) to skip compiling on the GPU machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TEST_TIMEOUT=${TEST_TIMEOUT:-240}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}
PYTEST_ARGS=${PYTEST_ARGS:-}

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv \
  | tee "$OUT/gpu.txt"
$PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)" \
  | tee -a "$OUT/gpu.txt"

# Smoke test in its own process first: a device fault poisons the CUDA context of the process it
# happens in, so on a fault re-run it under compute-sanitizer to name the faulting instruction;
# on a hang (exit 124) stop at once rather than hang again.
timeout 90 $PY -m pytest -m gpu tests/test_sparse_decode.py -q -p no:cacheprovider -x \
  -k single_key > "$OUT/smoke.log" 2>&1
smoke=$?
echo "smoke exit: $smoke"
if [ $smoke -ne 0 ]; then
  tail -30 "$OUT/smoke.log"
  if [ $smoke -ne 124 ]; then
    CUDA_LAUNCH_BLOCKING=1 timeout 150 compute-sanitizer --print-limit 5 $PY -m pytest -m gpu \
      tests/test_sparse_decode.py -q -p no:cacheprovider -x -k "single_key and FP8" \
      > "$OUT/sanitizer.log" 2>&1
    grep -v "^ *$" "$OUT/sanitizer.log" | head -60
  fi
  exit 1
fi

timeout "$TEST_TIMEOUT" $PY -m pytest -m gpu tests/test_sparse_decode.py \
  tests/test_fused.py::test_decode_schedule_cuda -q -p no:cacheprovider \
  -rf $PYTEST_ARGS 2>&1 | tee "$OUT/pytest_gpu_decode.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_gpu_decode.log"

# With FlashMLA importable (its built package on PYTHONPATH), the ratio table against it;
# without, the table against the SDPA fallback.
if $PY -c "import flash_mla" 2>/dev/null; then
  graphs=()
  [ "${GRAPHS:-0}" = 1 ] && graphs=(--cuda-graphs)
  timeout "$BENCH_TIMEOUT" $PY -m dsv4_attn.bench decode --against flashmla "${graphs[@]}" \
    --json "$OUT/bench_decode_vs_flashmla.json" 2>&1 | tee "$OUT/bench_decode.log"
else
  timeout "$BENCH_TIMEOUT" $PY -m dsv4_attn.bench decode --json "$OUT/bench_decode.json" \
    2>&1 | tee "$OUT/bench_decode.log"
fi
echo "bench exit: ${PIPESTATUS[0]}"
if [ "${SPLITS:-0}" = 1 ]; then
  timeout "$BENCH_TIMEOUT" $PY -m dsv4_attn.bench decode-splits --json "$OUT/bench_decode_splits.json" \
    > "$OUT/bench_decode_splits.log" 2>&1
  echo "decode-splits exit: $?"; tail -40 "$OUT/bench_decode_splits.log"
fi
if [ "${PROFILE:-0}" = 1 ]; then
  OUT="$OUT" bash scripts/profile_decode.sh > "$OUT/profile.log" 2>&1
  echo "profile exit: $?"; tail -12 "$OUT/profile.log"
fi
grep -E "passed|failed|error" "$OUT/pytest_gpu_decode.log" | tail -3
