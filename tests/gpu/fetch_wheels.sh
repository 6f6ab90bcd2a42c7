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

du -h "$DEST"/*.whl | sed 's/^/  /'
# A device run carries at most 64 MiB: the work tree (the test corpus included) and this folder.
tree_bytes=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
carry_bytes=$(du -sb "$DEST" | cut -f1)
total_mib=$(( (tree_bytes + carry_bytes) / 1048576 ))
echo "$DEST $(( carry_bytes / 1048576 )) MiB + work tree $(( tree_bytes / 1048576 )) MiB = ${total_mib} of 64 MiB"
if (( tree_bytes + carry_bytes > 64 * 1048576 )); then
    echo "FAIL: a run would carry more than 64 MiB" >&2
    exit 1
fi
