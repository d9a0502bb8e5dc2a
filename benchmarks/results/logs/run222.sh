#!/bin/bash
# Run 222: serving, e4a5cab (.run/base) against this tree, one process each.
# .run/base holds e4a5cab: mkdir -p .run/base && git archive e4a5cab | tar -x -C .run/base
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
(cd .run/base && PYTHONPATH=$PWD JAXPAGED_COMMIT=e4a5cab timeout 200 python3 -m benchmarks.serving --out $OUT/serving_base.json) 2>&1 | grep -v -i warn | tee $OUT/log
timeout 200 python3 -m benchmarks.serving --out $OUT/serving.json 2>&1 | grep -v -i warn | tee -a $OUT/log
# After the timings: run 221's two compile tests on the GPU (cut there by its time limit).
timeout 200 python3 -m pytest -q tests/test_engine.py -k "mixed_steps_compile or pool_updates_compile" > $OUT/t3.log 2>&1; echo "t3 rc $?" >> $OUT/t3.log
tail -n 3 $OUT/t3.log | tee -a $OUT/log
