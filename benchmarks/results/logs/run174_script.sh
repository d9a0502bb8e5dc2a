#!/bin/bash
# Run 174: the split merge as one variadic reduction and RoPE's cos/sin inside rope_append,
# against HEAD (d157669): e2e B=1/16 one process a tree; then the new tree with XLA options
# on decode blocks: concurrent command-buffer scheduling, Triton GEMMs with TMA, and with
# TMA and warp specialization.
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm --format=csv
E="-m benchmarks.e2e --profile --skip-prefill --no-baseline --batches 1 16 --top-kernels 80"
O=--decode-xla-option
for t in head new conc tma tmaws; do
  echo "== e2e $t"
  X=""; d=$PWD
  [ $t = head ] && d=$PWD/.run/head
  [ $t = conc ] && X="$O xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
  [ $t = tma ] && X="$O xla_gpu_experimental_enable_triton_tma=true"
  [ $t = tmaws ] && X="$O xla_gpu_experimental_enable_triton_tma=true $O xla_gpu_experimental_enable_triton_warp_specialization=true"
  s=$SECONDS
  (cd $d && PYTHONPATH=$d timeout 110 python3 $E $X --out $OUT/e2e_${t}.json 2>&1 | grep -v Warning | grep -A1 "^kind\|Error" | tail -6)
  echo "   ($((SECONDS - s)) s)"
done
python3 .run/cmp.py $OUT/e2e_*.json
