set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=28a56f0507d0f80b79f314480d21dc2c6d206304
timeout 150 python3 -m pytest -q -m gpu tests/test_layer_kernels.py tests/test_engine.py tests/test_hf_parity.py > $OUT/t1.log 2>&1; echo "t1 rc $?"; tail -n 4 $OUT/t1.log
s=$(date +%s)
timeout 420 python3 -m benchmarks.e2e --profile --hf --batch-prompts 0 --chunks 512 2048 --top-kernels 40 --out $OUT/h200_e2e.json > $OUT/e2e.log 2>&1; echo "e2e rc $? $(( $(date +%s) - s )) s"
python3 .run/cmp.py $OUT/h200_e2e.json
