#!/bin/bash
# Run 226: where a mixed step's host call goes in command buffers. The H2D microbench (k numpy
# inputs against one packed), then probes.mixed_step with graphs up to 2048, 4 reps, and one
# traced admission a size (command buffers kept during profiling).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
timeout 60 python3 .run/h2d.py 2>&1 | grep -v -i warn | tee $OUT/log
XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout 400 python3 -m probes.mixed_step --graphs-up-to 2048 --reps 4 --trace --out $OUT/mixed_step.json 2>&1 | grep -v -i warn | tee -a $OUT/log
