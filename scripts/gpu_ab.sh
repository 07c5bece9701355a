#!/usr/bin/env bash
# A/B of the kernel benchmarks between this checkout ("new") and another tree of the project
# ("base"), on a Hopper GPU, each side in its own process with FlashMLA timed in that process on
# the same bytes (its ratios are what compare across processes):
#   python -m dsv4_attn.bench decode --against flashmla --cuda-graphs    default shapes
#   python -m dsv4_attn.bench prefill --skip-dense --against flashmla    the sparse prefill cases
# Usage, from the repo root:  bash scripts/gpu_ab.sh BASE_DIR
#   BASE_DIR: the base commit's package, e.g. made here with
#     mkdir -p .devab/base && git archive <commit> dsv4_attn kernels | tar -x -C .devab/base
# ROUNDS (default 2) alternates base and new; logs and JSON: $OUT/ab_{base,new}_{decode,prefill}_rK.
# Needs flash_mla importable (its built package on PYTHONPATH) and the kernel stack.
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=$(cd "${1:?usage: gpu_ab.sh BASE_DIR}" && pwd)
NEW=$(pwd)
OUT=$(mkdir -p "${OUT:-bench_out}" && cd "${OUT:-bench_out}" && pwd)
export PYTHONUNBUFFERED=1
python3 -c "import flash_mla" || { echo "flash_mla is not importable" >&2; exit 2; }
for round in $(seq "${ROUNDS:-2}"); do
  for side in base new; do
    dir=$NEW; [ "$side" = base ] && dir=$BASE
    tag="${side}_r${round}"
    # python -m puts the working directory first on sys.path: each side imports its own package.
    (cd "$dir" && timeout 420 python3 -m dsv4_attn.bench decode --against flashmla --cuda-graphs \
      --json "$OUT/ab_${tag}_decode.json" > "$OUT/ab_${tag}_decode.log" 2>&1)
    echo "$tag decode exit $?"
    (cd "$dir" && timeout 300 python3 -m dsv4_attn.bench prefill --skip-dense --against flashmla \
      --json "$OUT/ab_${tag}_prefill.json" > "$OUT/ab_${tag}_prefill.log" 2>&1)
    echo "$tag prefill exit $?"
  done
done
