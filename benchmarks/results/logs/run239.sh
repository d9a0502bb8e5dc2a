#!/bin/bash
# Session 48's question for the next device session (NOTES session 48): what a phase boundary
# of the layer kernel adds over the skeleton's ~1.7 us barrier. ~200 s, one call:
#   bash .run/s48.sh 2>&1 | tee $OUT/run.log
# 1. the skeleton's barriers with a dependent load after each (stores complete before it)
# 2. the layer kernel without prologues (kernel_bare), traced: the arrival spreads and
#    releases without the merge, norm and SwiGLU code
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
PYTHONPATH=$PWD timeout 150 python3 -m probes.layer_stream --rows 2 --cases ws ws_nobarrier ws_dependent \
  --dependent-kb 8 32 --out $OUT/layer_stream_dependent.json 2>&1 | grep -v -i warn | tee -a $OUT/log
PYTHONPATH=$PWD timeout 150 python3 -m probes.layer_kernel --weights direct --rows 1 --splits 10 --stages 4 \
  --cases kernel_bare kernel --profile-dir /tmp/layer_kernel_trace --out $OUT/layer_kernel_bare_trace.json \
  2>&1 | grep -v -i warn | tee -a $OUT/log
