#!/bin/bash
# Run 169 (next session): where a B=16 decode call's time goes (the in-kernel trace of 128
# items), then run 168's two block-step trims apart (.run/trim_dus: the rows written by
# dynamic_update_slice; .run/trim_pred: the loop predicate computed in the body), which
# together made e2e's window check fail on the GPU ("144 tokens in 135 steps").
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm --format=csv
for b in 16 1; do
  echo "== decode_b1 --batch $b"
  timeout 90 python3 -m probes.decode_b1 --batch $b --kv-lens 1097 --splits 0 --cold --out $OUT/decode_b1_batch$b.json 2>&1 | grep '^{' | cut -c1-3000
done
E="-m benchmarks.e2e --profile --skip-prefill --no-baseline --batches 1 16 --top-kernels 80"
for t in base samp trim_dus trim_pred; do
  echo "== e2e $t"
  if [ $t = samp ]; then d=$PWD; else d=$PWD/.run/$t; fi
  (cd $d && PYTHONPATH=$d timeout 90 python3 $E --out $OUT/e2e_$t.json 2>&1 | grep -v Warning | grep -A1 "^kind\|Error" | tail -6)
done
