#!/usr/bin/env bash
# docs/dashboard.png: the dashboard of a `rollout-gateway demo` run, 85 s in, through headless Chromium (Debian's
# package; the flags are those the dashboard's test needs on a machine without network).
#
#   scripts/dashboard_screenshot.sh [OUT.png]
set -euo pipefail

OUT=${1:-docs/dashboard.png}
PYTHON=${PYTHON:-python}
WORK=$(mktemp -d)
trap 'kill "$DEMO" 2>/dev/null || true; rm -rf "$WORK"' EXIT

COLUMNS=200 "$PYTHON" -c "from rollout_cli import main; main()" demo --duration 100 --update-every 8 --concurrency 12 \
  >"$WORK/demo.out" 2>&1 &
DEMO=$!
for _ in $(seq 60); do grep -q "dashboard:" "$WORK/demo.out" && break; sleep 1; done
URL=$(grep -o "http://127.0.0.1:[0-9]*/dashboard" "$WORK/demo.out" | head -1)
sleep 85  # most of the 15-minute charts' first minute and a half, a dozen weight updates
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --disable-dev-shm-usage --user-data-dir="$WORK/profile" \
  --virtual-time-budget=3000 --window-size=1400,1750 --screenshot="$OUT" "$URL" 2>/dev/null
wait "$DEMO"
echo "$OUT"
