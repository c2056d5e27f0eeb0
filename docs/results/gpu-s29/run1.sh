#!/bin/bash
# Call 1 (session 29): check-gpu with the products path (`twell_mlp_products`) beside the
# TwELL kernels on every MLP case, then the MLP forward with `Auto` taking the products
# path on its dense side: dense (candle), sparse (TwELL kernels) and auto in one process.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/s29/twell.xz > /tmp/twell && chmod +x /tmp/twell
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 150 /tmp/twell check-gpu --json $OUT/check.json > $OUT/check.log 2>&1
echo "check rc $?"; tail -3 $OUT/check.log; grep FAIL $OUT/check.log | head -20; grep -E '^ +products' $OUT/check.log | head -40
timeout 220 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 2048,16384,65536 \
  --density 0.005,0.01,0.015,0.02,0.03 --reps 15 --warmup 3 --json $OUT/mlp.json > $OUT/mlp.log 2>&1
echo "mlp rc $?"; cat $OUT/mlp.log | grep -v 'stages\|peak'
timeout 150 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 --tokens 1,256,512,2048,16384 \
  --density 0.1,0.5 --reps 9 --warmup 2 --json $OUT/mlp-high.json > $OUT/mlp-high.log 2>&1
echo "high rc $?"; cat $OUT/mlp-high.log | grep -v 'stages\|peak'
