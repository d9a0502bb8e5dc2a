#!/bin/bash
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
timeout 285 python3 -m benchmarks.e2e --hf --skip-prefill --batches 16 1 --profile --out $OUT/h200_e2e.json 2>&1 | grep -v -i warn | tee $OUT/log
