#!/bin/bash
# Session 49, call 2: the layer kernel with its partial sums stored from registers and each
# weight slot freed before the store (the new defaults): the layer path's GPU tests, then
# the probe's cases against the old TMA stores.
set -o pipefail
export PYTHONUNBUFFERED=1
B=$(git rev-parse --short HEAD 2>/dev/null || echo layer-default)
quiet() { grep -v -i warn | tee -a $OUT/log; }
PYTHONPATH=$PWD timeout 240 python3 -m pytest -q -m gpu tests/test_layer_path.py 2>&1 | tail -30 | tee -a $OUT/log
PYTHONPATH=$PWD JAXPAGED_COMMIT=$B timeout 300 python3 -m probes.layer_kernel --weights direct --rows 1 --splits 10 --stages 4 \
  --cases kernel_free kernel_nostore kernel_bare_tma kernel_bare kernel_tma kernel_early_tma kernel xla \
  --out $OUT/layer_kernel_regs.json 2>&1 | quiet
