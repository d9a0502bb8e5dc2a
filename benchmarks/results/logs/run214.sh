#!/bin/bash
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
timeout 170 python3 -m benchmarks.serving --out $OUT/h200_serving.json 2>&1 | grep -v -i warn | tee $OUT/log
timeout 110 python3 -m pytest -q -x -m gpu tests/test_engine.py 2>&1 | tail -n 5 | tee -a $OUT/log
