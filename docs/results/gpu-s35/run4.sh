#!/bin/bash
# Session 35 (run4: after the union kernels were removed; run11: the final build, with the
# leaner vector pack too; the thirty-fourth
# session's refactors of the CUDA launchers in): check-gpu, then the CUDA issue's bar sizes,
# dense and sparse side by side in one process each: the MLP forward (M = 1, 2048, 16384,
# 65536) and the training step (M = 2048, 16384, 65536), at 0.5% / 1% / 3%.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 150 /tmp/twell check-gpu --json $OUT/check.json > $OUT/check.log 2>&1
echo "check rc $?"; tail -1 $OUT/check.log; grep -i "fail" $OUT/check.log | head -5
timeout 280 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 1,2048,16384,65536 \
  --density 0.005,0.01,0.03 --reps 15 --warmup 3 --json $OUT/mlp.json > $OUT/mlp.log 2>&1
echo "mlp rc $?"; tail -14 $OUT/mlp.log
timeout 200 /tmp/twell bench mlp-train --device cuda --tokens 2048,16384,65536 --density 0.005,0.01,0.03 \
  --reps 7 --json $OUT/mlp-train.json > $OUT/mlp-train.log 2>&1
echo "train rc $?"; tail -12 $OUT/mlp-train.log
