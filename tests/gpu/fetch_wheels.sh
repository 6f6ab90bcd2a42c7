#!/usr/bin/env bash
# Fill tests/gpu/wheels/ (git-ignored) with what the GPU checks need on the device machine, which
# has no network and no ../shared: the wheels it lacks, and a copy of the test corpus.
#
#   bash tests/gpu/fetch_wheels.sh      # then see tests/gpu/README.md for the device run
#
# The machine brings Python 3.12, torch (CUDA 13.0), numpy 2, numba and pytest. Carried:
#   nvidia-nvimgcodec-cu13  nvImageCodec (its CUDA 13 build)
#   nvidia-nvjpeg           nvJPEG for CUDA 13, 13.0.x to match the machine's CUDA 13.0 driver
#   pillow==13.0.0          the reference build (the machine's Pillow may be another version)
#   simplejpeg==1.9.0       the CPU fast route decode.py imports
set -euo pipefail
cd "$(dirname "$0")/../.."

DEST=tests/gpu/wheels
LIMIT_MIB=60  # the device run carries at most 64 MiB with the work tree
WHEELS=(nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.0.4.44 pillow==13.0.0 simplejpeg==1.9.0)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
PYTHON=${PYTHON:-.venv/bin/python}
CORPUS=${KIMI_PREP_CORPUS:-../shared/corpus}

mkdir -p "$DEST"
rm -rf "$DEST"/*.whl "$DEST/corpus"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d "$DEST" "${WHEELS[@]}"
cp -r "$CORPUS" "$DEST/corpus"

du -h "$DEST"/*.whl "$DEST/corpus" | sed 's/^/  /'
total_mib=$(( $(du -sb "$DEST" | cut -f1) / 1048576 ))
echo "total: ${total_mib} MiB in $DEST (limit ${LIMIT_MIB} MiB)"
if (( total_mib > LIMIT_MIB )); then
    echo "FAIL: $DEST is over ${LIMIT_MIB} MiB" >&2
    exit 1
fi
