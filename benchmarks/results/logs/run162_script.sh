#!/bin/bash
# Run 162: o and down partials into add_rms_norm with more warps per row program.
set -o pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,clocks.sm --format=csv
export PYTHONPATH=$PWD
timeout 100 python3 -m pytest -m gpu -q tests/test_layer_kernels.py -k add_rms_norm 2>&1 | tail -3
for v in "0 4 16" "16 4 16" "16 8 16" "16 4 32" "16 8 32"; do
  set -- $v
  echo "== output split-K max tokens $1, parts $2, norm warps $3"
  timeout 90 python3 -c "
import runpy, sys
import pallas_kernels.triton.add_rms_norm as n
n.PARTIAL_NUM_WARPS = $3
sys.argv = ['e2e', '--profile', '--skip-prefill', '--no-baseline', '--batches', '1', '16', '--top-kernels', '40', '--output-split-k-max-tokens', '$1', '--output-split-k', '$2', '--out', '$OUT/e2e_out$1_s$2_w$3.json']
runpy.run_module('benchmarks.e2e', run_name='__main__')
" 2>&1 | grep -A1 "^kind"
done
