#!/bin/bash
# Run 232: what the host reads of a step or block in one copy (branch packed-reads, 06e6d1e)
# against main (6173064, .run/main), probes.mixed_step (graphs up to 2048, 12 reps), one
# process each; then the branch's GPU tests, two processes side by side.
#   mkdir -p .run/main && git archive main | tar -x -C .run/main
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
(cd .run/main && PYTHONPATH=$PWD JAXPAGED_COMMIT=6173064 timeout 200 python3 -m probes.mixed_step --graphs-up-to 2048 --reps 12 --out $OUT/mixed_main.json) 2>&1 | grep -v -i warn | tee $OUT/log
PYTHONPATH=$PWD JAXPAGED_COMMIT=06e6d1e timeout 200 python3 -m probes.mixed_step --graphs-up-to 2048 --reps 12 --out $OUT/mixed_packed.json 2>&1 | grep -v -i warn | tee -a $OUT/log
export PYTHONPATH=$PWD
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 150 python3 -m pytest -q -m gpu tests/test_engine.py > $OUT/t1.log 2>&1; echo "t1 rc $?" >> $OUT/t1.log) &
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 150 python3 -m pytest -q tests/test_engine.py -k "packed or smallest_size or before_the_host_reads or stop_token_sampled" > $OUT/t2.log 2>&1; echo "t2 rc $?" >> $OUT/t2.log) &
wait
tail -n 4 $OUT/t1.log $OUT/t2.log | tee -a $OUT/log
