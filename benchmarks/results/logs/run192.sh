set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -m gpu tests/test_mosaic_decode.py -k fold 2>&1 | tail -n 6
for r in new head new_exh new_exh2; do
  dir=.; [ $r = head ] && dir=.run/head
  extra=""; bs="1 16"
  case $r in new_exh*) extra="--decode-xla-option xla_gpu_exhaustive_tiling_search=true"; bs=16;; esac
  (cd $dir && PYTHONPATH=$PWD timeout 130 python3 -m benchmarks.e2e --profile --skip-prefill --no-baseline --batches $bs --top-kernels 30 $extra --out $OUT/e2e_$r.json > $OUT/e2e_$r.log 2>&1; echo "e2e $r rc $?")
  python3 .run/cmp.py $OUT/e2e_$r.json
done
