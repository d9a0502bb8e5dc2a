#!/bin/bash
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 220 python3 -m benchmarks.serving --modes poll wait --out $OUT/h200_serving.json 2>&1 | grep -v -i warn | tee $OUT/log
