#!/usr/bin/env bash
# One device call on the H200: GPU tests and/or benchmarks, everything logged under $OUT.
#   bash benchmarks/run_h200.sh tests suites e2e
# The recorded suites (README table, notebooks) write $OUT/h200_<suite>.json:
#   bash benchmarks/run_h200.sh suites e2e    # decode + prefill + mixed in one process (~5 min)
#   bash benchmarks/run_h200.sh decode-suite   # or one at a time: prefill-suite, mixed-suite,
#                                               # shared_prefix-suite (not in `suites`)
#   bash benchmarks/run_h200.sh sharing        # n samples and the prefix cache: h200_sharing.json
# SUITE_ARGS (e.g. --quick), E2E_ARGS and SHARING_ARGS (e.g. --only rollout) are passed on.
# Each step is independent: a failing one is reported and the next still runs.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jaxpaged-out}
mkdir -p "$OUT"
python3 -c 'import jax; print(jax.__version__, jax.devices())'
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
status=0
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case "$step" in
    tests) python3 -m pytest -m gpu -q -x --durations=10 -p no:cacheprovider ${PYTEST_ARGS:-} ;;
    tests-all) python3 -m pytest -m gpu -q --durations=10 -p no:cacheprovider ${PYTEST_ARGS:-} ;;
    suites) python3 -m benchmarks.attention --suite decode prefill mixed \
      --out "$OUT/h200_{suite}.json" ${SUITE_ARGS:-} ;;
    decode-suite|prefill-suite|mixed-suite|shared_prefix-suite) python3 -m benchmarks.attention \
      --suite "${step%-suite}" --out "$OUT/h200_${step%-suite}.json" ${SUITE_ARGS:-} ;;
    e2e) python3 -m benchmarks.e2e --profile --hf --out "$OUT/h200_e2e.json" ${E2E_ARGS:-} ;;
    sharing) python3 -m benchmarks.sharing --out "$OUT/h200_sharing.json" ${SHARING_ARGS:-} ;;
    demo) python3 -m models.generate --config tiny --json ;;
    *) echo "unknown step $step"; false ;;
  esac
  rc=$?
  echo "=== $step rc=$rc ($(date +%T))"
  [ $rc -eq 0 ] || status=1
done
exit $status
