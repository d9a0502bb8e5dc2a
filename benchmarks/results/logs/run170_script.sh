#!/bin/bash
# Run 170: GPU tests of session 33's block-step trims (the fused max/argmax/sum-exp sampling
# reduction, the block's output rows by dynamic_update_slice), then e2e B=1/16 on this tree
# with the defaults, and with XLA's exhaustive GEMM tiling on decode blocks only (the README's
# opt-in), its autotune cache in /tmp.
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 210 python3 -m pytest -m gpu -q tests/test_engine.py -k "block or blocks or sampl or stop or greedy" 2>&1 | tail -6 > $OUT/tests_engine.txt &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 210 python3 -m pytest -q tests/test_sampling.py tests/test_model.py -k "sampl or logprob or greedy" 2>&1 | tail -6 > $OUT/tests_sampling_model.txt &
wait
cat $OUT/tests_engine.txt $OUT/tests_sampling_model.txt
E="-m benchmarks.e2e --profile --skip-prefill --no-baseline --batches 1 16 --top-kernels 80"
echo "== e2e main"
timeout 100 python3 $E --out $OUT/e2e_main.json 2>&1 | grep -v Warning | grep -A1 "^kind\|Error" | tail -6
echo "== e2e exhaustive (decode only)"
mkdir -p /tmp/autotune
/usr/bin/time -f "%e s wall" timeout 220 env XLA_FLAGS=--xla_gpu_per_fusion_autotune_cache_dir=/tmp/autotune python3 $E --decode-xla-option xla_gpu_exhaustive_tiling_search=true --out $OUT/e2e_exhaustive.json 2>&1 | grep -v Warning | grep -A1 "^kind\|Error\|s wall" | tail -7
ls /tmp/autotune | wc -l
