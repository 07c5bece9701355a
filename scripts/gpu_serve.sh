#!/usr/bin/env bash
# A real `vllm serve` of the tiny 64-head DeepSeek-V4 on a Hopper GPU, with vLLM's own DeepSeek-V4
# backend and with DSV4_NVFP4 (fp8 and NVFP4 caches), default flags (CUDA graphs, chunked prefill,
# prefix caching), compared request by request; plus the GPU tests that need vLLM's CUDA build.
#
# Needs vLLM 0.33.0 with torch 2.14 and CUDA, and /tmp/dsv4_env.sh, a shell file that puts that
# environment on PATH/PYTHONPATH (this package's vLLM plugin entry point installed in it, under
# /tmp/site). Each part fits one 10-minute call; run them in this order:
#
#   bash scripts/gpu_serve.sh prepare   # this checkout over the packed project; the checkpoint
#   bash scripts/gpu_serve.sh tests     # pytest -m gpu: fused kernels, the layer on CUDA (sync
#                                       #   debug mode, CUDA-graph replay), the decode kernel,
#                                       #   the gathered prefill kernel
#   bash scripts/gpu_serve.sh sanitize  # the poisoned-metadata kernel tests under
#                                       #   compute-sanitizer (memcheck): no access outside
#   bash scripts/gpu_serve.sh bench     # python -m dsv4_attn.bench step (one layer step, b = 64),
#                                       #   prefill-layer (one prompt's prefill, new vs old) and
#                                       #   host (CPU time of an eager decode call)
#   bash scripts/gpu_serve.sh vllm      # serve + query: vLLM's backend (the reference)
#   bash scripts/gpu_serve.sh fp8       # ... --attention-backend DSV4_NVFP4 --kv-cache-dtype fp8
#   bash scripts/gpu_serve.sh nvfp4     # ... --attention-backend DSV4_NVFP4 (NVFP4: auto)
#   bash scripts/gpu_serve.sh compare   # agreement table, tokens/s, preemptions, prefix hits
#   SERVE_MODEL=v41 bash scripts/gpu_serve.sh vllm|fp8|compare  # the same on the tiny V4.1
#   SERVE_MODEL=v41 bash scripts/gpu_serve.sh spec S dspark K  # its DSpark draft (no MTP on V4.1)
#   bash scripts/gpu_serve.sh mtp S [K] # server S (vllm, fp8, nvfp4) with and without MTP
#                                       #   speculation (K draft tokens, default 1), compared
#   bash scripts/gpu_serve.sh spec S M K # server S on the draftable checkpoint without and with
#                                       #   speculation M (mtp, dspark), K draft tokens: greedy
#                                       #   agreement and acceptance (vLLM's spec-decode counters)
#   bash scripts/gpu_serve.sh first     # each server fresh under vLLM's JIT monitor (verbose):
#                                       #   first-request TTFT vs a second's, kernels compiled
#                                       #   while serving (FIRST_SERVERS, default "fp8 nvfp4")
#   bash scripts/gpu_serve.sh capacity  # the KV capacity each server reports at equal memory
#                                       #   (vLLM's backend, fp8, NVFP4; default flags, one server
#                                       #   at a time, stopped once it has reported)
#   bash scripts/gpu_serve.sh startup   # time to ready (launch -> /health) of vLLM's backend and
#                                       #   of DSV4_NVFP4 (NVFP4), each cold (a fresh HOME: empty
#                                       #   vLLM, Triton, DeepGEMM and kernel caches) then warm;
#                                       #   and DSV4_NVFP4 cold after the precompile command.
#                                       #   One server at a time; ~12 min: run it under setsid
#   bash scripts/gpu_serve.sh control   # vLLM's own server without this plugin (VLLM_PLUGINS=)
#                                       #   through every phase, preemption included, CONTROL_REPS
#                                       #   (3) times; also with CUDA_LAUNCH_BLOCKING=1, and with
#                                       #   the plugin installed (three servers side by side)
#   bash scripts/gpu_serve.sh batch "P [A]" ...  # those parts in turn, detached from the call;
#   bash scripts/gpu_serve.sh collect   #   collect: what they wrote since the last collect
#                                       #   ($OUT/NN_part.tgz per part)
#   bash scripts/gpu_serve.sh wait P... #   a batch part: until servers answer on ports P
#   bash scripts/gpu_serve.sh real L    # V4-Flash-shaped checkpoint (dsv4_attn.e2e.real_shapes)
#                                       #   and vllm bench serve of the three servers on layout L
#                                       #   (tp1, tp2, tp4, dp2ep, dp4ep: dsv4_attn.e2e.bench_serve)
#   bash scripts/gpu_serve.sh soak      # vLLM's backend, DSV4_NVFP4 fp8 and NVFP4 at once,
#                                       #   SOAK_SECONDS (600) of random traffic each
#                                       #   (dsv4_attn.e2e.soak) on a 2400-block KV budget: a GPU
#                                       #   per server where there are enough (3: clean memory
#                                       #   figures), else all on GPU 0; SOAK_PROBE=1 adds each
#                                       #   worker's own torch memory and what grew it
#
# SERVE_MEM (default 0.5) is each round's --gpu-memory-utilization: rounds may run side by side
# at 0.25 (their KV blocks are fixed by the override; three servers of the tiny model fit).
# SKIP_PHASES=preemption (comma-separated phase names) leaves phases out of a round; PLAN_SEED
# draws other prompts (a server that already served the default ones would hit its prefix cache).
# SPEC_MEM (0.3) is SERVE_MEM for the spec/mtp pairs; SPEC_PORT (8105, and the next port) their
# ports, so that pairs in separate batches can run side by side.
# Results (JSON, logs) go to $OUT (default ./bench_out). Servers use --num-gpu-blocks-override
# SERVE_BLOCKS (2400: the same block count for every backend, a little more than vLLM's
# admission check needs for one 4096-token request, and less than the preemption phase of
# dsv4_attn/e2e/serve_check.py grows into; 3200 for DSpark) and --gpu-memory-utilization 0.5.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ENV_FILE=${DSV4_ENV_FILE:-/tmp/dsv4_env.sh}  # another file: a stand-in environment (tests)
[ -f "$ENV_FILE" ] || { echo "no $ENV_FILE: set up the vLLM 0.33.0 serve environment first" >&2; exit 2; }
. "$ENV_FILE"
SITE=/tmp/site
CKPT=/tmp/dsv4_tiny_ckpt
DRAFTABLE=/tmp/dsv4_draftable_ckpt  # layers scaled down, an MTP layer that drafts well
DSPARK=/tmp/dsv4_dspark_ckpt  # the same model with a DSpark draft that drafts well
V41=/tmp/dsv41_tiny_ckpt  # the tiny DeepSeek-V4.1 (serve_check checkpoint --v41)
V41_DSPARK=/tmp/dsv41_dspark_ckpt  # its layers scaled down, a DSpark draft that drafts well
# SERVE_MODEL=v41: the rounds (vllm, fp8, nvfp4, compare, first) serve the tiny V4.1 instead,
# with its tokenizer (V4.1's multimodal processor refuses --skip-tokenizer-init; its text model
# alone: --language-model-only), and vLLM's own round with fp8 caches as this backend's.
MODEL_ARGS=(--skip-tokenizer-init)
VLLM_ARGS=()
if [ "${SERVE_MODEL:-v4}" = v41 ]; then
  CKPT=$V41
  MODEL_ARGS=(--language-model-only)
  VLLM_ARGS=(--kv-cache-dtype fp8)
fi
PARTS="prepare|tests|sanitize|bench|vllm|fp8|nvfp4|compare|mtp|spec|capacity|startup|control"
PARTS="$PARTS|soak|real"
PARTS="$PARTS|batch|collect|wait|first"
BATCH=${BATCH:-/tmp/dsv4_batch}  # another BATCH runs a second batch beside the first
PART=${1:?usage: gpu_serve.sh $PARTS}

backend_args() {  # server (vllm, fp8, nvfp4): its attention flags, into the array `extra`
  case $1 in
    vllm) extra=("${VLLM_ARGS[@]}") ;;
    fp8) extra=(--attention-backend DSV4_NVFP4 --kv-cache-dtype fp8) ;;
    nvfp4) extra=(--attention-backend DSV4_NVFP4) ;;
    *) echo "unknown server $1 (vllm, fp8, nvfp4)" >&2; exit 2 ;;
  esac
}

wait_up() {  # port [seconds] [pid file]: until a server answers /health there (exit 1 after
  # seconds, or as soon as the process named in the pid file has exited)
  python3 - "$@" <<'PY'
import sys
from pathlib import Path
from dsv4_attn.e2e.serve_check import Server
port, seconds, pid_file = (sys.argv[1:] + ["600", ""])[:3]
Server(int(port), "").wait(float(seconds), Path(pid_file) if pid_file else None)
PY
}

launch() {  # name port [vllm serve args...]: start a server in its own session, log in $OUT
  local name=$1 port=$2; shift 2
  local args=("$CKPT" --port "$port" "${MODEL_ARGS[@]}" --max-model-len 4096 --dtype bfloat16
              --gpu-memory-utilization "${SERVE_MEM:-0.5}" --num-gpu-blocks-override "${SERVE_BLOCKS:-2400}" --seed 0
              "$@")
  echo "vllm serve ${args[*]}" > "$OUT/serve_$name.cmd"
  # flashinfer is not in the serve environment; vLLM's sampler imports it unless told not to
  (cd /tmp && VLLM_USE_FLASHINFER_SAMPLER=0 setsid vllm serve "${args[@]}" \
    > "$OUT/serve_$name.log" 2>&1 < /dev/null & echo $! > "$OUT/serve_$name.pid")
}

timed_start() {  # name port [vllm serve args...]: seconds from launch to /health, then stop
  local name=$1 port=$2 start; start=$(date +%s.%N)
  launch "$@"
  local up
  up=$(python3 - "$port" "$start" "$OUT/serve_$name.log" <<'PY'
import re, sys, time, urllib.request
port, start, log = sys.argv[1], float(sys.argv[2]), sys.argv[3]
while time.time() - start < 900:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
        print(f"{time.time() - start:.1f}")
        break
    except Exception:
        # a traceback of its own line (vLLM logs some inside WARNING lines and goes on)
        if re.search(r"^Traceback", open(log, errors="replace").read(), re.M):
            print("failed")
            break
        time.sleep(0.5)
else:
    print("timeout")
PY
)
  local compiled; compiled=$(grep -c "dsv4_attn: compiled" "$OUT/serve_$name.log")
  local init
  init=$(grep -o -E "init engine .* took [0-9.]+ s(ec|econds)?" "$OUT/serve_$name.log" | tail -1)
  printf '{"server": "%s", "ready_s": "%s", "kernels_compiled": %s, "vllm_init": "%s"}\n' \
    "$name" "$up" "$compiled" "$init" \
    | tee -a "$OUT/startup.jsonl"
  stop_server "$name" "$port"
}

control_round() {  # name port reps: vLLM's own backend through the request plan reps times
  local name=$1 port=$2 reps=$3 rep
  launch "$name" "$port"
  for rep in $(seq "$reps"); do
    python3 -m dsv4_attn.e2e.serve_check query --name "$name" --port "$port" --model "$CKPT" \
      --wait 600 --out "$OUT/serve_${name}_$rep.json" --seed $((2026 + rep)) \
      > "$OUT/query_${name}_$rep.log" 2>&1
    echo "$name rep $rep: query exit $? ($(grep -c -E "illegal memory|EngineDeadError" \
      "$OUT/serve_$name.log") fault lines in the server log)"
  done
  stop_server "$name" "$port"
}

stop_server() {  # name port: every process of the server's session (its engine included)
  # The session id is read from the process serving the port: setsid may fork, so the pid the
  # launch recorded need not be the server's, and the engine's own title no longer says "vllm".
  local pattern="vllm serve .*--port $2( |$)" sids
  sids=$(pgrep -f -- "$pattern" | xargs -r ps -o sid= -p | sort -u)
  pkill -f -- "$pattern" 2>/dev/null; sleep 3
  local own; own=$(ps -o sid= -p $$ | tr -d ' ')
  for sid in $sids; do [ "$sid" = "$own" ] || pkill -9 -s "$sid" 2>/dev/null; done
  pkill -9 -f -- "$pattern" 2>/dev/null
  for _ in $(seq 30); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$2/health', timeout=2)" \
      2>/dev/null || { echo "server $1 stopped (sessions: ${sids//$'\n'/ })"; return 0; }
    sleep 1
  done
  echo "WARNING: server $1 still answers on port $2" >&2
}

serve_round() {  # name port [vllm serve args...]
  local name=$1 port=$2 attempt rc start
  for attempt in 1 2 3; do
    launch "$@"
    cat "$OUT/serve_$name.cmd"
    start=$(date +%s)
    python3 -m dsv4_attn.e2e.serve_check query --name "$name" --port "$port" --model "$CKPT" \
      --wait 420 --pid "$(cat "$OUT/serve_$name.pid")" --out "$OUT/serve_$name.json" \
      --skip "${SKIP_PHASES:-}" --seed "${PLAN_SEED:-2026}" 2>&1 \
      | tee "$OUT/query_$name.log"
    rc=${PIPESTATUS[0]}
    # vLLM's startup check fails when another process on the GPU frees memory while this
    # server profiles its own (servers side by side): start it again, up to three times.
    if [ "$rc" -ne 0 ] && [ "$attempt" -lt 3 ] \
        && grep -q "Error in memory profiling" "$OUT/serve_$name.log"; then
      echo "round $name: memory profiling disturbed by another process; starting it again"
      stop_server "$name" "$port"
      mv "$OUT/serve_$name.log" "$OUT/serve_${name}_profiling_failed_$attempt.log"
      continue
    fi
    break
  done
  echo "round $name: $(( $(date +%s) - start )) s, query exit $rc"
  grep -E "Traceback|Error|error" "$OUT/serve_$name.log" | grep -v -i "warn" | head -8
  grep -E "Capturing CUDA graphs|Graph capturing finished|GPU KV cache size|Maximum concurrency" \
    "$OUT/serve_$name.log" | tail -5
  stop_server "$name" "$port"
  return "$rc"
}

spec_pair() {  # server method tokens: $CKPT served by server (vllm, fp8, nvfp4) without and
  # with speculation side by side (the second starts once the first is up: vLLM's memory
  # profiling must not see another process release memory); then their greedy agreement and
  # the acceptance of the drafts ($OUT/spec_compare.json)
  local name=$1 method=$2 tokens=$3
  backend_args "$name"
  local spec="{\"method\": \"$method\", \"num_speculative_tokens\": $tokens}"
  export SERVE_MEM=${SPEC_MEM:-0.3}
  local port=${SPEC_PORT:-8105}  # another SPEC_PORT runs another pair beside this one
  rm -f "$OUT/serve_${name}_plain.pid"
  serve_round "${name}_plain" "$port" "${extra[@]}" > "$OUT/round_plain.log" 2>&1 &
  wait_up "$port" 600 "$OUT/serve_${name}_plain.pid" \
    || echo "server ${name}_plain did not come up"
  serve_round "${name}_$method$tokens" $((port + 1)) "${extra[@]}" --speculative-config "$spec" \
    > "$OUT/round_spec.log" 2>&1 &
  wait
  tail -n 4 "$OUT/round_plain.log" "$OUT/round_spec.log"
  python3 -m dsv4_attn.e2e.serve_check compare "$OUT/serve_${name}_plain.json" \
    "$OUT/serve_${name}_$method$tokens.json" --json "$OUT/spec_compare.json"
}

case "$PART" in
  prepare)
    # vLLM's processes import the plugin from $SITE (its entry point is registered there).
    rm -rf "$SITE/dsv4_attn" && cp -rL dsv4_attn "$SITE/dsv4_attn"
    find "$SITE/dsv4_attn" -name __pycache__ -prune -exec rm -rf {} +
    python3 -c "import dsv4_attn.kernels.sparse_decode, dsv4_attn.fused.kv_writers, vllm; \
print('dsv4_attn from', dsv4_attn.__file__, '| vllm', vllm.__version__)"
    python3 -m dsv4_attn.e2e.serve_check checkpoint "$CKPT"
    python3 -m dsv4_attn.e2e.serve_check checkpoint "$DRAFTABLE" --draftable
    python3 -m dsv4_attn.e2e.serve_check checkpoint "$DSPARK" --draftable --dspark
    python3 -m dsv4_attn.e2e.serve_check checkpoint "$V41" --v41
    python3 -m dsv4_attn.e2e.serve_check checkpoint "$V41_DSPARK" --v41 --draftable --dspark
    ;;
  tests)
    # -k: of test_sparse_decode's kernel-against-reference grid (ids FORMAT-H-T-EXTRA-SINK) the
    # H = 64 cases; of the dense FMHA cases the d512 ones. VLLM_TARGET_DEVICE is left to
    # tests/conftest.py (cuda where CUDA is), as a plain `pytest -m gpu` gets it.
    env -u VLLM_TARGET_DEVICE timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider -rfs \
      tests/test_fused.py tests/test_vllm_glue_gpu.py tests/test_sparse_decode.py \
      tests/test_combine.py tests/test_ops.py tests/test_kv_cache.py \
      tests/test_vllm_glue_attention_v41.py \
      tests/test_fmha_ops.py::test_gpu_sparse_prefill_auto_uses_kernel tests/test_fmha.py \
      tests/test_memory_probe.py tests/test_real_shapes.py \
      -k "(not test_kernel_matches_reference or MLA-64- or NVFP4-64-) and (not dense or d512)" \
      2>&1 | tee "$OUT/pytest_gpu_serve_env.log"
    echo "pytest exit: ${PIPESTATUS[0]}"
    ;;
  sanitize)
    timeout 560 compute-sanitizer --tool memcheck --print-limit 10 --error-exitcode 99 \
      python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_sparse_decode.py \
      tests/test_fmha.py -k poisoned 2>&1 | tee "$OUT/sanitizer_poisoned.log"
    echo "compute-sanitizer exit: ${PIPESTATUS[0]}"
    ;;
  bench)
    timeout 300 python3 -m dsv4_attn.bench step --json "$OUT/bench_step.json" 2>&1 \
      | tee "$OUT/bench_step.log"
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then  # name the failing launch
      CUDA_LAUNCH_BLOCKING=1 timeout 200 python3 -m dsv4_attn.bench step --reps 3 \
        --json "$OUT/bench_step_blocking.json" 2>&1 | tail -25
    fi
    timeout 300 python3 -m dsv4_attn.bench prefill-layer --json "$OUT/bench_prefill_layer.json" \
      2>&1 | tee "$OUT/bench_prefill_layer.log"
    # host time of an eager decode call (FlashMLA's beside it where .devanchors built it)
    timeout 200 python3 -m dsv4_attn.bench host --json "$OUT/bench_host.json" 2>&1 \
      | tee "$OUT/bench_host.log"
    ;;
  # ROUND_PORT: another port for the round (default 8101, 8102, 8103)
  vllm) serve_round vllm "${ROUND_PORT:-8101}" "${VLLM_ARGS[@]}" ;;
  fp8) serve_round fp8 "${ROUND_PORT:-8102}" --attention-backend DSV4_NVFP4 --kv-cache-dtype fp8 ;;
  nvfp4) serve_round nvfp4 "${ROUND_PORT:-8103}" --attention-backend DSV4_NVFP4 ;;
  compare)
    # vLLM's round first (the reference), then whichever of this backend's rounds ran
    records=()
    for name in vllm fp8 nvfp4; do
      [ -f "$OUT/serve_$name.json" ] && records+=("$OUT/serve_$name.json")
    done
    python3 -m dsv4_attn.e2e.serve_check compare "${records[@]}" --json "$OUT/serve_compare.json"
    ;;
  mtp)
    # Server ${2:-fp8} with the default checkpoint's MTP layer (${3:-1} draft tokens) against
    # itself without speculation: spec_pair.
    spec_pair "${2:-fp8}" mtp "${3:-1}"
    ;;
  first)
    # The first request as fast as the rest: each server (${FIRST_SERVERS:-fp8 nvfp4}) fresh,
    # with vLLM's JIT monitor logging every kernel compiled after vLLM's warmup; the TTFT of
    # its first request against a second of equal length, then other lengths
    # ($OUT/first_<server>.json, dsv4_attn.e2e.first_request)
    for name in ${FIRST_SERVERS:-fp8 nvfp4}; do
      backend_args "$name"
      launch "first_$name" 8140 "${extra[@]}" --jit-monitor-verbose
      python3 -m dsv4_attn.e2e.first_request --port 8140 --model "$CKPT" --wait 600 \
        --pid "$OUT/serve_first_$name.pid" --log "$OUT/serve_first_$name.log" \
        --out "$OUT/first_$name.json" || echo "first $name: failed"
      stop_server "first_$name" 8140
    done
    ;;
  spec)
    # The same on the draftable checkpoints, whose drafts are accepted about as often as
    # trained ones: ${3:-mtp} (mtp, dspark) with ${4:-1} draft tokens. SERVE_MODEL=v41: the
    # tiny V4.1 with its DSpark draft (V4.1 has no MTP).
    method=${3:-mtp}
    [ "${SERVE_MODEL:-v4}" = v41 ] && [ "$method" != dspark ] \
      && { echo "DeepSeek-V4.1 speculates with dspark only, not $method" >&2; exit 2; }
    case $method in
      mtp) CKPT=$DRAFTABLE ;;
      # The draft's three window layers share the block table, so a block holds more bytes:
      # 2400 blocks fall short of one 4096-token request (vLLM's admission check), 3200 do not.
      dspark) [ "${SERVE_MODEL:-v4}" = v41 ] && CKPT=$V41_DSPARK || CKPT=$DSPARK
        export SERVE_BLOCKS=${SERVE_BLOCKS:-3200} ;;
      *) echo "unknown speculation $method (mtp, dspark)" >&2; exit 2 ;;
    esac
    spec_pair "${2:-fp8}" "$method" "${4:-1}"
    ;;
  capacity)
    # vLLM's "GPU KV cache size" of each server, at the same --gpu-memory-utilization and no
    # block override: what a user sees. A server is stopped once it has said it.
    port=8110
    for spec in "vllm:" "fp8:--attention-backend DSV4_NVFP4 --kv-cache-dtype fp8" \
                "nvfp4:--attention-backend DSV4_NVFP4"; do
      name=cap_${spec%%:*}; read -r -a extra <<< "${spec#*:}"
      port=$((port + 1))
      (cd /tmp && VLLM_USE_FLASHINFER_SAMPLER=0 setsid vllm serve "$CKPT" --port "$port" \
        --skip-tokenizer-init --max-model-len 4096 --dtype bfloat16 --seed 0 \
        --gpu-memory-utilization "${CAPACITY_MEM:-0.3}" "${extra[@]}" > "$OUT/$name.log" 2>&1 \
        < /dev/null &)
      for _ in $(seq 300); do
        grep -q -E "KV cache size|Traceback" "$OUT/$name.log" 2>/dev/null && break; sleep 1
      done
      echo "$name: $(grep -E -o "KV cache size: [0-9,]+ tokens" "$OUT/$name.log" | tail -1)"
      grep -E "Traceback|Error" "$OUT/$name.log" | head -3
      stop_server "$name" "$port"
    done
    ;;
  startup)
    # A fresh HOME per backend is a cold start (vLLM's torch.compile cache, Triton's, DeepGEMM's
    # and this package's kernel cache, ~/.cache/dsv4_attn/kernels, all live under it, Inductor's
    # is set there); the second start with the same HOME is warm.
    run_cold_warm() {  # label [vllm serve args...]
      local label=$1; shift
      local home=/tmp/ttr_$label; rm -rf "$home"; mkdir -p "$home"
      for state in cold warm; do
        HOME=$home TORCHINDUCTOR_CACHE_DIR=$home/inductor timed_start "${label}_$state" 8120 "$@"
      done
    }
    run_cold_warm vllm
    run_cold_warm nvfp4 --attention-backend DSV4_NVFP4
    home=/tmp/ttr_precompiled; rm -rf "$home"; mkdir -p "$home"
    start=$(date +%s.%N)
    HOME=$home python3 -m dsv4_attn.kernels.precompile 2>&1 | tee "$OUT/precompile.log"
    echo "precompile: $(python3 -c "import time; print(f'{time.time() - $start:.1f}')") s" \
      | tee -a "$OUT/precompile.log"
    HOME=$home TORCHINDUCTOR_CACHE_DIR=$home/inductor timed_start nvfp4_precompiled 8120 \
      --attention-backend DSV4_NVFP4
    ls "$home/.cache/dsv4_attn/kernels" | wc -l | sed 's/^/kernel files after: /'
    ;;
  control)
    # vLLM's own backend, three servers side by side, each through the whole request plan
    # CONTROL_REPS times (other prompts each time; the preemption phase included): without this
    # plugin (VLLM_PLUGINS= loads no plugin), the same with CUDA_LAUNCH_BLOCKING=1 (a fault then
    # names its kernel), and with the plugin installed.
    export SERVE_MEM=${CONTROL_MEM:-0.2}
    reps=${CONTROL_REPS:-3}
    (export VLLM_PLUGINS=; control_round control 8131 "$reps") &
    (export VLLM_PLUGINS= CUDA_LAUNCH_BLOCKING=1; control_round control_blocking 8132 "$reps") &
    control_round plugin_installed 8133 "$reps" &
    wait
    for name in control control_blocking plugin_installed; do
      echo "$name: plugin lines $(grep -c -E "dsv4_nvfp4|dsv4_attn|DSV4_NVFP4" \
        "$OUT/serve_$name.log"), faults $(grep -c -i -E \
        "illegal memory access|CUBLAS_STATUS_EXECUTION_FAILED" "$OUT/serve_$name.log")"
      grep -h -E "^(preemption|throughput2):" "$OUT"/query_"$name"_*.log
    done
    ;;
  soak)
    # SOAK_SERVERS (default: vLLM's own backend, DSV4_NVFP4 fp8 and NVFP4) under SOAK_SECONDS of
    # random traffic at once. With a GPU per server each runs alone on its own (its memory
    # figure is then its own); on fewer GPUs they share GPU 0, started one after the other
    # (vLLM's memory profiling fails when another process changes its memory meanwhile).
    # SOAK_PROBE=1: each server runs dsv4_attn.e2e.memory_probe as its worker extension, so the
    # soak samples every worker's own torch memory (clean even on a shared GPU) and ends with
    # the memory mapped during the run by the code that asked for it.
    read -r -a names <<< "${SOAK_SERVERS:-vllm fp8 nvfp4}"
    probe=()
    if [ "${SOAK_PROBE:-0}" = 1 ]; then
      export VLLM_SERVER_DEV_MODE=1
      probe=(--worker-extension-cls dsv4_attn.e2e.memory_probe.MemoryProbe)
    fi
    gpus=$(nvidia-smi -L | wc -l); port=8140; i=0
    for name in "${names[@]}"; do
      backend_args "$name"
      gpu=0; [ "$gpus" -ge "${#names[@]}" ] && gpu=$i
      CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=$gpu SERVE_MEM=${SOAK_MEM:-0.25} \
        launch "soak_$name" $((port + i)) "${extra[@]}" "${probe[@]}"
      [ "$gpus" -ge "${#names[@]}" ] || wait_up $((port + i)) 600 "$OUT/serve_soak_$name.pid" \
        || echo "server soak_$name did not come up"
      echo "$name $((port + i)) $gpu" >> "$OUT/soak_servers.txt"; i=$((i + 1))
    done
    while read -r name p gpu; do
      snapshot=()
      [ ${#probe[@]} -gt 0 ] && snapshot=(--probe "/tmp/memory_snapshot_${name}_{rank}.pickle")
      python3 -m dsv4_attn.e2e.soak --port "$p" --model "$CKPT" --max-model-len 4096 --wait 600 \
        --seconds "${SOAK_SECONDS:-600}" --gpu "$gpu" --out "$OUT/soak_$name.json" \
        "${snapshot[@]}" > "$OUT/soak_$name.log" 2>&1 &
    done < "$OUT/soak_servers.txt"
    wait
    while read -r name p gpu; do
      tail -25 "$OUT/soak_$name.log"
      grep -E "^Traceback|Error" "$OUT/serve_soak_$name.log" | grep -v -i warn | head -5
      stop_server "soak_$name" "$p"
    done < "$OUT/soak_servers.txt"
    ;;
  real)
    # V4-Flash's attention at its real shapes (dsv4_attn.e2e.real_shapes: 16 GiB written here
    # once), then vllm bench serve of the three servers on layout ${2:-tp1}
    # (dsv4_attn.e2e.bench_serve; BENCH_SERVERS / BENCH_CASES (empty: none) / BENCH_ONLY narrow it,
    # BENCH_GREEDY=1 adds the greedy agreement of the servers, BENCH_PROFILE=CASE a profile of
    # that case's steps (BENCH_PROFILE_DELAY steps skipped, BENCH_PROFILE_STEPS profiled), BENCH_SPREAD=1 a GPU per server at once, BENCH_SHARED=1 every server
    # on GPU 0 at once taking turns; BENCH_PORT (8200) the first server's port, the next
    # +20 each). Long: run it under setsid and poll $OUT/bench.log.
    # Set d (long contexts; BENCH_CASES=d): BENCH_LONG_CONTEXTS (131072), BENCH_LONG_OUTPUT
    # (2048), BENCH_LONG_WAVES (1), BENCH_MAX_MODEL_LEN (131072); BENCH_KV_GIB may be fractional;
    # BENCH_LONG_CAPACITY: vLLM's requests at once per context, or "planned" (with BENCH_SHARED:
    # dsv4_attn.vllm_glue.capacity's prediction for BENCH_KV_GIB), instead of probing vLLM.
    # BENCH_FIRST=1 (with BENCH_SHARED=1): first-request TTFTs once all are up, before any turn;
    # BENCH_SERVE_ARGS: more `vllm serve` flags for every server (e.g. --jit-monitor-verbose).
    # REAL_LAYERS (43): the first layers of V4-Flash's schedule (4: a shallow control whose
    # outputs depth has not amplified); FLASH_CKPT: a checkpoint written elsewhere.
    layers=${REAL_LAYERS:-43}
    FLASH=${FLASH_CKPT:-/tmp/dsv4_flash_ckpt$([ "$layers" = 43 ] || echo "_l$layers")}
    # Weights drawn on the GPU (seconds; the CPU takes about 3 minutes), on the CPU if that fails.
    [ -f "$FLASH/tokenizer.json" ] || { python3 -m dsv4_attn.e2e.real_shapes "$FLASH" \
      --layers "$layers" --device cuda \
      || python3 -m dsv4_attn.e2e.real_shapes "$FLASH" --layers "$layers"; } 2>&1 \
      | tail -3 | tee "$OUT/real_shapes.log"
    bench() {  # servers port [args]: bench_serve of those servers on layout ${2:-tp1}
      local names=$1 port=$2; shift 2
      VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m dsv4_attn.e2e.bench_serve --model "$FLASH" \
        --layout "$layout" --servers "$names" --port "$port" \
        --cases "${BENCH_CASES-a,b}" --only "${BENCH_ONLY:-}" ${BENCH_GREEDY:+--greedy} \
        ${BENCH_PROFILE:+--profile "$BENCH_PROFILE"} \
        ${BENCH_PROFILE_DELAY:+--profile-delay "$BENCH_PROFILE_DELAY"} \
        ${BENCH_PROFILE_STEPS:+--profile-iterations "$BENCH_PROFILE_STEPS"} \
        ${BENCH_MAX_MODEL_LEN:+--max-model-len "$BENCH_MAX_MODEL_LEN"} \
        ${BENCH_LONG_CONTEXTS:+--long-contexts "$BENCH_LONG_CONTEXTS"} \
        ${BENCH_LONG_OUTPUT:+--long-output "$BENCH_LONG_OUTPUT"} \
        ${BENCH_LONG_WAVES:+--long-waves "$BENCH_LONG_WAVES"} \
        ${BENCH_LONG_CAPACITY:+--long-capacity "$BENCH_LONG_CAPACITY"} --out "$OUT/bench_serve" "$@"
    }
    compare_greedy() {  # the greedy agreement of the servers run by separate processes
      python3 -c "from pathlib import Path; \
from dsv4_attn.e2e.bench_serve import compare_greedy; \
compare_greedy(Path('$OUT/bench_serve'), '$layout', '$servers'.split(','))"
    }
    layout=${2:-tp1}; servers=${BENCH_SERVERS:-vllm,fp8,nvfp4}
    if [ "${BENCH_SHARED:-0}" = 1 ]; then
      # Every server at once on the same GPUs (BENCH_GPUS: 0 for tp1, else all), each with
      # BENCH_KV_GIB (16) GiB of KV cache per GPU (--kv-cache-memory-bytes: equal caches, no
      # memory profiling for a neighbour to disturb); their cold starts overlap, then each step
      # runs on one server at a time (dsv4_attn.e2e.turns), after BENCH_AFTER (a file, e.g.
      # another batch's done) exists.
      kv_bytes=$(python3 -c "print(int(float('${BENCH_KV_GIB:-16}') * 2**30))")
      if [ "${BENCH_LONG_CAPACITY:-}" = planned ]; then
        BENCH_LONG_CAPACITY=$(python3 -c "
from dsv4_attn.vllm_glue.capacity import SCHEDULES, requests_at_once
contexts = [int(c) for c in '${BENCH_LONG_CONTEXTS:-131072}'.split(',')]
print(','.join(str(requests_at_once(SCHEDULES['V4-Flash'], 'vllm', $kv_bytes, c,
                                    output_len=${BENCH_LONG_OUTPUT:-2048},
                                    max_model_len=${BENCH_MAX_MODEL_LEN:-131072}))
               for c in contexts))")
        echo "set d: vLLM's requests at once, planned: $BENCH_LONG_CAPACITY" | tee "$OUT/long_capacity.txt"
      fi
      gpus=${BENCH_GPUS:-$([ "$layout" = tp1 ] && echo 0 || nvidia-smi --query-gpu=index \
        --format=csv,noheader | paste -sd,)}
      if [ "${BENCH_FIRST:-0}" = 1 ]; then
        # Once every server is up, before any turn: each server's first request against a
        # second of equal length (dsv4_attn.e2e.first_request; vLLM's JIT monitor logs into
        # the server's log, read at the end) -> $OUT/first_real_<server>.json
        first_done="$OUT/first_done"; rm -f "$first_done"
        (
          i=0; ports=""
          for name in ${servers//,/ }; do ports="$ports $((${BENCH_PORT:-8200} + 20 * i))"; i=$((i + 1)); done
          for port in $ports; do wait_up "$port" "${BENCH_WAIT_S:-1500}" || true; done
          i=0
          for name in ${servers//,/ }; do
            port=$((${BENCH_PORT:-8200} + 20 * i)); i=$((i + 1))
            python3 -m dsv4_attn.e2e.first_request --port "$port" --model "$FLASH" --wait 60 \
              --log "$OUT/bench_serve/${layout}_$name.log" --out "$OUT/first_real_$name.json" \
              || echo "first $name: failed"
          done
          touch "$first_done"
        ) > "$OUT/first_real.log" 2>&1 &
        BENCH_AFTER=$first_done
      fi
      i=0
      for name in ${servers//,/ }; do
        CUDA_VISIBLE_DEVICES=$gpus bench "$name" $((${BENCH_PORT:-8200} + 20 * i)) \
          --turns "$OUT/turns" --turn-order "$servers" ${BENCH_AFTER:+--start-after "$BENCH_AFTER"} -- \
          --kv-cache-memory-bytes "$kv_bytes" --gpu-memory-utilization 0.2 ${BENCH_SERVE_ARGS:-} \
          > "$OUT/bench_$name.log" 2>&1 &
        i=$((i + 1))
      done
      wait
      tail -n 15 "$OUT"/bench_*.log
      if [ -n "${BENCH_GREEDY:-}" ]; then compare_greedy; fi
    elif [ "${BENCH_SPREAD:-0}" = 1 ]; then
      # One GPU per server, all at once (layout tp1 on a machine with a GPU per server): each
      # server's figures on its own GPU, then the greedy agreement of them all. Set b reads
      # vLLM's capacity from its record, written once that server is up (start vllm first).
      i=0
      for name in ${servers//,/ }; do
        CUDA_VISIBLE_DEVICES=$i bench "$name" $((${BENCH_PORT:-8200} + 20 * i)) \
          > "$OUT/bench_$name.log" 2>&1 &
        i=$((i + 1)); sleep 20  # staggered: vLLM's memory profiling at startup
      done
      wait
      tail -n 15 "$OUT"/bench_*.log
      if [ -n "${BENCH_GREEDY:-}" ]; then compare_greedy; fi
    else
      bench "$servers" "${BENCH_PORT:-8200}" 2>&1 | tee "$OUT/bench.log"
    fi
    ;;
  batch)
    # bash scripts/gpu_serve.sh batch "PART [ARG]" ...: the parts one after another, detached
    # from the call (a device call may end, the machine stays while calls keep coming), each
    # with its own OUT under $BATCH; `collect` returns what is there so far.
    shift
    mkdir -p "$BATCH"; rm -f "$BATCH/done"
    : > "$BATCH/plan.txt"
    for part in "$@"; do echo "$part" >> "$BATCH/plan.txt"; done
    setsid bash -c '
      n=0
      while read -r part; do
        n=$((n + 1)); dir=$0/$(printf %02d "$n")_${part// /_}; mkdir -p "$dir"
        echo "$(date +%T) start: $part" >> "$0/batch.log"
        OUT=$dir bash scripts/gpu_serve.sh $part > "$dir/part.log" 2>&1
        rc=$?
        echo "$(date +%T) end: $part, exit $rc" >> "$0/batch.log"
      done < "$0/plan.txt"
      echo "$(date +%T) batch done" >> "$0/batch.log"; touch "$0/done"' "$BATCH" > /dev/null 2>&1 < /dev/null &
    echo "batch of $# parts started; poll with: bash scripts/gpu_serve.sh collect"
    ;;
  collect)
    # What the batch wrote so far: $OUT/batch_log.txt, and one $OUT/NN_part.tgz per part that
    # is running or ended since the last collect (a returned file has a size limit; traces and
    # memory snapshots stay on the machine: their summaries are in the parts' JSON).
    tail -5 "$BATCH/batch.log"
    cp "$BATCH/batch.log" "$OUT/batch_log.txt"
    for dir in "$BATCH"/[0-9]*_*; do
      [ -d "$dir" ] && [ ! -f "$dir/.collected" ] || continue
      part=$(basename "$dir")
      ended=0; grep -q "end: $(sed -n "$((10#${part%%_*}))p" "$BATCH/plan.txt")," \
        "$BATCH/batch.log" && ended=1
      [ "$ended" = 1 ] || tail -5 "$dir/part.log"
      tar czf "$OUT/$part.tgz" --exclude='*.pt.trace.json*' --exclude='*.pickle' \
        --exclude=.collected -C "$BATCH" "$part"
      [ "$ended" = 1 ] && touch "$dir/.collected"
    done
    ls -la "$OUT"
    ;;
  wait)
    # bash scripts/gpu_serve.sh wait PORT...: until a server answers /health on each port (a
    # batch part that must not start while those servers profile their memory), at most
    # WAIT_S (900) seconds each
    shift
    for port in "$@"; do
      wait_up "$port" "${WAIT_S:-900}" || { echo "no server on port $port" >&2; exit 1; }
    done
    ;;
  *) echo "unknown part $PART" >&2; exit 2 ;;
esac
