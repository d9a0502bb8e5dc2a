#!/bin/bash
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
S="python3 -m benchmarks.serving --modes wait poll --interval-ms 40 20 0"
timeout 200 $S --mixed-step-tokens --out $OUT/serving_budget_only.json 2>&1 | grep -v -i warn | tee $OUT/log
timeout 230 $S --graphs-up-to 2048 --out $OUT/serving_graphs.json 2>&1 | grep -v -i warn | tee -a $OUT/log
timeout 120 python3 -m pytest -q tests/test_engine.py -k "pool_updates_compile or mixed_steps_compile" 2>&1 | tail -n 3 | tee -a $OUT/log
