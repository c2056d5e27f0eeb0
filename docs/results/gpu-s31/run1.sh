#!/bin/bash
# Session 31: the down projection from Wd in shared memory (gated_t2d_cols). check-gpu
# (every prefill case through both down kernels, and their outputs compared bit for bit),
# then the MLP at the #4 prefill cells with TWELL_DOWN=rows and =cols alternating.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s31/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 200 /tmp/twell check-gpu > $OUT/check.log 2>&1
echo "check rc $?"; tail -2 $OUT/check.log; grep -E "FAIL|down kernels" $OUT/check.log | head -20
for round in 1 2; do
  for k in rows cols; do
    TWELL_DOWN=$k timeout 120 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
      --tokens 2048,16384,65536 --density 0.005,0.01,0.03 --reps 11 --warmup 3 \
      --json $OUT/mlp-$k-$round.json > $OUT/mlp-$k-$round.log 2>&1
    echo "== $k round $round rc $?"; grep -v 'stages\|peak' $OUT/mlp-$k-$round.log | tail -12
  done
done
