#!/usr/bin/env bash
# One GPU session: the GPU tests, then the benchmark; everything is written under $OUT (default ./out).
#   usage: bash tools/gpu.sh [tests] [dispatch] [layer] [scale] [profile] [ab] [rounding] [quality] [fp8train]
#          [fp8roof]
#   (default: the first five)
# Exits non-zero when any step fails (each step still runs). STEP_TIMEOUT=SECONDS bounds each step, so the
# peers' compile cache below is still written back when one runs long.
# Peers: with .peers/ (SonicMoE's and Liger's wheels, and an activate.sh that puts them on the path) beside the
# code, SonicMoE and Liger join the run.
# TRITON_TARBALL=.whl/triton-...-stripped.tar.xz (tools/pack_triton.sh; carry .whl) runs everything on that triton.
# ab: tools/ab_compare.py against .baseline/moeblaze_base (bash tools/make_baseline.sh REV; carry .baseline),
#     AB_ARGS passed on (e.g. "--configs D,E --backends auto"). profile: PROFILE_CONFIGS (L,d,h,E,K ...) and
#     PROFILE_ARGS (e.g. "--precision fp8 --no-compare").
# SonicMoE's compiled kernels: .peers/quack_cache.tar.xz, where present, seeds its cache before the steps, and
# the cache is written back to $OUT/quack_cache.tar.xz after them (copy it to .peers/ to spare the next
# machine the compile).
# tests: GPU_TESTS (files, default tests/gpu) and PYTEST_K narrow the run: the whole suite takes over one
# 10-minute call, e.g. GPU_TESTS="tests/gpu/test_gpu.py tests/gpu/test_routing_gpu.py" then the other files.
# Our own compiled kernels: .cache/triton_cache.tar.xz, where present, seeds Triton's cache (TRITON_CACHE_DIR)
# before the steps, and the whole cache goes back to $OUT/triton_cache.tar.xz (copy it to .cache/ and carry .cache:
# a bare machine otherwise compiles every kernel again, minutes of a run; kernels of old sources stay in it, so
# start it afresh when it outgrows what a run can carry beside .peers).
# MOEBLAZE_GIT_SHA names the commit measured in the result rows; set it where the checkout is a copy whose
# git history may be older than its files.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export LIGER_FUSED_MOE_AUTOTUNE=${LIGER_FUSED_MOE_AUTOTUNE:-0}
export QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-8}  # SonicMoE compiles its GEMM configs in this many processes: 8, its default (16 never finished a cold compile on an H100)
[ -f .peers/activate.sh ] && source .peers/activate.sh
# TRITON_TARBALL: a triton packed by tools/pack_triton.sh, used instead of the machine's own
if [ -n "${TRITON_TARBALL:-}" ]; then
  mkdir -p /tmp/triton-pkg && tar xJf "$TRITON_TARBALL" -C /tmp/triton-pkg
  export PYTHONPATH=/tmp/triton-pkg:$PYTHONPATH TRITON_BACKENDS_IN_TREE=1 TRITON_DEFAULT_FP_FUSION=1 \
         TRITON_PTXAS_BLACKWELL_PATH=/tmp/triton-pkg/triton/backends/nvidia/bin/ptxas
fi
steps=${*:-tests dispatch layer scale profile}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/moeblaze-triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .cache/triton_cache.tar.xz ] && tar xJf .cache/triton_cache.tar.xz -C "$TRITON_CACHE_DIR"
quack_tmp=$(python3 -c "import getpass, tempfile; print(tempfile.gettempdir() + '/' + getpass.getuser())")
[ -f .peers/quack_cache.tar.xz ] && mkdir -p "$quack_tmp" && tar xJf .peers/quack_cache.tar.xz -C "$quack_tmp"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
failed=""
limit=${STEP_TIMEOUT:+timeout $STEP_TIMEOUT}
for s in $steps; do
  echo "=== $s"
  case $s in
    tests) $limit python3 -m pytest -m gpu ${GPU_TESTS:-tests/gpu} -p no:logging --durations=20 ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/tests.log" ;;
    dispatch) $limit python3 -m moeblaze.cli bench --dispatch --out "$OUT" ;;
    layer) $limit python3 -m moeblaze.cli bench ${BENCH_ARGS:-} --out "$OUT" && python3 benchmarks/report.py "$OUT" --plot ;;
    scale) $limit python3 -m moeblaze.cli bench --scale --impls ${SCALE_IMPLS:-moeblaze,torch_gmm,sonicmoe} --out "$OUT" \
             && python3 benchmarks/report.py "$OUT" --plot ;;
    rounding) $limit python3 benchmarks/experiments/rounding/rounding_bench.py --out "$OUT" ${ROUNDING_ARGS:-} ;;
    quality|fp8train)  # scripts/train_compare.py's routing or fp8 study, its logs packed into one archive
             study=$([ $s = quality ] && echo routing || echo fp8)
             $limit python3 scripts/train_compare.py run --study $study --out "$OUT/$study-training" ${QUALITY_ARGS:-}
             r=$?; tar czf "$OUT/$study-training.tar.gz" -C "$OUT" $study-training && rm -rf "$OUT/$study-training"
             (exit $r) ;;
    fp8roof) $limit python3 benchmarks/experiments/fp8/fp8_roofline.py --out "$OUT" ${FP8ROOF_ARGS:-} ;;
    ab) $limit python3 tools/ab_compare.py ${AB_ARGS:-} 2>&1 | tee "$OUT/ab.log" ;;
    profile) for c in ${PROFILE_CONFIGS:-8192,1024,4096,16,2}; do IFS=, read L d h E K <<< "$c"; python3 -m moeblaze.cli profile --kernels --tokens $L --d-model $d --d-expert $h --num-experts $E --top-k $K ${PROFILE_ARGS:-} || exit 1; done 2>&1 | tee "$OUT/profile.log" ;;
    *) echo "unknown step $s"; false ;;
  esac
  rc=$?
  [ $rc -ne 0 ] && failed="$failed $s"
done
if [ -d "$quack_tmp/quack_cache" ]; then tar cJf "$OUT/quack_cache.tar.xz" -C "$quack_tmp" quack_cache; fi
tar cJf "$OUT/triton_cache.tar.xz" -C "$TRITON_CACHE_DIR" . || true
[ -n "$failed" ] && { echo "gpu.sh: failed steps:$failed"; exit 1; }
exit 0
