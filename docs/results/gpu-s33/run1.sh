#!/bin/bash
# Session 33: check-gpu on the session's build (MLP biases in the dispatch; the row split's
# host refactor of 40ec925, not yet run on the H200), then the bar's prefill sizes at 0.5%
# and 1% as a regression read against s31/s32.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s33/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 150 /tmp/twell check-gpu --json $OUT/check.json > $OUT/check.log 2>&1
echo "check rc $?"; tail -1 $OUT/check.log; grep -i "fail\|error" $OUT/check.log | head
timeout 200 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,16384,65536 \
  --density 0.005,0.01 --reps 11 --warmup 3 --json $OUT/mlp.json > $OUT/mlp.log 2>&1
echo "bench rc $?"; grep "2048   5632" $OUT/mlp.log | head -12
