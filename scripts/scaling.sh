#!/usr/bin/env bash
# Training on one and on N GPUs of one host (N = GPUS, default: every GPU; GPUS="2 4 8" benches each N, the other
# steps the largest), written under $OUT (default ./out).
#   usage: [PRESETS="small qwen3-30b-a3b"] bash scripts/scaling.sh [bench] [curves] [graph] [titan] [report]
#          (default: bench curves report)
#          [RANKS="2 4 8"] bash scripts/scaling.sh cpu
# bench:  `moeblaze train --bench-steps` at a fixed per-GPU batch: one GPU without torchrun, then N GPUs under
#         torchrun with FSDP2 alone (ep 1; for the small model also as one FSDP2 unit, --fsdp-units model) and
#         with ep = N in both dispatch modes, for the small model's default
#         and the Qwen3-30B-A3B-shaped preset (PRESETS may add deepseek-v3-layer: no one-GPU run, since it fits
#         none; DSV3_BATCH, default 1); one results row each ($OUT/results/<gpu>.jsonl, with the step split
#         from one profiled step on the N-GPU runs); REPEATS (default 1) runs of each launch.
# curves: 50 steps of the small model on the same global batch: one GPU at N x the batch, N GPUs at ep 1 and ep N;
#         every step's loss in $OUT/curves/*.jsonl (plot: python scripts/plot_curves.py $OUT/curves).
# graph:  --cuda-graph on the small model beside the eager step (bench rows), and 20 steps' loss logs of each
#         launch with and without it, compared byte for byte. With one GPU (GPUS=1) the ep launches are left out
#         and torchrun's are FSDP2 on a one-rank group: FSDP2's own cost beside the plain one-GPU step.
# titan:  benchmarks/torchtitan_train.py, torchtitan's Qwen3-30B-A3B flavor cut to TITAN_LAYERS (default 4) layers,
#         seq 4096, TITAN_BATCH (default 4) sequences per GPU: one GPU, then each N > 1 of GPUS under torchrun
#         with FSDP2 (TITAN_FSDP: further FSDP2 runs, their flags separated by ";", e.g. "--keep-gathered;--reduce-dtype
#         bfloat16": each block's weights gathered once a step; gradients reduced in bf16) and with
#         torchtitan's expert parallelism, torchtitan's experts ("default") beside moeblaze's
#         (TITAN_VARIANTS, default preact; under EP also preact+exact, moeblaze's own EP on torchtitan's mesh) in
#         each call, every run followed by one profiled step (its GEMM and communication split, exposed comm); rows
#         in $OUT/results/titan.jsonl, the table in $OUT/titan.md, the plot in $OUT/titan.png.
# report: the table of every results row written under $OUT (medians over repeats; efficiency against the one-GPU
#         run) in $OUT/scaling.md, and the plot, tokens/s per GPU and efficiency against N, in $OUT/scaling.png.
# cpu:    no GPU needed: a tiny model on CPU processes (gloo, the kernels under Triton's interpreter) at each N in
#         RANKS (default "2 4 8") with FSDP2 alone, ep = N exact and ep = N capacity (a capacity too small, so a
#         step is rerun), against one process over the same global batch; fails unless every loss equals it
#         (rows in $OUT/results/cpu.jsonl, the table in $OUT/ranks.txt). E = 8 experts: one per rank at N = 8.
#         Then a sharded checkpoint written at the largest N with ep = N resumes at N/2 (ep N/2, and FSDP2
#         alone) and in one process, each with the same final validation loss ($OUT/resume.log).
# MOEBLAZE_GIT_SHA names the commit measured in the result rows; MANY_ARGS adds flags to the N-GPU runs (e.g.
# --fsdp-keep-gathered), ONE_ARGS to the one-GPU run.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/results" "$OUT/curves"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=${*:-bench curves report}
if [ "$steps" = cpu ]; then N=1; else
  NS=${GPUS:-$(nvidia-smi -L | wc -l)}
  N=$(echo $NS | tr ' ' '\n' | sort -n | tail -1)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
one="python3 -m moeblaze.cli train"
on() { echo "torchrun --standalone --nproc-per-node $1 -m moeblaze.cli train"; }
many=$(on $N)
failed=""
run() { echo "+ $*"; "$@" 2>&1 | grep -v "it/s\]" | tail -${TAIL:-4}; local rc=${PIPESTATUS[0]}; [ $rc -ne 0 ] && failed="$failed [$*]"; }
runs() { for _ in $(seq ${REPEATS:-1}); do run "$@"; done; }
for s in $steps; do
  echo "=== $s"
  case $s in
    bench)
      B="--bench-steps ${BENCH_STEPS:-10} --bench-warmup 3 --dtype bfloat16 --results $OUT/results"
      for preset in ${PRESETS:-small qwen3-30b-a3b}; do
        P="--preset $preset $B"
        [ $preset = qwen3-30b-a3b ] && P="$P --batch-size ${QWEN_BATCH:-2}"
        [ $preset = deepseek-v3-layer ] && P="$P --batch-size ${DSV3_BATCH:-1}"
        # deepseek-v3-layer's fp32 weights and AdamW states (185 GB) fit no single GPU: no one-GPU run
        [ $preset != deepseek-v3-layer ] && CUDA_VISIBLE_DEVICES=0 runs $one $P ${ONE_ARGS:-}
        for n in $NS; do
          m=$(on $n)
          runs $m $P ${MANY_ARGS:-} --bench-profile
          [ $preset = small ] && runs $m $P ${MANY_ARGS:-} --bench-profile --fsdp-units model
          if [ $n -gt 1 ]; then  # expert parallelism needs two ranks or more
            runs $m $P ${MANY_ARGS:-} --bench-profile --ep $n
            runs $m $P ${MANY_ARGS:-} --bench-profile --ep $n --ep-dispatch capacity
          fi
        done
      done ;;
    curves)
      C="--steps 50 --eval-every 50 --dtype bfloat16 --seed 0"
      CUDA_VISIBLE_DEVICES=0 run $one $C --batch-size $((16 * N)) --loss-log $OUT/curves/gpu1.jsonl --save ""
      run $many $C --batch-size 16 --loss-log $OUT/curves/gpu${N}-ep1.jsonl --save ""
      run $many $C --batch-size 16 --ep $N --loss-log $OUT/curves/gpu${N}-ep${N}.jsonl --save "" ;;
    graph)
      # --cuda-graph: the small model's step replayed from a CUDA graph, timed beside the eager step in this run
      # (one GPU and N GPUs as one FSDP2 unit), then per-block units and ep N (capacity, an overflow dropped and counted);
      # then each launch's 20 steps with and without it: the loss logs (losses, gradient norms, validation
      # losses) must be equal, byte for byte
      B="--preset small --bench-steps ${BENCH_STEPS:-10} --bench-warmup 3 --dtype bfloat16 --results $OUT/results"
      G="--cuda-graph"
      EPC="--ep $N --ep-dispatch capacity --capacity-factor 2 --on-overflow drop"
      CUDA_VISIBLE_DEVICES=0 run $one $B
      CUDA_VISIBLE_DEVICES=0 run $one $B $G
      run $many $B --bench-profile --fsdp-units model
      run $many $B --bench-profile --fsdp-units model $G
      run $many $B --bench-profile $G
      [ $N -gt 1 ] && run $many $B --bench-profile $EPC $G
      mkdir -p "$OUT/graph"
      C="--steps 20 --eval-every 10 --dtype bfloat16 --seed 0 --save="
      i=0
      launches=("CUDA_VISIBLE_DEVICES=0 $one" "$many --fsdp-units model" "$many")
      [ $N -gt 1 ] && launches+=("$many $EPC")  # expert parallelism needs two ranks or more
      for launch in "${launches[@]}"; do
        i=$((i + 1))
        run env $launch $C --loss-log "$OUT/graph/$i-eager.jsonl"
        run env $launch $C $G --loss-log "$OUT/graph/$i-graph.jsonl"
        if cmp -s "$OUT/graph/$i-eager.jsonl" "$OUT/graph/$i-graph.jsonl" && [ -s "$OUT/graph/$i-eager.jsonl" ]; then
          echo "graphed = eager, bitwise: $launch"
        else
          echo "graphed != eager: $launch"; failed="$failed [graph equality: $launch]"
        fi
      done ;;
    cpu)
      export TRITON_INTERPRET=1 OMP_NUM_THREADS=1
      T="--seq-len 16 --d-model 32 --n-layers 1 --n-heads 2 --num-experts 8 --d-expert 32 --impl triton
         --aux-loss-coef 0 --bench-steps 3 --bench-warmup 1 --results $OUT/results"
      rm -f "$OUT/results/cpu.jsonl"
      for n in ${RANKS:-2 4 8}; do
        m="python3 -m torch.distributed.run --standalone --nproc-per-node $n -m moeblaze.cli train $T --batch-size 2"
        run python3 -m moeblaze.cli train $T --batch-size $((2 * n))
        run $m
        run $m --ep $n
        run $m --ep $n --ep-dispatch capacity --capacity-factor 0.25
      done
      python3 - "$OUT/results/cpu.jsonl" <<'PY' | tee "$OUT/ranks.txt" || failed="$failed [cpu losses]"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{'ranks':>5} {'ep':>3} {'dispatch':>9} {'capacity':>8} {'loss':>10} {'one process':>11}")
bad = 0
for i in range(0, len(rows), 4):
    one, *many = rows[i:i + 4]
    for r in many:
        ok = abs(r["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"])
        bad += not ok
        print(f"{r['world']:>5} {r['ep']:>3} {r['dispatch'] or '-':>9} {r.get('capacity') or '-':>8} "
              f"{r['loss']:>10.6f} {one['loss']:>11.6f}{'' if ok else '  DIFFERS'}")
sys.exit(1 if bad or not rows else 0)
PY
      # a sharded checkpoint written by the most ranks (ep = N) resumes on fewer, and in one process: the same
      # final validation loss everywhere
      n=$(echo ${RANKS:-2 4 8} | tr ' ' '\n' | sort -n | tail -1)
      ck="$OUT/ck-ranks"; rm -rf "$ck"
      R="--seq-len 16 --d-model 32 --n-layers 1 --n-heads 2 --num-experts 8 --d-expert 32 --impl triton
         --aux-loss-coef 0 --steps 4 --eval-every 4 --eval-batches 2 --batch-size 2 --save $ck"
      # (the same global batch of 2N everywhere: the validation batches are drawn from it)
      for launch in "--nproc-per-node $n --ep $n" "--nproc-per-node $((n / 2)) --ep $((n / 2)) --resume --batch-size 4" \
                    "--nproc-per-node $((n / 2)) --resume --batch-size 4" "--nproc-per-node 1 --resume --batch-size $((2 * n))"; do
        read -r a b rest <<< "$launch"
        TAIL=2 run python3 -m torch.distributed.run --standalone $a $b -m moeblaze.cli train $R $rest
      done 2>&1 | tee "$OUT/resume.log"
      vals=$(grep -o "final validation loss [0-9.]*" "$OUT/resume.log" | sort -u | wc -l)
      runs=$(grep -c "final validation loss" "$OUT/resume.log")
      echo "resume across world sizes: $runs runs, $vals distinct final validation losses"
      [ "$runs" -eq 4 ] && [ "$vals" -eq 1 ] || failed="$failed [resume across world sizes]"
      ;;
    titan)
      V="default,${TITAN_VARIANTS:-preact}"
      T="--model qwen3-30b-a3b --layers ${TITAN_LAYERS:-4} --seq 4096 --batch ${TITAN_BATCH:-4} --steps ${TITAN_STEPS:-10}
         --results $OUT/results/titan.jsonl --comm-split"
      CUDA_VISIBLE_DEVICES=0 run python3 benchmarks/torchtitan_train.py $T --variants $V
      for n in $NS; do
        [ $n -gt 1 ] || continue
        t="torchrun --standalone --nproc-per-node $n benchmarks/torchtitan_train.py $T"
        run $t --variants $V
        IFS=";" read -ra extra <<< "${TITAN_FSDP:-}"
        for flags in "${extra[@]}"; do run $t $flags --variants $V; done
        run $t --ep $n --variants "$V,${TITAN_VARIANTS:-preact}+exact"
      done
      python3 scripts/scaling_report.py --titan "$OUT/results/titan.jsonl" --png "$OUT/titan.png" | tee "$OUT/titan.md" ;;
    report)
      for f in "$OUT"/results/*.jsonl; do
        [ "$(basename "$f")" = cpu.jsonl ] || [ "$(basename "$f")" = titan.jsonl ] && continue
        python3 scripts/scaling_report.py "$f" --png "$OUT/scaling.png" | tee "$OUT/scaling.md" \
          || failed="$failed [report $f]"
      done ;;
    *) echo "unknown step $s"; failed="$failed $s" ;;
  esac
done
[ -n "$failed" ] && { echo "scaling.sh: failed:$failed"; exit 1; }
exit 0
