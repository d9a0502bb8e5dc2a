set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for r in new exh exh2; do
  extra=""; bs="1 64"
  case $r in exh*) extra="--decode-xla-option xla_gpu_exhaustive_tiling_search=true";; esac
  [ $r = exh2 ] && bs=64
  s=$(date +%s)
  timeout 170 python3 -m benchmarks.e2e --profile --skip-prefill --no-baseline --batches $bs --top-kernels 30 $extra --out $OUT/e2e_$r.json > $OUT/e2e_$r.log 2>&1; echo "e2e $r rc $? $(( $(date +%s) - s )) s"
  python3 .run/cmp.py $OUT/e2e_$r.json
done
