#!/bin/bash
# Run 171: the rest of the engine's GPU tests and HF parity with session 33's trims, then the
# README table (e2e with the HF anchor) on this tree.
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm --format=csv
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 200 python3 -m pytest -m gpu -q tests/test_engine.py -k "not (block or blocks or sampl or stop or greedy)" 2>&1 | tail -6 > $OUT/tests_engine_rest.txt &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 200 python3 -m pytest -m gpu -q tests/test_hf_parity.py tests/test_shared_prefix.py 2>&1 | tail -6 > $OUT/tests_parity_prefix.txt &
wait
cat $OUT/tests_engine_rest.txt $OUT/tests_parity_prefix.txt
echo "== README table"
timeout 360 python3 -m benchmarks.e2e --profile --hf --batch-prompts 0 --chunks 512 2048 --top-kernels 40 --out $OUT/h200_e2e.json 2>&1 | tee $OUT/e2e_table.txt | grep -A1 "^kind"
