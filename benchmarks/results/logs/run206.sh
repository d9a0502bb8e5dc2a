#!/bin/bash
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
A="--skip-prefill --no-baseline --batches 16"
(timeout 125 python3 -m benchmarks.e2e $A --out $OUT/gc_on.json 2>&1 | grep -v Warn | tail -3
 timeout 125 python3 -c "import gc, runpy, sys; gc.disable(); sys.argv=['e2e']+sys.argv[1:]; runpy.run_module('benchmarks.e2e', run_name='__main__')" $A --out $OUT/gc_off.json 2>&1 | grep -v Warn | tail -3) | tee $OUT/log
