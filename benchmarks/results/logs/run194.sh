set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 270 python3 -m pytest -q -m gpu tests/test_mosaic_decode.py -k fold tests/test_layer_kernels.py tests/test_engine.py tests/test_hf_parity.py > $OUT/t1.log 2>&1; echo "t1 rc $?" >> $OUT/t1.log) &
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 270 python3 -m pytest -q -m gpu tests/test_model.py --durations=5 > $OUT/t2.log 2>&1; echo "t2 rc $?" >> $OUT/t2.log) &
wait; tail -n 25 $OUT/t1.log; tail -n 14 $OUT/t2.log
