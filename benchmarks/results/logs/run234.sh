#!/bin/bash
# Run 234: the GPU engine tests of branch packed-reads alone (run 232 cut them at 150 s beside another pytest).
set -o pipefail; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; timeout 330 python3 -m pytest -q -m gpu tests/test_engine.py --durations=8 2>&1 | tail -15 | tee $OUT/log
