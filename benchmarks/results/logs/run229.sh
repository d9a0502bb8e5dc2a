#!/bin/bash
# Run 229: where an admission's launch-to-read goes on the GPU's timeline: probes.mixed_step
# --trace (packed inputs, graphs up to 2048; command buffers kept under the profiler).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAXPAGED_COMMIT=$1
XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true timeout 300 python3 -m probes.mixed_step --graphs-up-to 2048 --reps 3 --trace --out $OUT/mixed_trace.json 2>&1 | grep -v -i warn | tee $OUT/log
