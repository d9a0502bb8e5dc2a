#!/bin/bash
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# .run/p212.py is logs/run213_slow_step.py.txt
timeout 400 python3 .run/p212.py --interval-ms 40 20 0 2>&1 | grep -v -i "warn\|^  " | tee $OUT/log
