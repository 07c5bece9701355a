#!/usr/bin/env bash
# One-shot GPU run of the end-to-end check on a Hopper machine, from the repo root:
#   1. pytest -m gpu tests/test_e2e.py: the tiny HF DeepSeek-V4 greedy/teacher-forced against
#      transformers' eager attention, H = 64 and H = 8, every KV format; fp8_ds_mla and nvfp4
#      must run on the CuTeDSL kernel (bf16 has none and uses the fallback). Each case writes
#      its measurements to $OUT/e2e_gpu_h{64,8}.json, pass or fail.
#   2. the demo on cuda (H = 64, all formats, seeds $SEEDS, default 0..5), table + per-format
#      summary over the seeds + $OUT/demo_gpu.json.
#   3. (only when asked: `... flash`) the demo at V4-Flash's real shapes, FLASH_LAYERS (43)
#      layers in fp32 (34 GB at 43), a FLASH_PROMPT (4096)-token prompt, 32 greedy tokens, every
#      format, seed 4: $OUT/demo_flash.json.
# `bash scripts/gpu_e2e.sh pytest` or `... demo` runs one part only (each fits a 10-minute call).
# Logs land under $OUT (default ./bench_out). Needs torch with CUDA, transformers >= 5.10.1,
# nvidia-cutlass-dsl 4.8.0 and apache-tvm-ffi. Set DSV4_ATTN_KERNEL_CACHE_DIR to a folder of
# precompiled kernels (python -m dsv4_attn.kernels.precompile) to skip compiling here.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export DSV4_ATTN_RESULTS_DIR="$OUT"
PY=${PYTHON:-python3}
TEST_TIMEOUT=${TEST_TIMEOUT:-480}
DEMO_TIMEOUT=${DEMO_TIMEOUT:-540}
SEEDS=${SEEDS:-0,1,2,3,4,5}
PART=${1:-all}
case "$PART" in all|pytest|demo|flash) ;;
  *) echo "usage: $0 [all|pytest|demo|flash], got $PART" >&2; exit 2;; esac

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu_e2e_env.txt"
$PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu_e2e_env.txt"

if [[ $PART == flash ]]; then
  timeout "$DEMO_TIMEOUT" $PY -m dsv4_attn demo --shape flash --layers "${FLASH_LAYERS:-43}" \
    --device cuda --prompt-len "${FLASH_PROMPT:-4096}" --new-tokens 32 --rounding-control \
    --json "$OUT/demo_flash.json" 2>&1 | grep -v "Warning" | tee "$OUT/demo_flash.log"
  echo "demo exit: ${PIPESTATUS[0]}"
  exit 0
fi

if [[ $PART != demo ]]; then
  timeout "$TEST_TIMEOUT" $PY -m pytest -m gpu tests/test_e2e.py -q -s -p no:cacheprovider -rA \
    2>&1 | tee "$OUT/pytest_gpu_e2e.log"
  echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_gpu_e2e.log"
  grep -E "passed|failed|error" "$OUT/pytest_gpu_e2e.log" | tail -3
fi

if [[ $PART != pytest ]]; then
  timeout "$DEMO_TIMEOUT" $PY -m dsv4_attn demo --device cuda --no-save --seeds "$SEEDS" \
    --json "$OUT/demo_gpu.json" 2>&1 | grep -v "Warning" | tee "$OUT/demo_gpu.log"
  echo "demo exit: ${PIPESTATUS[0]}"
fi
