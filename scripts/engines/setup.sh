#!/usr/bin/env bash
# Prepare the real-engine test tiers: one virtual environment per engine (never the project's), and the tiny
# models. Idempotent and cache-keyed: a venv lives in $RG_ENGINE_CACHE/venvs/<engine>-<hash of its pin files>
# and is reused while the pins are unchanged; a half-built one is never used. Links the results into .engines/,
# where tests/engines/ finds them.
#
#   scripts/engines/setup.sh [vllm] [sglang]      (default: both)
#
# Needs the project venv (.venv, with the `trainer` extra) to build the models. Prints what it did and how long
# it took. See docs/engines.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=scripts/engines
GLOO_PLUGIN=backends/vllm-gloo-plugin
CACHE=${RG_ENGINE_CACHE:-$HOME/.cache/rollout-gateway}
STATE=.engines
PY=${PYTHON:-python3}
ENGINES=("$@")
[ ${#ENGINES[@]} -eq 0 ] && ENGINES=(vllm sglang)
mkdir -p "$CACHE/venvs" "$STATE"

log() { echo "[engines $(date -u +%H:%M:%S)] $*"; }

# Bump when a build step below changes (the venv's key is its pin files plus this recipe number).
RECIPE=1
key() { { cat "$@"; echo "recipe $RECIPE"; } | sha256sum | cut -c1-12; }

ready() { [ -f "$1/.complete" ]; }

build_vllm() {
  local dir=$1
  "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --upgrade pip
  "$dir/bin/python" -m pip install --quiet -r "$HERE/vllm-requirements.txt"
  # The media wheels pip resolves do not load against the CPU torch, and importing torchvision breaks
  # transformers' model imports; the text-only server needs none of them.
  "$dir/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
  # The project's gloo weight transfer (a vLLM general plugin; its files are in this venv's key, below), built from
  # a copy so that the build leaves nothing in the source tree.
  cp -r "$GLOO_PLUGIN" "$dir/rg-vllm-gloo-src"
  "$dir/bin/python" -m pip install --quiet --no-deps --no-build-isolation "$dir/rg-vllm-gloo-src"
  rm -rf "$dir/rg-vllm-gloo-src"
}

build_sglang() {
  local dir=$1
  "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --upgrade pip
  "$dir/bin/python" -m pip install --quiet -r "$HERE/sglang-requirements.txt"
  "$dir/bin/python" -m pip install --quiet --no-deps -r "$HERE/sglang-no-deps.txt"
}

ensure_venv() {
  local name=$1 pins dir started
  case $name in
    vllm) pins=("$HERE/vllm-requirements.txt" "$GLOO_PLUGIN/pyproject.toml" "$GLOO_PLUGIN"/rg_vllm_gloo/*.py) ;;
    sglang) pins=("$HERE/sglang-requirements.txt" "$HERE/sglang-no-deps.txt") ;;
    *) echo "unknown engine: $name" >&2; return 2 ;;
  esac
  dir="$CACHE/venvs/$name-$(key "${pins[@]}")"
  if ready "$dir"; then
    log "$name: cached venv $dir"
  else
    started=$SECONDS
    log "$name: installing into $dir (a few minutes, several GB)"
    rm -rf "$dir"
    # Built in place (venvs are not relocatable); `.complete` marks it usable, so an interrupted build is redone.
    "build_$name" "$dir"
    "$dir/bin/python" -c "import $name" >/dev/null
    touch "$dir/.complete"
    log "$name: installed in $((SECONDS - started)) s ($(du -sh "$dir" | cut -f1))"
  fi
  ln -sfn "$dir" "$STATE/$name-venv"
}

build_models() {
  local dir started
  dir="$CACHE/models/$(key scripts/build_tiny_models.py scripts/think_model.py tests/gateway/parsers/templates/qwen3.jinja gateway/assets/tiny_tokenizer/*)"
  if ready "$dir"; then
    log "models: cached $dir"
  else
    started=$SECONDS
    rm -rf "$dir"
    .venv/bin/python scripts/build_tiny_models.py --out "$dir"
    touch "$dir/.complete"
    log "models: built in $((SECONDS - started)) s"
  fi
  ln -sfn "$dir" "$STATE/models"
}

# Old venvs of other pins (and old model builds): keep the two newest, so the cache does not grow forever.
prune() {
  local name=$1
  # shellcheck disable=SC2012
  ls -1dt "$CACHE/venvs/$name-"* 2>/dev/null | tail -n +3 | xargs -r rm -rf
  # shellcheck disable=SC2012
  ls -1dt "$CACHE/models/"* 2>/dev/null | tail -n +3 | xargs -r rm -rf
}

build_models
# The installs are mostly downloads and unpacking: run them side by side, each with its own log.
pids=()
for engine in "${ENGINES[@]}"; do
  ensure_venv "$engine" >"$STATE/$engine-setup.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!ENGINES[@]}"; do
  if ! wait "${pids[$i]}"; then
    failed=1
    echo "[engines] ${ENGINES[$i]}: setup FAILED" >&2
  fi
  cat "$STATE/${ENGINES[$i]}-setup.log"
  prune "${ENGINES[$i]}"
done
[ $failed -eq 0 ] || exit 1
mkdir -p "$CACHE/compile"
log "ready: $(ls -1 "$STATE" | tr '\n' ' ')"
