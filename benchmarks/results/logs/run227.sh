#!/bin/bash
# Run 227: a step's host inputs packed into one array. probes.mixed_step (graphs up to 2048,
# 12 reps) on HEAD (.run/head) then on this tree, one process each, then the GPU tests.
set -o pipefail
export PYTHONUNBUFFERED=1 JAXPAGED_COMMIT=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
(cd .run/head && PYTHONPATH=$PWD timeout 200 python3 -m probes.mixed_step --graphs-up-to 2048 --reps 12 --out $OUT/mixed_head.json) 2>&1 | grep -v -i warn | tee $OUT/log
PYTHONPATH=$PWD timeout 200 python3 -m probes.mixed_step --graphs-up-to 2048 --reps 12 --out $OUT/mixed_packed.json 2>&1 | grep -v -i warn | tee -a $OUT/log
export PYTHONPATH=$PWD
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 260 python3 -m pytest -q -m gpu tests/test_engine.py tests/test_hf_parity.py tests/test_shared_prefix.py > $OUT/t1.log 2>&1; echo "t1 rc $?" >> $OUT/t1.log
 XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 150 python3 -m pytest -q tests/test_engine.py -k "packed or mixed_steps_compile or pool_updates_compile or before_the_host_reads" > $OUT/t3.log 2>&1; echo "t3 rc $?" >> $OUT/t3.log) &
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 300 python3 -m pytest -q -m gpu tests/test_model.py > $OUT/t2.log 2>&1; echo "t2 rc $?" >> $OUT/t2.log) &
wait
tail -n 3 $OUT/t1.log $OUT/t3.log $OUT/t2.log | tee -a $OUT/log
