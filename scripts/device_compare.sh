#!/usr/bin/env bash
# benchmarks/compare.py on a many-core machine without network (`--layout dedicated`: each replica, each load
# generator and the proxy on a CPU of its own), with the project's dependencies and the two Rust routers
# travelling in .whl/ (scripts/device_setup.sh says how to fill it). Output: $OUT/compare.txt (the console) and
# $OUT/compare.json (every figure).
#
#   OUT=/tmp/out scripts/device_compare.sh
#
# Knobs (environment): TARGETS, WORKLOADS and ROUNDS (compare.py's; the defaults fit about 7 minutes), LOADGENS
# (2), LIMIT_S (the bound of the whole benchmark, 480), EXTRA_ARGS (more compare.py options), PYTHON (python3),
# SKIP_WHEELS=1 (use $PYTHON's own packages: a rehearsal on a development machine).
set -euo pipefail

TARGETS=${TARGETS:-direct gateway gateway-generate sglang-manual vllm-consistent_hash python-relay}
WORKLOADS=${WORKLOADS:-short-c1 short-c64 rl}
ROUNDS=${ROUNDS:-2}
LOADGENS=${LOADGENS:-2}
LIMIT_S=${LIMIT_S:-480}
EXTRA_ARGS=${EXTRA_ARGS:-}
# shellcheck source=scripts/device_setup.sh
source "$(dirname "$0")/device_setup.sh"

# shellcheck disable=SC2086  # TARGETS, WORKLOADS and EXTRA_ARGS are lists
timeout -k 10 "$LIMIT_S" "$PYTHON" -m benchmarks.compare --layout dedicated --loadgens "$LOADGENS" \
    --targets $TARGETS --workloads $WORKLOADS --rounds "$ROUNDS" --timeout 60 --json "$OUT/compare.json" $EXTRA_ARGS \
    2>&1 | tee "$OUT/compare.txt"
