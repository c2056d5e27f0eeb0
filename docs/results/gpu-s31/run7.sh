#!/bin/bash
# Session 31, the final kernels (`walk_pairs` in the prefill row kernels, no prefetch):
# check-gpu, then the MLP at the #4 bar sizes (one token first) and the training step,
# on this build.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s31/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 200 /tmp/twell check-gpu --json $OUT/check.json > $OUT/check.log 2>&1
echo "check rc $?"; tail -1 $OUT/check.log; grep FAIL $OUT/check.log | head
timeout 150 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 1,2048,16384,65536 \
  --density 0.005,0.01,0.03 --reps 15 --warmup 3 --json $OUT/mlp.json > $OUT/mlp.log 2>&1
echo "mlp rc $?"; grep -v 'stages' $OUT/mlp.log
timeout 200 /tmp/twell bench mlp-train --device cuda --tokens 2048,16384,65536 --density 0.005,0.01,0.03 \
  --reps 7 --json $OUT/mlp-train.json > $OUT/mlp-train.log 2>&1
echo "train rc $?"; tail -12 $OUT/mlp-train.log
