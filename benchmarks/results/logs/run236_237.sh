#!/bin/bash
# Runs planned in sessions 46-47. The working tree is branch layer-default (layer-path + the
# default flip); .run/main holds main
# (git archive) and .run/pinned the pinned-read branch. Each its own device call:
#   bash .run/s47.sh kernel (run 236, ~440 s): the layer path's GPU tests (layer kernel,
#       norm_qkv kernel, 2-layer 1b decoder, induction tokens through the engine) and the
#       merge's, side by side; then probes.layer_kernel with the model's matrices (direct):
#       check, kernel at 4 and 8 stages / xla, a trace, at 1 row; kernel / xla at 8 rows
#       (B=8: the prologues take rows one after another)
#   bash .run/s47.sh table  (run 237, ~500 s): the README table on the branch with the HF
#       anchor, B=1 in three variants (XLA layers, layer kernel, layer kernel in one slot),
#       B=16 / 64 (XLA layers: more than 8 rows), chunks of 512 / 2048
#   bash .run/s47.sh ab     (~400 s, with time left): pinned-read against main
#   bash .run/s47.sh live1  (~100 s, with time left): the kernel at 2 rows, one inactive
#   bash .run/s47.sh diag   (~150 s, if the kernel is slow): kernel_bare / kernel_free
# Predictions: NOTES sessions 45-47.
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
B=$(git rev-parse --short HEAD 2>/dev/null || echo layer-path)
quiet() { grep -v -i warn | tee -a $OUT/log; }
lk() { PYTHONPATH=$PWD JAXPAGED_COMMIT=$B timeout $1 python3 -m probes.layer_kernel "${@:2}" 2>&1 | quiet; }
warm() { timeout 60 python3 -c "import jax, jax.numpy as jnp; x = jnp.ones((4096, 4096), jnp.bfloat16); [(x @ x).block_until_ready() for _ in range(300)]; print('warm-up done')" 2>&1 | tail -1 | tee -a $OUT/log; }
probe() { (cd $1 && PYTHONPATH=$PWD JAXPAGED_COMMIT=$(cat .commit) timeout 140 python3 -m probes.mixed_step --graphs-up-to 2048 --reps 12 --out $OUT/mixed_$2.json) 2>&1 | quiet; }
case "$1" in
kernel)
  (PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 280 python3 -m pytest -q -m gpu tests/test_layer_path.py > /tmp/t1.log 2>&1; echo "layer_path rc=$?" >> /tmp/t1.log) &
  (PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 timeout 260 python3 -m pytest -q -m gpu tests/test_merge.py > /tmp/t2.log 2>&1; echo "merge rc=$?" >> /tmp/t2.log) &
  wait
  tail -60 /tmp/t1.log | tee -a $OUT/log; tail -4 /tmp/t2.log | tee -a $OUT/log
  lk 170 --weights direct --rows 1 --splits 10 --stages 4 8 --cases kernel xla \
     --profile-dir /tmp/layer_kernel_trace --out $OUT/layer_kernel_direct.json
  lk 100 --weights direct --rows 8 --splits 4 --stages 4 --cases kernel xla --out $OUT/layer_kernel_rows8.json ;;
diag)  # where a slow kernel's time goes: without prologues, without barriers too
  lk 150 --weights direct --rows 1 --splits 10 --stages 4 --cases kernel_bare kernel_free --out $OUT/layer_kernel_diag.json ;;
table)
  PYTHONPATH=$PWD JAXPAGED_COMMIT=$B timeout 580 python3 -m benchmarks.e2e --profile --hf --batch-prompts 0 \
    --chunks 512 2048 --top-kernels 40 --decode-variants plain layer layer-1slot --out $OUT/h200_e2e.json 2>&1 | quiet ;;
ab)
  warm; probe .run/main main1; probe .run/pinned pinned2; probe .run/pinned pinned3; probe .run/main main4 ;;
live1)
  lk 100 --weights direct --rows 2 --live 1 --splits 10 --cases kernel --out $OUT/layer_kernel_live1.json ;;
esac
