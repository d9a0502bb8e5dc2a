#!/bin/bash
# Run 228: one 4096-token prompt single-shot and in chunks of 512 (e2e's prefill rows), HEAD
# before packing (.run/head) and the packed tree, one process each, twice in turn.
set -o pipefail
export PYTHONUNBUFFERED=1 JAXPAGED_COMMIT=$1
ARGS="--batches --chunks 512 --batch-prompts 0 --no-baseline"
for i in 1 2; do
  (cd .run/head && PYTHONPATH=$PWD timeout 140 python3 -m benchmarks.e2e $ARGS --out $OUT/head$i.json) 2>&1 | grep -v -i warn | tee -a $OUT/log
  PYTHONPATH=$PWD timeout 140 python3 -m benchmarks.e2e $ARGS --out $OUT/packed$i.json 2>&1 | grep -v -i warn | tee -a $OUT/log
done
