#!/bin/bash
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 575 python3 -m benchmarks.e2e --profile --hf --batch-prompts 0 --chunks 512 2048 --top-kernels 40 --out $OUT/h200_e2e.json 2>&1 | tee $OUT/log
