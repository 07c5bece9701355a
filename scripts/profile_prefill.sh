#!/usr/bin/env bash
# Nsight Compute profile of one gathered-FMHA (sparse prefill) launch, V4-Flash shape (T = 4096,
# H 64, window 128 + top-512 over the gathered rows, three launches, the second profiled):
#   $OUT/ncu_prefill.txt          speed of light, pipes, stall reasons, memory, scheduler
#   $OUT/ncu_prefill_source.csv   per-SASS-instruction stall samples (--page source)
# Run on the GPU machine from the repo root; output under $OUT (default ./bench_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
LAUNCH='
import torch
from dsv4_attn.kernels import fmha
from dsv4_attn.prefill_cases import make_v4_sparse_case
case = make_v4_sparse_case(4096, 64, 512, device="cuda", seed=0)
for _ in range(3):
    fmha.run_sparse(case.q, case.kv, case.indices, case.lens, case.sink, case.scale)
torch.cuda.synchronize()'
timeout ${PROFILE_TIMEOUT:-240} "$NCU" --clock-control none -k regex:FmhaSm90 \
  --launch-skip 1 --launch-count 1 --import-source no \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section InstructionStats \
  --section SourceCounters -o "$OUT/prof_prefill" -f $PY -c "$LAUNCH" \
  > "$OUT/ncu_prefill_run.log" 2>&1
echo "ncu exit: $?"
"$NCU" -i "$OUT/prof_prefill.ncu-rep" > "$OUT/ncu_prefill.txt" 2>&1
"$NCU" -i "$OUT/prof_prefill.ncu-rep" --page source --csv --print-source sass \
  > "$OUT/ncu_prefill_source.csv" 2>&1
rm -f "$OUT/prof_prefill.ncu-rep"
grep -E "Duration|Throughput|Hit Rate|Warp Cycles|Eligible" "$OUT/ncu_prefill.txt"
wc -l "$OUT/ncu_prefill_source.csv"
