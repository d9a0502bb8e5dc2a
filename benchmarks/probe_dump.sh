cd .snap && export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for w in mha ours; do XLA_FLAGS="--xla_dump_to=$OUT/dump_$w" python3 -m benchmarks.probe_dump $w 2>&1 | grep -v -i warn | tail -2; done
B=$(python3 -c "import triton,os;print(os.path.dirname(triton.__file__)+'/backends/nvidia/bin')"); ls $B
cd $OUT; for f in $(grep -l "\.entry" $(find . -name "*.ptx") ); do echo "== $f"; grep -o "\.entry [a-z_A-Z0-9]*" $f | head; done
for f in $(find . -name "*.ptx"); do $B/ptxas -arch=sm_90a -v $f -o ${f%.ptx}.cubin 2>&1 | grep -i "registers\|spill\|Compiling" | head -20; $B/cuobjdump -sass ${f%.ptx}.cubin > ${f%.ptx}.sass 2>/dev/null; done
find . -name "*.sass" | xargs ls -la; du -sh $OUT
find $OUT -type f ! -name "*.ptx" ! -name "*.sass" ! -iname "*triton*" ! -name log -delete; du -sh $OUT; find $OUT -type f | head -30
