#!/bin/bash
# Run 231: the read-back microbench on its own.
set -o pipefail; PYTHONUNBUFFERED=1 timeout 150 python3 .run/readback.py 2>&1 | grep -v -i warn | tee $OUT/log
