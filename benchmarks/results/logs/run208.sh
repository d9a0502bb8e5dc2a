#!/bin/bash
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true --xla_gpu_per_fusion_autotune_cache_dir=/tmp/atc"
(NAME=a_trace1 TRACE1=1 NOCOPY=1 timeout 200 python3 .run/p207.py 2>&1 | grep -v -i warn | grep -v "^{'label\|^window\|^traced"
 NAME=b_vlog NOCOPY=1 TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_cmd=2 TF_CPP_MIN_LOG_LEVEL=0 timeout 200 python3 .run/p207.py > $OUT/vlog.txt 2>&1; grep "^window\|^traced" $OUT/vlog.txt) | tee $OUT/log
