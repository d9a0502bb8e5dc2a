#!/bin/bash
# Run 164: the decode kernel's steps without the mask where every key is visible, and the
# scale in the exp's multiply-add (GPU tests, kernel A/B against HEAD, e2e A/B).
set -o pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,clocks.sm --format=csv
export PYTHONPATH=$PWD
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 230 python3 -m pytest -m gpu -q tests/test_mosaic_decode.py tests/test_merge.py 2>&1 | tail -8 > $OUT/tests_decode.txt &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 230 python3 -m pytest -m gpu -q tests/test_model.py tests/test_engine.py -k "block or blocks or chunk or single_shot or partial" 2>&1 | tail -8 > $OUT/tests_model.txt &
wait
cat $OUT/tests_decode.txt $OUT/tests_model.txt
K="-m probes.decode_configs --batches 1 16 64 --variants"
for t in base new; do
  echo "== kernel $t"
  if [ $t = base ]; then d=.run/base; else d=$PWD; fi
  (cd $d && PYTHONPATH=$d timeout 75 python3 $K "mosaic default" "mosaic splits=2" cudnn --out $OUT/kern_${t}_$RANDOM.json 2>&1 | grep -v Warning | tail -9)
done
E="-m benchmarks.e2e --profile --skip-prefill --no-baseline --batches 1 16 --top-kernels 40"
for t in base new; do
  echo "== e2e $t"
  if [ $t = base ]; then d=.run/base; else d=$PWD; fi
  (cd $d && PYTHONPATH=$d timeout 85 python3 $E --out $OUT/e2e_$t.json 2>&1 | grep -A3 "^kind")
done
