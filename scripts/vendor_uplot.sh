#!/usr/bin/env bash
# Vendor uPlot (MIT), the dashboard's charting library, from its npm package into gateway/assets/dashboard/vendor/:
# the gateway serves it itself, so the page needs no network at run time. Rerun after changing VERSION and commit
# the result (three small text files).
#
#   scripts/vendor_uplot.sh
set -euo pipefail

VERSION=1.6.32
HERE=$(cd "$(dirname "$0")/.." && pwd)
DEST=$HERE/gateway/assets/dashboard/vendor
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

(cd "$WORK" && npm pack --silent "uplot@$VERSION" >/dev/null)
tar -xzf "$WORK/uplot-$VERSION.tgz" -C "$WORK"
mkdir -p "$DEST"
cp "$WORK/package/dist/uPlot.iife.min.js" "$WORK/package/dist/uPlot.min.css" "$DEST/"
cp "$WORK/package/LICENSE" "$DEST/uPlot.LICENSE"
echo "$VERSION" >"$DEST/uPlot.VERSION"
ls -l "$DEST"
