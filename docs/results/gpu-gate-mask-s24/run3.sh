#!/bin/bash
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
mkdir -p /tmp/b && [ -x /tmp/b/twell ] || { xz -dc -T4 .device/s24/twell.xz > /tmp/b/twell && chmod +x /tmp/b/twell; }
T=/tmp/b/twell
R=$OUT/r; mkdir -p $R
MODEL="--device cuda --dtype bf16 --shape 2048x5632x28 --heads 32 --vocab 49152 --density 0.005"
for g in mask plain mask plain; do
  TWELL_GATE=$g timeout 135 $T bench model $MODEL --prefill 4x2048,16x2048 --decode-batch 1 --decode-steps 8 --train "" --reps 3 --warmup 1 --energy-secs 10 > $R/model-$g-$(date +%s).log 2>&1
  echo "== $g rc $?"; ls -t $R/model-$g-*.log | head -1 | xargs grep -E "prefill|decode"
done
