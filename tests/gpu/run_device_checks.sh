#!/usr/bin/env bash
# The GPU checks, on the lent GPU machine, from the repo root (see tests/gpu/README.md).
#
#   bash tests/gpu/run_device_checks.sh            # library checks; carry tests/gpu/wheels
#   bash tests/gpu/run_device_checks.sh served     # served checks;  carry tests/gpu/served
#   bash tests/gpu/run_device_checks.sh --dry-run  # here, in make test: pack + served checks on KIND_CPU
#
# Library checks:
#   1. what the machine has (GPU, driver, Python packages);
#   2. the carried wheels (tests/gpu/wheels, filled by fetch_wheels.sh) installed into a target
#      folder put first on PYTHONPATH: the machine's torch, numpy, numba and pytest are reused
#      (a venv made from the machine's python, itself a venv, would not see them), and the
#      project is not pip-installed (its numpy<2 pin is for the Triton stub only);
#   3. pytest tests/gpu, JUnit XML and log into $OUT;
#   4. tests/gpu/gpu_report.py, JSON and log into $OUT.
# Served checks (tests/gpu/served, filled here by tests/gpu/pack_served.py): the carried site and
# slimmed tritonserver unpacked into one folder put first on PYTHONPATH (numpy 1.26 for the 2.51
# stub), the 3.12 stub's libpython and numba's import checked, then tests/gpu/served_check.py
# --kind gpu: a KIND_GPU kimi_k25_vision over HTTP and gRPC, zero-copy, HBM, throughput.
# Every step has a timeout; the GPU is never reset. Exit status: 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/../.."

MODE=${1:-library}
OUT=${OUT:-/tmp/kimi-gpu-checks}
CARRY=tests/gpu/wheels
SITE=/tmp/kimi-gpu-site
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [ "$MODE" = "--dry-run" ]; then
    # Here, not on the device: the carry is packed and sized, then the served checks run against
    # the embedded tritonserver with KIND_CPU (no NVML, no HBM step), time-boxed.
    PY=${PYTHON:-.venv/bin/python}
    timeout 600 "$PY" tests/gpu/pack_served.py --out "$OUT/served" --preset 6 || exit 4
    timeout 300 env PYTHONPATH="$PWD/tests/gpu:${PYTHONPATH:-}" "$PY" tests/gpu/served_check.py --kind cpu \
        --out "$OUT" --budget-s 200 --seconds 3 --steps outputs zero_copy throughput
    exit $?
fi

if [ "$MODE" = "served" ]; then
    SERVED=tests/gpu/served
    SERVED_SITE=/tmp/kimi-served-site
    # Each run carries one tarball (the two and the work tree exceed one run's 64 MiB): unpack what
    # came, and run the check once both parts are unpacked on this (warm) machine.
    ls "$SERVED"/*.tar.xz >/dev/null 2>&1 \
        || { echo "no $SERVED/*.tar.xz: run tests/gpu/pack_served.py here and carry one of them" >&2; exit 2; }
    echo "== unpack the served carry"
    [ -f "$SERVED/site.tar.xz" ] && rm -rf "$SERVED_SITE"
    mkdir -p "$SERVED_SITE"
    for part in site tritonserver; do
        [ -f "$SERVED/$part.tar.xz" ] || continue
        timeout 120 tar -xJf "$SERVED/$part.tar.xz" -C "$SERVED_SITE" || { echo "unpacking $part failed" >&2; exit 3; }
        touch "$SERVED_SITE/.unpacked-$part"
    done
    for part in site tritonserver; do
        [ -f "$SERVED_SITE/.unpacked-$part" ] \
            || { echo "$part not unpacked yet: carry tests/gpu/served/$part.tar.xz in the next run" >&2; exit 5; }
    done
    export PYTHONPATH="$SERVED_SITE:$PWD/backend_src:$PWD/backend_src/server:$PWD/client:$PWD/client/common"
    export NUMBA_CACHE_DIR=/tmp/kimi-numba-cache
    {
        timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
        # The 3.12 stub links libpython3.12.so: the launcher puts the interpreter's LIBDIR on its path.
        timeout 60 "$PY" -c 'import sysconfig, os, numpy, numba, torch; d = sysconfig.get_config_var("LIBDIR");
print("libpython:", [f for f in os.listdir(d) if f.startswith("libpython3.12")], "numpy", numpy.__version__,
      "numba", numba.__version__, "torch", torch.__version__, torch.cuda.is_available())'
    } 2>&1 | tee "$OUT/machine.txt"
    timeout 420 "$PY" tests/gpu/served_check.py --kind gpu --out "$OUT" --budget-s 360 2>&1 | tee "$OUT/served_check.log"
    exit "${PIPESTATUS[0]}"
fi

echo "== machine"
{
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
    timeout 60 "$PY" -c 'import sys, numpy, numba, torch; print(sys.version.split()[0], "torch", torch.__version__,
        "cuda", torch.version.cuda, torch.cuda.is_available(), "numpy", numpy.__version__, "numba", numba.__version__)'
} 2>&1 | tee "$OUT/machine.txt"

echo "== install carried wheels"
if ! ls "$CARRY"/*.whl >/dev/null 2>&1; then
    echo "no wheels in $CARRY: run tests/gpu/fetch_wheels.sh here and carry $CARRY" >&2
    exit 2
fi
rm -rf "$SITE"
timeout 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$CARRY"/*.whl \
    || { echo "pip install of the carried wheels failed" >&2; exit 3; }
# The libjpeg extension built for 3.12 by fetch_wheels.sh (the exact GPU route reads coefficients
# with it): into this machine's copy of the package.
cp "$CARRY"/_libjpeg.cpython-312-*.so backend_src/kimi_vision_prep/ 2>/dev/null \
    || echo "no libjpeg extension in $CARRY: the exact GPU route sends every file to Pillow" >&2
export PYTHONPATH="$SITE:$PWD/backend_src:$PWD/client/common"
export NUMBA_CACHE_DIR=/tmp/kimi-numba-cache
timeout 60 "$PY" -c 'import PIL, nvidia.nvimgcodec as c; print("pillow", PIL.__version__, "nvimgcodec", c.__version__,
    "cuda", c.__cuda_version__)' 2>&1 | tee -a "$OUT/machine.txt"

echo "== pytest tests/gpu"
# --confcutdir: only tests/gpu/conftest.py (the suite's top conftest may import what is not here).
timeout 180 "$PY" -m pytest tests/gpu -q -ra -p no:cacheprovider --confcutdir=tests/gpu --maxfail=200 \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== gpu_report.py"
timeout 180 "$PY" tests/gpu/gpu_report.py --out "$OUT/gpu_report.json" 2>&1 \
    | grep -v -e 'Corrupt JPEG data' -e 'pynvimgcodec' -e 'jpeg_parser' | tee "$OUT/gpu_report.log"
report_rc=${PIPESTATUS[0]}

echo "== pytest exit $tests_rc, report exit $report_rc (124: timed out)"
[ "$tests_rc" -eq 0 ] && [ "$report_rc" -eq 0 ]
