#!/usr/bin/env bash
# One-shot GPU check of the prefill kernels on a Hopper machine, from the repo root:
#   1. the GPU tests of tests/test_fmha.py, one process per kernel variant, run side by side with
#      a time limit each (a hang or crash in one variant cannot take the others down), then
#      tests/test_fmha_ops.py;
#   2. the prefill benchmark (python -m dsv4_attn.bench prefill), table + JSON;
#   3. a summary (per-case errors, per-variant status, benchmark table) printed last.
# Everything lands under $OUT (default ./bench_out). Needs torch with CUDA, nvidia-cutlass-dsl
# 4.8.0 (+ apache-tvm-ffi) and pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1
export FMHA_GPU_RESULTS="$OUT"
rm -f "$OUT/fmha_gpu_cases.jsonl" "$OUT/variant_status.txt"
PY=${PYTHON:-python3}
# Time limits (seconds) keep the whole run under ~10 minutes even if kernels hang: each test
# process gets at most TEST_TIMEOUT and none starts after TEST_BUDGET from now.
TEST_TIMEOUT=${TEST_TIMEOUT:-150}
TEST_BUDGET=${TEST_BUDGET:-300}
OPS_TIMEOUT=${OPS_TIMEOUT:-90}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-200}
PARALLEL=${PARALLEL:-8}
DEADLINE=$(( $(date +%s) + TEST_BUDGET ))

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv \
  | tee "$OUT/gpu.txt"
$PY - <<'EOF' 2>&1 | tee -a "$OUT/gpu.txt"
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import cutlass
    print("nvidia-cutlass-dsl", getattr(cutlass, "__version__", "?"))
except Exception as exc:  # noqa: BLE001
    print("cutlass import failed:", exc)
EOF

# --- 1. GPU tests, one process per variant ------------------------------------------------------
run_group() {  # $1 = label, $2 = pytest -k expression
  local label=$1 expr=$2
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt 20 ]; then
    echo "$label SKIPPED (test time budget used up)" >> "$OUT/variant_status.txt"
    return
  fi
  local limit=$(( left < TEST_TIMEOUT ? left : TEST_TIMEOUT ))
  timeout "$limit" $PY -m pytest -m gpu tests/test_fmha.py -k "$expr" -q \
    -p no:cacheprovider > "$OUT/logs/test_${label}.log" 2>&1
  local rc=$?
  local tail_line
  tail_line=$(grep -E "passed|failed|error|skipped" "$OUT/logs/test_${label}.log" | tail -1)
  [ "$rc" = 124 ] && tail_line="TIMEOUT after ${limit}s (hang?)"
  echo "$label rc=$rc ${tail_line}" >> "$OUT/variant_status.txt"
}
export -f run_group
export PY OUT TEST_TIMEOUT DEADLINE
{
  # Most informative groups first (they start in the first parallel wave).
  done_labels=""
  first="sparse d128-causal-ov1 d512-causal d256-causal-ov1 d64-none-ov1 d192-window-ov1"
  first="$first d128-causal-ov0 d512-window"
  all=""
  for d in 64 128 192 256 512; do
    for mask in none causal window; do
      if [ "$d" = 512 ]; then all="$all d${d}-${mask}"; else all="$all d${d}-${mask}-ov1 d${d}-${mask}-ov0"; fi
    done
  done
  for label in $first $all; do
    case " $done_labels " in *" $label "*) continue ;; esac
    done_labels="$done_labels $label"
    if [ "$label" = sparse ]; then echo "sparse|sparse"; continue; fi
    d=${label%%-*}; rest=${label#*-}; mask=${rest%%-*}; ov=${rest#*-}
    if [ "$ov" = "$rest" ]; then  # head_dim 512: one mainloop
      echo "${label}|dense-${d}-${mask}-"
    else  # the two row-split mainloops run in separate processes
      echo "${label}|dense-${d}-${mask}- and ${ov}"
    fi
  done
} | xargs -P "$PARALLEL" -I{} bash -c 'IFS="|" read -r label expr <<< "{}"; run_group "$label" "$expr"'

timeout "$OPS_TIMEOUT" $PY -m pytest -m gpu tests/test_fmha_ops.py -q -p no:cacheprovider \
  > "$OUT/logs/test_fmha_ops.log" 2>&1
echo "fmha_ops rc=$? $(grep -E 'passed|failed|error' "$OUT/logs/test_fmha_ops.log" | tail -1)" \
  >> "$OUT/variant_status.txt"

# --- 2. benchmark ------------------------------------------------------------------------------
timeout "$BENCH_TIMEOUT" $PY -m dsv4_attn.bench prefill --json "$OUT/bench_prefill.json" \
  > "$OUT/logs/bench_prefill.log" 2>&1
echo "bench rc=$?" >> "$OUT/variant_status.txt"

# --- 3. summary --------------------------------------------------------------------------------
$PY - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
print("== per-variant test processes ==")
print(open(os.path.join(out, "variant_status.txt")).read().rstrip())
cases_path = os.path.join(out, "fmha_gpu_cases.jsonl")
if os.path.exists(cases_path):
    rows = [json.loads(line) for line in open(cases_path)]
    bad = [r for r in rows if not r["ok"]]
    print(f"\n== kernel cases vs float64 reference: {len(rows) - len(bad)}/{len(rows)} ok ==")
    print(f"{'case':34} {'ok':>3} {'out rel':>9} {'lse rel':>9} {'-inf ok':>7}")
    for r in sorted(rows, key=lambda r: r["case"]):
        print(f"{r['case']:34} {'y' if r['ok'] else 'N':>3} {r['out_rel_err']:9.2e} "
              f"{r['lse_rel_err']:9.2e} {str(r['neg_inf_match']):>7}")
else:
    print("\nno kernel case results (every test process failed before running a case?)")
bench = os.path.join(out, "bench_prefill.json")
if os.path.exists(bench):
    rec = json.load(open(bench))
    ceil = rec.get("ceilings") or {}
    print(f"\n== prefill benchmark ({ceil.get('device')}, bf16 ceiling "
          f"{ceil.get('bf16_tflops', 0):.0f} TFLOP/s) ==")
    print(f"{'kind':18} {'D':>4} {'H':>4} {'tok':>5} {'us':>8} {'TFLOP/s':>8} "
          f"{'sdpa TF/s':>9} {'x sdpa':>6} {'target':>9} met")
    for r in rec["rows"]:
        f = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{r['kind']:18} {r['D']:>4} {r['H']:>4} {r['tokens']:>5} "
              f"{f(r['median_us'], '8.0f')} {f(r['tflops'], '8.1f')} "
              f"{f(r['sdpa_tflops'], '9.1f')} {f(r['vs_sdpa'], '6.2f')} {r['target']:>9} "
              f"{'y' if r['meets_target'] else 'N'}")
else:
    print("\nno benchmark JSON (see logs/bench_prefill.log)")
EOF
