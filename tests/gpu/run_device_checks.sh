#!/usr/bin/env bash
# The GPU checks, on the lent GPU machine, from the repo root (see tests/gpu/README.md):
#   1. what the machine has (GPU, driver, Python packages);
#   2. the carried wheels (tests/gpu/wheels, filled by fetch_wheels.sh) installed into a target
#      folder put first on PYTHONPATH: the machine's torch, numpy, numba and pytest are reused
#      (a venv made from the machine's python, itself a venv, would not see them), and the
#      project is not pip-installed (its numpy<2 pin is for the Triton stub only);
#   3. pytest tests/gpu, JUnit XML and log into $OUT;
#   4. tests/gpu/gpu_report.py, JSON and log into $OUT.
# Every step has a timeout; the GPU is never reset. Exit status: 0 when tests and report passed.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-/tmp/kimi-gpu-checks}
CARRY=tests/gpu/wheels
SITE=/tmp/kimi-gpu-site
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

echo "== machine"
{
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
    timeout 60 "$PY" -c 'import sys, numpy, numba, torch; print(sys.version.split()[0], "torch", torch.__version__,
        "cuda", torch.version.cuda, torch.cuda.is_available(), "numpy", numpy.__version__, "numba", numba.__version__)'
} 2>&1 | tee "$OUT/machine.txt"

echo "== install carried wheels"
if ! ls "$CARRY"/*.whl >/dev/null 2>&1 || [ ! -f "$CARRY/corpus/MANIFEST.tsv" ]; then
    echo "no wheels or corpus in $CARRY: run tests/gpu/fetch_wheels.sh here and carry $CARRY" >&2
    exit 2
fi
rm -rf "$SITE"
timeout 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$CARRY"/*.whl \
    || { echo "pip install of the carried wheels failed" >&2; exit 3; }
export PYTHONPATH="$SITE:$PWD/backend_src"
export KIMI_PREP_CORPUS="$PWD/$CARRY/corpus"
export NUMBA_CACHE_DIR=/tmp/kimi-numba-cache
timeout 60 "$PY" -c 'import PIL, nvidia.nvimgcodec as c; print("pillow", PIL.__version__, "nvimgcodec", c.__version__,
    "cuda", c.__cuda_version__)' 2>&1 | tee -a "$OUT/machine.txt"

echo "== pytest tests/gpu"
# --confcutdir: only tests/gpu/conftest.py (the suite's top conftest may import what is not here).
timeout 180 "$PY" -m pytest tests/gpu -q -ra -p no:cacheprovider --confcutdir=tests/gpu --maxfail=25 \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== gpu_report.py"
timeout 180 "$PY" tests/gpu/gpu_report.py --out "$OUT/gpu_report.json" 2>&1 \
    | grep -v -e 'Corrupt JPEG data' -e 'pynvimgcodec' -e 'jpeg_parser' | tee "$OUT/gpu_report.log"
report_rc=${PIPESTATUS[0]}

echo "== pytest exit $tests_rc, report exit $report_rc (124: timed out)"
[ "$tests_rc" -eq 0 ] && [ "$report_rc" -eq 0 ]
