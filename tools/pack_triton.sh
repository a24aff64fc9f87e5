#!/usr/bin/env bash
# Packs a triton wheel small enough to carry to a machine that cannot install from a registry (64 MB):
# the wheel unpacked, libtriton.so stripped of its debug info, and the parts an NVIDIA Hopper run never
# loads removed (the AMD backend, the Blackwell ptxas, CUPTI and proton's profiler libraries), then xz.
# triton 3.9.0 for CPython 3.12: 286 MB wheel -> 54 MB.
#   usage: bash tools/pack_triton.sh [VERSION] [PYTHON_VERSION]      (default 3.9.0 3.12)
#   output: .whl/triton-VERSION-cpXY-stripped.tar.xz
# To use it there (tools/gpu.sh does this when TRITON_TARBALL names the file):
#   mkdir -p /tmp/triton-pkg && tar xJf FILE -C /tmp/triton-pkg
#   export PYTHONPATH=/tmp/triton-pkg:$PYTHONPATH TRITON_BACKENDS_IN_TREE=1 \
#          TRITON_PTXAS_BLACKWELL_PATH=/tmp/triton-pkg/triton/backends/nvidia/bin/ptxas
# (triton >= 3.9 compiles sm_90 with the ptxas it calls ptxas-blackwell; the CUDA 12.9 ptxas kept here serves.
# TRITON_BACKENDS_IN_TREE skips the installed triton's entry points, which name the removed AMD backend.)
set -euo pipefail
version=${1:-3.9.0}
py=${2:-3.12}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip download "triton==$version" --python-version "$py" --only-binary=:all: --no-deps \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$work" -q
mkdir "$work/pkg"
python3 -m zipfile -e "$work"/triton-*.whl "$work/pkg"
t="$work/pkg/triton"
strip "$t/_C/libtriton.so"
rm -rf "$t/backends/amd" "$t/backends/nvidia/bin/ptxas-blackwell" "$t/backends/nvidia/lib/cupti" \
  "$t/backends/nvidia/lib/cupti-blackwell" "$t/_C/libproton.so" "$t/instrumentation/libGPUInstrumentationTestLib.so"
chmod +x "$t"/backends/nvidia/bin/*
mkdir -p .whl
out=".whl/triton-$version-cp${py/./}-stripped.tar.xz"
tar cf - -C "$work/pkg" . | xz -9 -T0 > "$out"
ls -la "$out"
