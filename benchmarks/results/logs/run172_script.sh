#!/bin/bash
# Run 172: is_stop as n compares (no reduction kernel) against HEAD (4d6a8d4): the engine's
# GPU tests that stop rows, then e2e B=1/16, one process a tree, alternating.
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -m gpu -q tests/test_engine.py -k "stop or block" 2>&1 | tail -4
E="-m benchmarks.e2e --profile --skip-prefill --no-baseline --batches 1 16 --top-kernels 80"
for t in new head new; do
  echo "== e2e $t"
  if [ $t = new ]; then d=$PWD; else d=$PWD/.run/$t; fi
  (cd $d && PYTHONPATH=$d timeout 90 python3 $E --out $OUT/e2e_${t}_$SECONDS.json 2>&1 | grep -v Warning | grep -A1 "^kind\|Error" | tail -6)
done
