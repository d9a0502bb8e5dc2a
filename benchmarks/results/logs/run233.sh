#!/bin/bash
# Run 233: run 232's probes in the other order (branch packed-reads first, then main), to
# separate the change from the order: in run 232 the second process's host time in the call
# was 0.7 ms less although that code is the same in both trees.
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
PYTHONPATH=$PWD JAXPAGED_COMMIT=06e6d1e timeout 200 python3 -m probes.mixed_step --graphs-up-to 2048 --reps 12 --out $OUT/mixed_packed.json 2>&1 | grep -v -i warn | tee $OUT/log
(cd .run/main && PYTHONPATH=$PWD JAXPAGED_COMMIT=6173064 timeout 200 python3 -m probes.mixed_step --graphs-up-to 2048 --reps 12 --out $OUT/mixed_main.json) 2>&1 | grep -v -i warn | tee -a $OUT/log
