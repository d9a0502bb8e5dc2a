#!/bin/bash
# Run 165: the unmasked decode steps at B=16 and 64 (kernel A/B against HEAD, alternating),
# then the README table (e2e with the HF anchor) with the tree the A/B keeps.
set -o pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,clocks.sm --format=csv
K="-m probes.decode_configs --batches 16 64 --variants"
for t in base new base new; do
  echo "== kernel $t"
  if [ $t = base ]; then d=$PWD/.run/base; else d=$PWD; fi
  (cd $d && PYTHONPATH=$d timeout 60 python3 $K "mosaic default" 2>&1 | grep '^{' | tee -a $OUT/kern_$t.jsonl)
done
keep=$(python3 - <<'PY'
import json, os, statistics
def us(t, b):
    rows = [json.loads(l) for l in open(os.environ["OUT"] + f"/kern_{t}.jsonl")]
    return statistics.mean(r["us"] for r in rows if r["batch"] == b and "us" in r)
try:
    ok = all(us("new", b) <= us("base", b) + 0.2 for b in (16, 64))
except Exception as e:
    ok = False
print("new" if ok else "base")
PY
)
echo "== README table with the $keep tree"
if [ $keep = base ]; then d=$PWD/.run/base; else d=$PWD; fi
(cd $d && PYTHONPATH=$d timeout 330 python3 -m benchmarks.e2e --profile --hf --batch-prompts 0 --chunks 512 2048 --top-kernels 40 --out $OUT/h200_e2e_$keep.json 2>&1 | tee $OUT/e2e_table.txt | grep -A1 "^kind")
