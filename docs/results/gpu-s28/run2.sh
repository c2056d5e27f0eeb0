#!/bin/bash
# Call 2 (session 28): the CUDA issue's bar sizes on this build, dense and sparse side by
# side in one process each: the MLP forward (M = 1, 2048, 16384, 65536) and the training
# step (M = 2048, 16384, 65536), at 0.5% / 1% / 3%.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s28/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 280 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 1,2048,16384,65536 \
  --density 0.005,0.01,0.03 --reps 15 --warmup 3 --json $OUT/mlp.json > $OUT/mlp.log 2>&1
echo "mlp rc $?"; tail -16 $OUT/mlp.log
timeout 200 /tmp/twell bench mlp-train --device cuda --tokens 2048,16384,65536 --density 0.005,0.01,0.03 \
  --reps 7 --json $OUT/mlp-train.json > $OUT/mlp-train.log 2>&1
echo "train rc $?"; tail -12 $OUT/mlp-train.log
