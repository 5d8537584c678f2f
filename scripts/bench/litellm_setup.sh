#!/usr/bin/env bash
# LiteLLM's proxy in a virtual environment of its own, for `benchmarks/compare.py --targets litellm-*` (never in
# the project's venv or extras: it pins many packages of its own). Idempotent: the venv is reused while it holds
# the pin below; a half-built one is never used (`.complete` holds the pin once it is usable).
#
#   scripts/bench/litellm_setup.sh            # -> $RG_ENGINE_CACHE/litellm-venv (default ~/.cache/rollout-gateway)
set -euo pipefail
PIN="litellm[proxy]==1.106.12"
CACHE=${RG_ENGINE_CACHE:-$HOME/.cache/rollout-gateway}
DIR=$CACHE/litellm-venv
PY=${PYTHON:-python3}

log() { echo "[litellm $(date -u +%H:%M:%S)] $*"; }

if [ -f "$DIR/.complete" ] && [ "$(cat "$DIR/.complete")" = "$PIN" ]; then
  log "cached venv $DIR ($PIN)"
  exit 0
fi
started=$SECONDS
log "installing $PIN into $DIR"
rm -rf "$DIR"
mkdir -p "$CACHE"
# Built in place (venvs are not relocatable); an interrupted build has no `.complete` and is redone.
"$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet --upgrade pip
"$DIR/bin/python" -m pip install --quiet "$PIN"
LITELLM_LOCAL_MODEL_COST_MAP=True "$DIR/bin/litellm" --help >/dev/null  # offline: no model cost map fetch
echo "$PIN" >"$DIR/.complete"
log "installed in $((SECONDS - started)) s ($(du -sh "$DIR" | cut -f1))"
