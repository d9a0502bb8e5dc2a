#!/bin/bash
# Run 225 (run 223 again): serving saturated with staggered admissions (an arrival every 4 ms, 64 new tokens),
# e4a5cab (.run/base) against this tree, one process each. .run/base holds e4a5cab:
#   mkdir -p .run/base && git archive e4a5cab | tar -x -C .run/base
# Run 223 itself was cut at 120 s a process, less than the build (~55 s) plus the decode
# block's first compile in the warm-up (~40 s of exhaustive tiling search) plus the streams;
# the limits below are what the next run needs.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
ARGS="--interval-ms 4 --new-tokens 64"
(cd .run/base && PYTHONPATH=$PWD JAXPAGED_COMMIT=e4a5cab timeout 240 python3 -m benchmarks.serving $ARGS --out $OUT/serving_base.json) 2>&1 | grep -v -i warn | tee $OUT/log
timeout 240 python3 -m benchmarks.serving $ARGS --out $OUT/serving.json 2>&1 | grep -v -i warn | tee -a $OUT/log
