#!/usr/bin/env bash
# GPU recipe: the engine tiers against real vLLM and SGLang on one NVIDIA GPU, serving the tiny Qwen3-MoE with
# routed-expert capture on (R3), which the CPU builds cannot do. Needs one NVIDIA GPU, its driver, python3.11+
# and access to the package registry. It has NOT been run by the project yet (see docs/engines.md).
#
#   scripts/gpu_check.sh [vllm] [sglang]            (default: both, one after the other)
#
# Environment: RG_GPU_WORK (default .engines/gpu: venvs, models, logs), VLLM_SPEC (default vllm==0.32.0),
# SGLANG_SPEC (default sglang==0.5.23), RG_GPU_DTYPE (default float32: greedy comparisons stay batch-invariant;
# bfloat16 if an attention backend refuses float32), RG_GPU_MEM (fraction of GPU memory per server, default 0.3).
#
# What it does per engine: its own venv (never the project's), a server on 127.0.0.1 serving models/moe with
# routed experts on, then the same pytest tier as CI pointed at it (RG_<ENGINE>_URL), plus the routed-expert
# checks that only run with RG_ENGINE_ROUTED_EXPERTS=1 (splicing across a resume). vLLM is started with the `nccl`
# in-memory weight transfer (`--weight-transfer-config`), and its tier's transfer checks push over NCCL with vLLM's
# own trainer-side helper (trainers/nccl_transfer.py), so vLLM is installed into the project's venv as well (NOT
# run by the project yet either). Exit status: non-zero if any tier failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${RG_GPU_WORK:-$ROOT/.engines/gpu}
DTYPE=${RG_GPU_DTYPE:-float32}
MEM=${RG_GPU_MEM:-0.3}
ENGINES=("$@")
[ ${#ENGINES[@]} -eq 0 ] && ENGINES=(vllm sglang)
mkdir -p "$WORK/logs"
log() { echo "[gpu $(date -u +%H:%M:%S)] $*"; }

command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "no NVIDIA GPU visible (nvidia-smi)" >&2; exit 2; }

# The project venv (tests, gateway) and the models (with moe_v2 for the weight updates).
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet -e '.[dev,trainer]'
.venv/bin/python scripts/build_tiny_models.py --out "$WORK/models" --dtype "$DTYPE"

venv() {  # venv NAME SPEC: a venv with the engine's full (CUDA) dependencies
  local dir="$WORK/$1-venv"
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    python3 -m venv "$dir"
    "$dir/bin/python" -m pip install --quiet --upgrade pip
    "$dir/bin/python" -m pip install --quiet "$2"
    touch "$dir/.complete"
  fi
  echo "$dir/bin/python"
}

wait_health() {  # wait_health URL PID LOG
  for _ in $(seq 1 600); do
    if curl -sf "$1/health" >/dev/null; then return 0; fi
    if ! kill -0 "$2" 2>/dev/null; then tail -50 "$3"; return 1; fi
    sleep 1
  done
  tail -50 "$3"
  return 1
}

SERVER=""
stop_server() { [ -n "$SERVER" ] && kill -TERM -- "-$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null; SERVER=""; }
trap stop_server EXIT

run_tier() {  # run_tier KIND URL [TRANSFER]: TRANSFER, the vLLM server's --weight-transfer-config backend
  RG_ENGINES_REQUIRED=1 RG_ENGINE_MODELS="$WORK/models" RG_ENGINE_MODEL=moe RG_ENGINE_ROUTED_EXPERTS=1 \
    RG_VLLM_WEIGHT_TRANSFER="${3:-}" \
    env "RG_$(echo "$1" | tr a-z A-Z)_URL=$2" .venv/bin/python -m pytest "tests/engines/test_$1.py" -m "$1" -p no:cacheprovider
}

status=0
for engine in "${ENGINES[@]}"; do
  case $engine in
    vllm)
      py=$(venv vllm "${VLLM_SPEC:-vllm==0.32.0}")
      # The trainer's side of the nccl transfer is vLLM's own helper: the tier's trainer needs vLLM too.
      .venv/bin/python -m pip install --quiet "${VLLM_SPEC:-vllm==0.32.0}"
      transfer=nccl
      port=18101
      log "vllm: serving $WORK/models/moe on :$port (routed experts on)"
      # Routed-experts capture needs the V2 model runner; dev mode mounts /pause, /collective_rpc, ...
      setsid env VLLM_SERVER_DEV_MODE=1 VLLM_USE_V2_MODEL_RUNNER=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
        "$py" -m vllm.entrypoints.openai.api_server --model "$WORK/models/moe" --served-model-name tiny \
        --host 127.0.0.1 --port $port --max-model-len 4096 --dtype "$DTYPE" --gpu-memory-utilization "$MEM" \
        --enable-return-routed-experts --enable-scale-out --enable-prompt-tokens-details --enable-prefix-caching \
        --weight-transfer-config '{"backend": "nccl"}' \
        --stream-interval 8 --seed 0 >"$WORK/logs/vllm.log" 2>&1 &
      ;;
    sglang)
      py=$(venv sglang "${SGLANG_SPEC:-sglang==0.5.23}")
      transfer=""  # inline tensors: no group
      port=18102
      log "sglang: serving $WORK/models/moe on :$port (routed experts on)"
      setsid env HF_HUB_OFFLINE=1 \
        "$py" -m sglang.launch_server --model-path "$WORK/models/moe" --served-model-name tiny \
        --host 127.0.0.1 --port $port --context-length 4096 --dtype "$DTYPE" --mem-fraction-static "$MEM" \
        --enable-return-routed-experts --enable-metrics --stream-interval 8 --random-seed 0 \
        >"$WORK/logs/sglang.log" 2>&1 &
      ;;
    *) echo "unknown engine: $engine" >&2; exit 2 ;;
  esac
  SERVER=$!
  if wait_health "http://127.0.0.1:$port" "$SERVER" "$WORK/logs/$engine.log"; then
    log "$engine: up; running its tier"
    run_tier "$engine" "http://127.0.0.1:$port" "$transfer" || status=1
  else
    log "$engine: the server did not come up (log: $WORK/logs/$engine.log)"
    status=1
  fi
  stop_server
done
exit $status
