#!/bin/bash
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 420 python3 -m pytest -q -m gpu tests/test_engine.py tests/test_hf_parity.py tests/test_shared_prefix.py > $OUT/t1.log 2>&1; echo "t1 rc $?" >> $OUT/t1.log
 XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 120 python3 -m pytest -q "tests/test_engine.py::test_pool_updates_compile_with_the_engine_and_change_nothing" > $OUT/t3.log 2>&1; echo "t3 rc $?" >> $OUT/t3.log) &
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 540 python3 -m pytest -q -m gpu tests/test_model.py > $OUT/t2.log 2>&1; echo "t2 rc $?" >> $OUT/t2.log) &
wait
tail -n 3 $OUT/t1.log $OUT/t3.log $OUT/t2.log | tee $OUT/log
