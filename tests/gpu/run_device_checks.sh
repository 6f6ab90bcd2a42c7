#!/usr/bin/env bash
# The GPU checks, on the lent GPU machine, from the repo root (see tests/gpu/README.md for the calls).
#
#   bash tests/gpu/run_device_checks.sh            # served checks (first): carry tests/gpu/served/site.tar.xz,
#                                                  #   then, on the same warm machine, tritonserver.tar.xz
#   bash tests/gpu/run_device_checks.sh library    # library checks (then): carry tests/gpu/served/site.tar.xz
#   bash tests/gpu/run_device_checks.sh --dry-run  # here, in make test: pack + served checks on KIND_CPU
#
# Everything carried comes from tests/gpu/pack_served.py (run here): site.tar.xz (nvImageCodec,
# nvJPEG, Pillow 13, simplejpeg, tritonclient, numpy 1.26, and the library's libjpeg extension
# built for CPython 3.12, which the exact GPU route reads coefficients with) and tritonserver.tar.xz.
# Both modes copy kimi_libjpeg/_libjpeg.cpython-312-*.so into backend_src/kimi_vision_prep/ and
# stop (exit 6) when it is missing or does not load: without it every JPEG would go to Pillow.
#
# Served checks: the carried site and slimmed tritonserver unpacked into one folder put first on
# PYTHONPATH (numpy 1.26 for the 2.51 stub), the 3.12 stub's libpython and numba's import checked,
# then tests/gpu/served_check.py --kind gpu: a KIND_GPU kimi_k25_vision over HTTP and gRPC (decode
# path coefficients-cuda and pixels equal to the CPU pipeline's), zero-copy, HBM, throughput.
# Library checks:
#   1. what the machine has (GPU, driver, Python packages);
#   2. site.tar.xz unpacked into a folder put first on PYTHONPATH, without its numpy: the machine's
#      torch, numpy, numba and pytest are reused (a venv made from the machine's python, itself a
#      venv, would not see them), and the project is not pip-installed (its numpy<2 pin is for the
#      Triton stub only);
#   3. pytest tests/gpu (the exact route's file first), JUnit XML and log into $OUT (stopped with
#      SIGINT at its guard, so the XML keeps what ran);
#   4. tests/gpu/gpu_report.py, JSON (rewritten after each section) and log into $OUT.
# Every step has a timeout; the GPU is never reset. Exit status: 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/../.."

MODE=${1:-served}
OUT=${OUT:-/tmp/kimi-gpu-checks}
SERVED=tests/gpu/served
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

# The cp312 libjpeg extension from an unpacked site.tar.xz into this machine's copy of the package.
install_libjpeg() {
    cp "$1"/kimi_libjpeg/_libjpeg.cpython-312-*.so backend_src/kimi_vision_prep/ \
        || { echo "no kimi_libjpeg/ in $1: rerun tests/gpu/pack_served.py here (the exact route needs it)" >&2; exit 6; }
    PYTHONPATH="$1:$PWD/backend_src:$PWD/client/common" timeout 60 "$PY" -c 'from kimi_vision_prep.decode import jpeg_bands as b
print("libjpeg extension:", b.libjpeg_path(), b.unavailable_reason() or ""); raise SystemExit(b.libjpeg_path() is None)' \
        2>&1 | tee -a "$OUT/machine.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "the libjpeg extension does not load: the exact route would not run" >&2; exit 6; }
}

if [ "$MODE" = "served" ]; then
    SERVED_SITE=/tmp/kimi-served-site
    # Each run carries one tarball (the two and the work tree exceed one run's 64 MiB): unpack what
    # came, and run the check once both parts are unpacked on this (warm) machine.
    ls "$SERVED"/*.tar.xz >/dev/null 2>&1 \
        || { echo "no $SERVED/*.tar.xz: run tests/gpu/pack_served.py here and carry one of them" >&2; exit 2; }
    [ -f "$SERVED/site.tar.xz" ] && rm -rf "$SERVED_SITE"
    mkdir -p "$SERVED_SITE"
    for part in site tritonserver; do
        [ -f "$SERVED/$part.tar.xz" ] || continue
        echo "== unpack $part"
        timeout 60 tar -xJf "$SERVED/$part.tar.xz" -C "$SERVED_SITE" || { echo "unpacking $part failed" >&2; exit 3; }
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
        timeout 30 "$PY" -c 'import sysconfig, os, numpy, numba, torch; d = sysconfig.get_config_var("LIBDIR");
print("libpython:", [f for f in os.listdir(d) if f.startswith("libpython3.12")], "numpy", numpy.__version__,
      "numba", numba.__version__, "torch", torch.__version__, torch.cuda.is_available())'
    } 2>&1 | tee "$OUT/machine.txt"
    install_libjpeg "$SERVED_SITE"
    timeout 330 "$PY" tests/gpu/served_check.py --kind gpu --out "$OUT" --budget-s 300 2>&1 | tee "$OUT/served_check.log"
    exit "${PIPESTATUS[0]}"
fi

[ "$MODE" = library ] || { echo "usage: run_device_checks.sh [served|library|--dry-run]" >&2; exit 2; }
echo "== machine"
{
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
    timeout 60 "$PY" -c 'import sys, numpy, numba, torch; print(sys.version.split()[0], "torch", torch.__version__,
        "cuda", torch.version.cuda, torch.cuda.is_available(), "numpy", numpy.__version__, "numba", numba.__version__)'
} 2>&1 | tee "$OUT/machine.txt"

echo "== unpack the carried site"
[ -f "$SERVED/site.tar.xz" ] \
    || { echo "no $SERVED/site.tar.xz: run tests/gpu/pack_served.py here and carry it" >&2; exit 2; }
rm -rf "$SITE" && mkdir -p "$SITE"
timeout 60 tar -xJf "$SERVED/site.tar.xz" -C "$SITE" || { echo "unpacking site.tar.xz failed" >&2; exit 3; }
rm -rf "$SITE"/numpy "$SITE"/numpy.libs  # numpy 1.26 is the Triton stub's: here the machine's numpy 2
install_libjpeg "$SITE"
export PYTHONPATH="$SITE:$PWD/backend_src:$PWD/client/common"
export NUMBA_CACHE_DIR=/tmp/kimi-numba-cache
timeout 60 "$PY" -c 'import PIL, nvidia.nvimgcodec as c; print("pillow", PIL.__version__, "nvimgcodec", c.__version__,
    "cuda", c.__cuda_version__)' 2>&1 | tee -a "$OUT/machine.txt"

echo "== pytest tests/gpu"
# --confcutdir: only tests/gpu/conftest.py (the suite's top conftest may import what is not here).
# The exact route's tests first; SIGINT at the guard lets pytest write the JUnit XML of what ran.
timeout -s INT -k 15 140 "$PY" -m pytest tests/gpu/test_gpu_exact_route.py tests/gpu -q -ra -p no:cacheprovider --confcutdir=tests/gpu --maxfail=200 \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== gpu_report.py"
timeout 110 "$PY" tests/gpu/gpu_report.py --out "$OUT/gpu_report.json" 2>&1 \
    | grep -v -e 'Corrupt JPEG data' -e 'pynvimgcodec' -e 'jpeg_parser' | tee "$OUT/gpu_report.log"
report_rc=${PIPESTATUS[0]}

echo "== pytest exit $tests_rc (2: stopped at its guard), report exit $report_rc (124: timed out)"
[ "$tests_rc" -eq 0 ] && [ "$report_rc" -eq 0 ]
