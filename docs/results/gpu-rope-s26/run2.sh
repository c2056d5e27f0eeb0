#!/bin/bash
# Call 2 (session 26): the 28-layer prefill A/B again (run1.sh without the checks), then
# a per-launch trace of a 2-layer model's 16 x 2048 prefill, each FFN path alone.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
CHECK=0 TAG=b bash docs/results/gpu-rope-s26/run1.sh "$@"
for p in sparse dense; do
  timeout 100 ncu --clock-control none --csv --page raw --metrics gpu__time_duration.sum /tmp/twell bench model --device cuda --dtype bf16 --shape 2048x5632x2 --heads 32 --vocab 49152 --density 0.005 --prefill 16x2048 --decode-batch 1 --decode-steps 2 --train "" --reps 2 --warmup 0 --energy-secs 0 --ffn-paths $p > /tmp/trace-$p.csv 2>&1
  echo "trace $p rc $? $(wc -l < /tmp/trace-$p.csv) lines"
  xz -T4 -c /tmp/trace-$p.csv > $OUT/trace-$p.csv.xz
done
