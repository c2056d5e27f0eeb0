#!/bin/bash
# Session 30: check-gpu on this session's build (the host screen and polling workers, and
# Auto deciding many tokens only by a density measured on enough rows; no kernel changed),
# then the MLP at the #4 cells, one token first as before (run2: after the Auto change).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s30/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 150 /tmp/twell check-gpu > $OUT/check.log 2>&1
echo "check rc $?"; tail -2 $OUT/check.log; grep FAIL $OUT/check.log | head
timeout 150 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 1,2048,16384,65536 \
  --density 0.005,0.01,0.03 --reps 15 --warmup 3 --json $OUT/mlp.json > $OUT/mlp.log 2>&1
echo "mlp rc $?"; grep -v 'stages\|peak' $OUT/mlp.log
