#!/bin/bash
# Run 161: o and down as split-K partials summed in add_rms_norm (GPU tests, then e2e A/B).
set -o pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,clocks.sm --format=csv
export PYTHONPATH=$PWD
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 200 python3 -m pytest -m gpu -q tests/test_layer_kernels.py tests/test_layers.py tests/test_hf_parity.py 2>&1 | tail -8 > $OUT/tests_layers.txt &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 200 python3 -m pytest -q -m gpu tests/test_model.py tests/test_engine.py -k "block or blocks or chunk or single_shot or partial" 2>&1 | tail -8 > $OUT/tests_model.txt &
wait
cat $OUT/tests_layers.txt $OUT/tests_model.txt
# The Triton split merge in the Mosaic decode path (run 127's `merge`), on a copy of the tree.
mkdir -p /tmp/merge && cp -r benchmarks jaxpaged models pallas_kernels /tmp/merge/
sed -i 's/^    merge_splits,$//; s/return merge_splits(out, lse, out_dtype=q.dtype)/return merge_partials(out, lse, out_dtype=q.dtype)/' /tmp/merge/pallas_kernels/mosaic/paged_decode.py
sed -i 's/^from pallas_kernels.mosaic.common import (/from pallas_kernels.triton.merge import merge_partials\nfrom pallas_kernels.mosaic.common import (/' /tmp/merge/pallas_kernels/mosaic/paged_decode.py
grep -n "merge_partials\|merge_splits" /tmp/merge/pallas_kernels/mosaic/paged_decode.py
E="python3 -m benchmarks.e2e --profile --skip-prefill --no-baseline --batches 1 16 --top-kernels 40"
for v in "0 4" "16 4" "16 8" "0 4" "16 2"; do
  set -- $v
  echo "== output split-K max tokens $1, parts $2"
  timeout 90 $E --output-split-k-max-tokens $1 --output-split-k $2 --out $OUT/e2e_out$1_s$2_$RANDOM.json 2>&1 | grep -A1 "^kind"
done
echo "== Triton merge, output split-K 16 / 4"
(cd /tmp/merge && PYTHONPATH=/tmp/merge timeout 90 $E --out $OUT/e2e_merge.json 2>&1 | grep -A1 "^kind")
