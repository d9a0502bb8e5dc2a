#!/bin/bash
# Run 235: serving saturated (an arrival every 4 ms, 64 new tokens), branch packed-reads
# (06e6d1e) FIRST, then main (6173064, .run/main): run 232-233 showed the second process of
# a call runs faster, so the branch takes the slower place.
set -o pipefail
export PYTHONUNBUFFERED=1
ARGS="--interval-ms 4 --new-tokens 64"
PYTHONPATH=$PWD JAXPAGED_COMMIT=06e6d1e timeout 250 python3 -m benchmarks.serving $ARGS --out $OUT/serving_packed.json 2>&1 | grep -v -i warn | tee $OUT/log
(cd .run/main && PYTHONPATH=$PWD JAXPAGED_COMMIT=6173064 timeout 250 python3 -m benchmarks.serving $ARGS --out $OUT/serving_main.json) 2>&1 | grep -v -i warn | tee -a $OUT/log
