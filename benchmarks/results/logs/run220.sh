#!/bin/bash
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 400 python3 -m probes.mixed_step --graphs-up-to 512 2048 --reps 12 --profile --out $OUT/mixed_step.json 2>&1 | grep -v -i warn | tee $OUT/log
