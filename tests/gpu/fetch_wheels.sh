#!/usr/bin/env bash
# Fill tests/gpu/wheels/ (git-ignored) with what the GPU checks need on the device machine, which
# has no network: the wheels it lacks (the test corpus travels with the work tree, tests/data/corpus).
#
#   bash tests/gpu/fetch_wheels.sh      # then see tests/gpu/README.md for the device run
#
# The machine brings Python 3.12, torch (CUDA 13.0), numpy 2, numba and pytest. Carried:
#   nvidia-nvimgcodec-cu13  nvImageCodec (its CUDA 13 build)
#   nvidia-nvjpeg           nvJPEG for CUDA 13, 13.0.x to match the machine's CUDA 13.0 driver
#   pillow==13.0.0          the reference build (the machine's Pillow may be another version)
#   simplejpeg==1.9.0       the CPU fast route decode/routes.py imports
#   _libjpeg.cpython-312-x86_64-linux-gnu.so  the library's libjpeg extension built here for CPython 3.12
#                           (setup.py's sources and flags; it binds Pillow's libjpeg at run time): the
#                           exact GPU route reads coefficients with it, and the machine has no compiler
#                           headers for it (PYTHON312: a 3.12 interpreter here, for its headers)
set -euo pipefail
cd "$(dirname "$0")/../.."

DEST=tests/gpu/wheels
WHEELS=(nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.0.4.44 pillow==13.0.0 simplejpeg==1.9.0)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
PYTHON=${PYTHON:-.venv/bin/python}

mkdir -p "$DEST"
rm -rf "$DEST"/*.whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d "$DEST" "${WHEELS[@]}"

PY312=${PYTHON312:-}
for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    [ -z "$PY312" ] && "$candidate" -c '' 2>/dev/null && PY312=$candidate
done
[ -n "$PY312" ] || { echo "FAIL: no python3.12 here to build the libjpeg extension for the machine" >&2; exit 1; }
rm -f "$DEST"/_libjpeg.*.so
SRC=backend_src/kimi_vision_prep/decode/libjpeg
gcc -shared -fPIC -O2 -std=c11 -I"$("$PY312" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    "$SRC"/{module,binding,decode,bands,restart,coefficients}.c -ldl -lpthread \
    -o "$DEST/_libjpeg.cpython-312-x86_64-linux-gnu.so"

du -h "$DEST"/*.whl "$DEST"/*.so | sed 's/^/  /'
# A device run carries at most 64 MiB: the work tree (the test corpus included) and this folder.
tree_bytes=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
carry_bytes=$(du -sb "$DEST" | cut -f1)
total_mib=$(( (tree_bytes + carry_bytes) / 1048576 ))
echo "$DEST $(( carry_bytes / 1048576 )) MiB + work tree $(( tree_bytes / 1048576 )) MiB = ${total_mib} of 64 MiB"
if (( tree_bytes + carry_bytes > 64 * 1048576 )); then
    echo "FAIL: a run would carry more than 64 MiB" >&2
    exit 1
fi
