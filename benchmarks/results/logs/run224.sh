#!/bin/bash
# Run 224: the README table's command on the session's engine.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 535 python3 -m benchmarks.e2e --profile --hf --batch-prompts 0 --chunks 512 2048 --top-kernels 40 --out $OUT/h200_e2e.json 2>&1 | tee $OUT/log
