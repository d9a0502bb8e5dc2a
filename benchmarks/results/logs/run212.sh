#!/bin/bash
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
timeout 400 python3 -m benchmarks.serving --out $OUT/h200_serving.json 2>&1 | grep -v -i warn | tee $OUT/log
