#!/bin/bash
# Session 49: where the layer kernel's barriers lose time, per SM (lateness), against the skeleton.
set -o pipefail
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD timeout 120 python3 -m probes.layer_stream --rows 2 --cases ws \
  --profile-dir /tmp/ls_trace --out $OUT/ws_trace.json 2>&1 | grep -v -i warn | grep -v '"case": "trace"' | tee -a $OUT/log
PYTHONPATH=$PWD timeout 300 python3 -m probes.layer_kernel --weights direct --rows 1 --splits 10 --stages 4 \
  --cases kernel_free kernel_bare kernel_nowait kernel_nostore kernel --profile-dir /tmp/lk_trace --trace-cases kernel_bare kernel \
  --out $OUT/layer_kernel_lateness.json 2>&1 | grep -v -i warn | tee -a $OUT/log
