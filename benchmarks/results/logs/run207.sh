#!/bin/bash
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true --xla_gpu_per_fusion_autotune_cache_dir=/tmp/atc"
(NAME=a_copy timeout 230 python3 .run/p207.py 2>&1 | grep -v -i warn
 NAME=b_nocopy NOCOPY=1 timeout 230 python3 .run/p207.py 2>&1 | grep -v -i warn) | tee $OUT/log
