#!/bin/bash
# Run 221: GPU tests of the session's engine.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 260 python3 -m pytest -q -m gpu tests/test_engine.py tests/test_hf_parity.py tests/test_shared_prefix.py > $OUT/t1.log 2>&1; echo "t1 rc $?" >> $OUT/t1.log
 XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 120 python3 -m pytest -q tests/test_engine.py -k "follows or before_the_block or failed_step_runs or mixed_steps_compile or pool_updates_compile" > $OUT/t3.log 2>&1; echo "t3 rc $?" >> $OUT/t3.log) &
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 300 python3 -m pytest -q -m gpu tests/test_model.py > $OUT/t2.log 2>&1; echo "t2 rc $?" >> $OUT/t2.log) &
wait
tail -n 3 $OUT/t1.log $OUT/t3.log $OUT/t2.log | tee $OUT/log
