#!/usr/bin/env bash
# Nsight Compute profile of one gathered-FMHA (sparse prefill) launch, V4-Flash shape (T = 4096,
# H 64, window 128 + top-512 over the gathered rows; scripts/profile_sparse_prefill.py):
#   $OUT/ncu_prefill.txt          speed of light, pipes, stall reasons, memory, scheduler
#   $OUT/ncu_prefill_source.csv   per-SASS-instruction stall samples (--page source)
# Run on the GPU machine from the repo root; output under $OUT (default ./bench_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout ${PROFILE_TIMEOUT:-240} "$NCU" --clock-control none -k regex:FmhaSm90 \
  --launch-skip 1 --launch-count 1 --import-source no \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section InstructionStats \
  --section SourceCounters -o "$OUT/prof_prefill" -f $PY scripts/profile_sparse_prefill.py \
  > "$OUT/ncu_prefill_run.log" 2>&1
echo "ncu exit: $?"
"$NCU" -i "$OUT/prof_prefill.ncu-rep" > "$OUT/ncu_prefill.txt" 2>&1
"$NCU" -i "$OUT/prof_prefill.ncu-rep" --page source --csv --print-source sass \
  > "$OUT/ncu_prefill_source.csv" 2>&1
rm -f "$OUT/prof_prefill.ncu-rep"
grep -E "Duration|Throughput|Hit Rate|Warp Cycles|Eligible" "$OUT/ncu_prefill.txt"
wc -l "$OUT/ncu_prefill_source.csv"
