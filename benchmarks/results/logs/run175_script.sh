#!/bin/bash
# Run 175: XLA options on decode blocks (main's code, d157669), one process each: XLA's own PDL
# for its fusions, Triton GEMM warp specialization, the command buffers' update mode.
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
E="-m benchmarks.e2e --profile --skip-prefill --no-baseline --batches 1 16 --top-kernels 80"
O=--decode-xla-option
for t in base pdl pdlboth ws skiptemp; do
  echo "== e2e $t"
  X=""
  [ $t = pdl ] && X="$O xla_gpu_enable_pdl=true"
  [ $t = pdlboth ] && X="$O xla_gpu_enable_pdl=true $O xla_gpu_enable_pdl_launch=true"
  [ $t = ws ] && X="$O xla_gpu_experimental_enable_triton_warp_specialization=true"
  [ $t = skiptemp ] && X="$O xla_gpu_command_buffer_update_mode=SKIP_TEMP"
  s=$SECONDS
  timeout 110 python3 $E $X --out $OUT/e2e_${t}.json 2>&1 | grep -v Warning | grep "Error" | tail -3
  echo "   ($((SECONDS - s)) s)"
done
python3 .run/cmp.py $OUT/e2e_*.json
