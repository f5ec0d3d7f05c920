#!/usr/bin/env bash
# The device check in one command on a lent GPU machine (it has no network):
#
#   bash benchmarks/device_check.sh --out "$OUT/device-check-output.txt"     # any device_check.py options
#
# 1. wheels carried in .whl/ (if any: pydantic & co., megatron-core; docs/device-check.md) are installed into
#    /tmp/het-device-check-site, without an index and without dependencies, and put on PYTHONPATH;
# 2. het_plugin is installed editable, offline (that puts the het_plugin_megatron.pth import hook into
#    site-packages, as `pip install` does for users); if that fails the checkout is used from PYTHONPATH and
#    part 1's launcher installs the same hook itself (it says so in its output). DEVICE_CHECK_NO_INSTALL=1
#    skips this step;
# 3. benchmarks/device_check.py runs with python3 (or $PYTHON) under a hard timeout (DEVICE_CHECK_TIMEOUT,
#    default 540 s; the parts themselves stop at --budget, 450 s by default).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=/tmp/het-device-check-site
if compgen -G ".whl/*.whl" >/dev/null; then
    echo "device_check.sh: installing $(ls .whl/*.whl | wc -l) carried wheel(s) into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || echo "device_check.sh: installing the carried wheels failed (continuing without them)"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "${DEVICE_CHECK_NO_INSTALL:-0}" = 0 ]; then
    if "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/het-device-check-pip.log 2>&1; then
        echo "device_check.sh: het_plugin installed (editable, offline): the import hook .pth is in site-packages"
    else
        echo "device_check.sh: offline editable install of het_plugin failed (last lines below); using the checkout"
        echo "                 from PYTHONPATH, part 1 installs the import hook itself"
        tail -n 3 /tmp/het-device-check-pip.log | sed 's/^/    /'
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --kill-after=15 "${DEVICE_CHECK_TIMEOUT:-540}" "$PY" -u benchmarks/device_check.py "$@"
