#!/bin/bash
# Run 176: the split merge as a second Mosaic GPU kernel (pallas_kernels/mosaic/merge.py)
# against HEAD (6e0ef11, XLA's two-kernel merge): e2e B=1/16, one process a tree (new, head,
# new); then the GPU tests of the merge and the Mosaic decode path, two processes side by side.
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
E="-m benchmarks.e2e --profile --skip-prefill --no-baseline --batches 1 16 --top-kernels 80"
for t in new head new2; do
  echo "== e2e $t"
  d=$PWD; [ $t = head ] && d=$PWD/.run/head
  (cd $d && PYTHONPATH=$d timeout 100 python3 $E --out $OUT/e2e_${t}.json 2>&1 | grep -v Warning | grep "Error" | tail -3)
done
python3 .run/cmp.py $OUT/e2e_*.json
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 250 python3 -m pytest -m gpu -q tests/test_merge.py tests/test_mosaic_decode.py 2>&1 | tail -8 > $OUT/tests_merge_decode.txt &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 250 python3 -m pytest -m gpu -q tests/test_attention.py tests/test_hf_parity.py -k "mosaic or parity" 2>&1 | tail -8 > $OUT/tests_attention_parity.txt &
wait
cat $OUT/tests_merge_decode.txt $OUT/tests_attention_parity.txt
