#!/usr/bin/env bash
# Training on one and on N GPUs of one host (N = GPUS, default: every GPU), written under $OUT (default ./out).
#   usage: [PRESETS="small qwen3-30b-a3b"] bash scripts/scaling.sh [bench] [curves]   (default: both)
# bench:  `moeblaze train --bench-steps` at a fixed per-GPU batch: one GPU without torchrun, then N GPUs under
#         torchrun with FSDP2 alone (ep 1) and with ep = N in both dispatch modes, for the small model's default
#         and the Qwen3-30B-A3B-shaped preset; one results row each ($OUT/results/<gpu>.jsonl, with the step split
#         from one profiled step on the N-GPU runs).
# curves: 50 steps of the small model on the same global batch: one GPU at N x the batch, N GPUs at ep 1 and ep N;
#         every step's loss in $OUT/curves/*.jsonl (plot: python scripts/plot_curves.py $OUT/curves).
# MOEBLAZE_GIT_SHA names the commit measured in the result rows; MANY_ARGS adds flags to the N-GPU runs (e.g.
# --fsdp-keep-gathered), ONE_ARGS to the one-GPU run.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/results" "$OUT/curves"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
N=${GPUS:-$(nvidia-smi -L | wc -l)}
steps=${*:-bench curves}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
one="python3 -m moeblaze.cli train"
many="torchrun --standalone --nproc-per-node $N -m moeblaze.cli train"
failed=""
run() { echo "+ $*"; "$@" 2>&1 | grep -v "it/s\]" | tail -${TAIL:-4}; local rc=${PIPESTATUS[0]}; [ $rc -ne 0 ] && failed="$failed [$*]"; }
for s in $steps; do
  echo "=== $s"
  case $s in
    bench)
      B="--bench-steps ${BENCH_STEPS:-10} --bench-warmup 3 --dtype bfloat16 --results $OUT/results"
      for preset in ${PRESETS:-small qwen3-30b-a3b}; do
        P="--preset $preset $B"
        [ $preset = qwen3-30b-a3b ] && P="$P --batch-size ${QWEN_BATCH:-2}"
        CUDA_VISIBLE_DEVICES=0 run $one $P ${ONE_ARGS:-}
        run $many $P ${MANY_ARGS:-} --bench-profile
        run $many $P ${MANY_ARGS:-} --bench-profile --ep $N
        run $many $P ${MANY_ARGS:-} --bench-profile --ep $N --ep-dispatch capacity
      done ;;
    curves)
      C="--steps 50 --eval-every 50 --dtype bfloat16 --seed 0"
      CUDA_VISIBLE_DEVICES=0 run $one $C --batch-size $((16 * N)) --loss-log $OUT/curves/gpu1.jsonl --save ""
      run $many $C --batch-size 16 --loss-log $OUT/curves/gpu${N}-ep1.jsonl --save ""
      run $many $C --batch-size 16 --ep $N --loss-log $OUT/curves/gpu${N}-ep${N}.jsonl --save "" ;;
    *) echo "unknown step $s"; failed="$failed $s" ;;
  esac
done
[ -n "$failed" ] && { echo "scaling.sh: failed:$failed"; exit 1; }
exit 0
