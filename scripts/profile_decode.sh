#!/usr/bin/env bash
# Nsight Compute profile of one sparse-decode kernel launch (V4-Flash, FP8, T=128 by default):
#   $OUT/ncu_<shape>_<fmt>_<T>.txt   speed of light, pipes, stall reasons, memory, scheduler
#   $OUT/ncu_source.csv              per-SASS-instruction stall samples (--page source)
# Run on the GPU machine from the repo root; output under $OUT (default ./bench_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SHAPE=${SHAPE:-v4-flash} TOKENS=${TOKENS:-128} FMT=${FMT:-fp8_ds_mla}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
BENCH=(-m dsv4_attn.bench decode --shapes "$SHAPE" --tokens "$TOKENS" --formats "$FMT"
       --reps 3 --fallback-reps 1 --json "$OUT/profile_bench.json")
timeout ${PROFILE_TIMEOUT:-240} "$NCU" --clock-control none -k regex:SparseDecodeSm90 \
  --launch-skip 3 --launch-count 1 --import-source no \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section InstructionStats \
  --section SourceCounters -o "$OUT/prof" $PY "${BENCH[@]}" > "$OUT/ncu_run.log" 2>&1
echo "ncu exit: $?"
"$NCU" -i "$OUT/prof.ncu-rep" > "$OUT/ncu_${SHAPE}_${FMT}_${TOKENS}.txt" 2>&1
"$NCU" -i "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source.csv" 2>&1
rm -f "$OUT/prof.ncu-rep"
grep -E "Duration|Throughput|Hit Rate|Warp Cycles|Eligible" "$OUT/ncu_${SHAPE}_${FMT}_${TOKENS}.txt"
head -3 "$OUT/ncu_source.csv" | cut -c1-400
wc -l "$OUT/ncu_source.csv"
